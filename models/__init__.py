"""Architectures, keyed by the `architectures` entry of a Hugging Face config.json."""
from __future__ import annotations

from functools import partial
from typing import Callable

from ..dsl import Graph
from . import gemma2, gemma3, gpt_oss, llama, mixtral, olmo2, phi3, qwen3, qwen3_moe, smollm3
from .config import ConfigError, DecoderConfig, rope_inv_freq

ARCHITECTURES = {
    "LlamaForCausalLM": llama.build,
    "MistralForCausalLM": llama.build,
    "Qwen2ForCausalLM": partial(llama.build, qkv_bias=True),   # Llama + bias on Q, K, V only
    "Qwen3ForCausalLM": qwen3.build,
    "Qwen3MoeForCausalLM": qwen3_moe.build,
    "Gemma2ForCausalLM": gemma2.build,
    "Gemma3ForCausalLM": gemma3.build,
    "MixtralForCausalLM": mixtral.build,
    "Olmo2ForCausalLM": olmo2.build,
    "SmolLM3ForCausalLM": smollm3.build,
    "Phi3ForCausalLM": phi3.build,
    "GptOssForCausalLM": gpt_oss.build,
}
# Architectures whose graph reads some weights as rows of a checkpoint tensor (fused projections)
CHECKPOINT_ROWS = {"Phi3ForCausalLM": phi3.checkpoint_rows}
# Architectures whose graph reads some weights computed from checkpoint tensors (gpt-oss's experts)
CHECKPOINT_VIEWS = {"GptOssForCausalLM": gpt_oss.checkpoint_views}
# Architectures whose graph depends on the engine's context (Phi-3's LongRoPE: long or short factors)
TAKES_CONTEXT = {"Phi3ForCausalLM"}
# Multimodal checkpoints read as their language model: architecture -> (the language model's config
# from the checkpoint's config.json, the language model's name of a tensor or None where it is not one)
LANGUAGE_MODELS = {"Gemma3ForConditionalGeneration": (gemma3.text_config, gemma3.text_tensor)}


def language_model(raw: dict, source: str = "config.json") -> tuple[dict, Callable[[str], str | None] | None]:
    """(the config.json of the text model to build, the renaming of the checkpoint's tensors to its
    names, or None): a multimodal checkpoint (LANGUAGE_MODELS) gives its language model's, any
    other config is itself. A malformed one is a ConfigError naming `source`."""
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch not in LANGUAGE_MODELS:
        return raw, None
    config, rename = LANGUAGE_MODELS[arch]
    try:
        return config(raw), rename
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def checkpoint_rows(cfg: DecoderConfig) -> dict:
    """Graph weight -> (checkpoint tensor, row indices) for the weights `cfg`'s architecture reads as
    rows of another tensor; {} for most."""
    rows = CHECKPOINT_ROWS.get(cfg.architecture)
    return rows(cfg) if rows else {}


def checkpoint_views(cfg: DecoderConfig, names: set[str]) -> dict:
    """Graph weight -> loading.tensor_views.View for the weights `cfg`'s architecture computes from
    the checkpoint's tensors `names`; {} for most."""
    views = CHECKPOINT_VIEWS.get(cfg.architecture)
    return views(cfg, names) if views else {}


def build_graph(cfg: DecoderConfig, context: int | None = None) -> Graph:
    """The DSL graph of one decode/prefill step of `cfg`'s architecture, for an engine of `context`
    positions where the architecture depends on it (TAKES_CONTEXT; None: the model's short
    default); a setting the builder refuses is a ConfigError naming the config's file."""
    where = f"{cfg.source}: " if cfg.source else ""
    if cfg.architecture not in ARCHITECTURES:
        raise ConfigError(f"{where}unsupported architecture '{cfg.architecture}'; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}")
    try:
        if cfg.architecture in TAKES_CONTEXT:
            return ARCHITECTURES[cfg.architecture](cfg, context)
        return ARCHITECTURES[cfg.architecture](cfg)
    except ConfigError as e:   # the builders' refusals (activation, layer_types, experts) name no file
        raise ConfigError(where + str(e)) from None


__all__ = ["ARCHITECTURES", "ConfigError", "DecoderConfig", "build_graph", "checkpoint_rows", "checkpoint_views",
           "language_model", "rope_inv_freq"]

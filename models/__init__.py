"""Architectures, keyed by the `architectures` entry of a Hugging Face config.json."""
from __future__ import annotations

from ..dsl import Graph
from . import llama
from .config import ConfigError, DecoderConfig, rope_inv_freq

ARCHITECTURES = {
    "LlamaForCausalLM": llama.build,
    "MistralForCausalLM": llama.build,
}


def build_graph(cfg: DecoderConfig) -> Graph:
    """The DSL graph of one decode/prefill step of `cfg`'s architecture."""
    try:
        builder = ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ConfigError(f"unsupported architecture '{cfg.architecture}'; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}") from None
    return builder(cfg)


__all__ = ["ARCHITECTURES", "ConfigError", "DecoderConfig", "build_graph", "rope_inv_freq"]

"""A Hugging Face style config.json dict built from a GGUF file's llama.cpp metadata."""
from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np

from ..errors import FuselmError
from .gguf_store import metadata

# llama.cpp's `general.architecture` -> the Hugging Face class fuselm builds. A `llama` GGUF of a
# Mistral model (llama.cpp converts Mistral as llama) stays LlamaForCausalLM: the same graph. One
# with experts (`llama.expert_count`, or a router tensor `ffn_gate_inp`) is Mixtral's.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "smollm3": "SmolLM3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gpt-oss": "GptOssForCausalLM"}


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> dict:
    """The config.json keys DecoderConfig.from_hf reads, from `<arch>.*` metadata."""
    arch = metadata(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise FuselmError(f"{path}: GGUF architecture {arch!r} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")

    def key(name, default=None):
        value = metadata(reader, f"{arch}.{name}", default)
        if value is None:
            raise FuselmError(f"{path}: GGUF metadata has no '{arch}.{name}'")
        return value

    names = {t.name for t in reader.tensors}
    tokens = metadata(reader, "tokenizer.ggml.tokens") or []
    heads = key("attention.head_count")
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": key("vocab_size", len(tokens) or None),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 4096),
        # llama.cpp writes `output.weight` only when the LM head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in names,
        # Llama/Qwen3: a bias on Q, K, V and O; Qwen2's Q/K/V-only bias is built in (models/__init__)
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
    }
    # head_dim: key_length when written (Qwen3, Gemma 2, any head_dim != hidden/heads); llama's
    # (and SmolLM3's) rope.dimension_count is the full head dim (no partial rotary in this family)
    head_dim = metadata(reader, f"{arch}.attention.key_length")
    if head_dim is None and arch in ("llama", "smollm3"):
        head_dim = metadata(reader, f"{arch}.rope.dimension_count")
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma_keys(cfg, key, metadata(reader, f"{arch}.attention.sliding_window"), arch))
    if arch == "smollm3":   # llama.cpp writes no NoPE keys: it fixes every 4th layer as NoPE
        cfg["no_rope_layer_interval"] = 4
    if arch == "llama" and (metadata(reader, "llama.expert_count") or "blk.0.ffn_gate_inp.weight" in names):
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"))
    if arch == "qwen3moe":   # llama.cpp always renormalises the top-k weights of this arch
        cfg.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                   moe_intermediate_size=key("expert_feed_forward_length"), norm_topk_prob=True)
    if arch == "phi3":
        cfg.update(_phi3_keys(reader, cfg, key))
    if arch == "gpt-oss":
        cfg.update(_gpt_oss_keys(cfg, key))
    if "rope_freqs.weight" in names:  # llama.cpp keeps Llama 3.1 RoPE scaling as a tensor, not metadata
        warnings.warn(f"{path}: the rope_freqs tensor (Llama 3.1 RoPE scaling) is ignored; "
                      "long-context outputs will differ", stacklevel=2)
    if metadata(reader, f"{arch}.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):
        value = metadata(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            cfg[hf_key] = value
    return cfg


# llama.cpp's fixed choices where a Gemma GGUF has no key: the layer count of the model whose
# queries scale by (hidden/heads)^-0.5 rather than head_dim^-0.5 (the 27Bs), and Gemma 3's layout
# (every 6th layer full, the sliding ones with RoPE base 10000)
_GEMMA_WIDE_QUERY_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_FIXED = {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}


def _gemma_keys(cfg: dict, key, window, arch: str) -> dict:
    """Gemma 2/3's soft-caps, window and query scale (and Gemma 3's layer layout). llama.cpp's
    converter writes the soft-caps (Gemma 2) and the window; it does not write
    query_pre_attn_scalar: llama.cpp scales queries by head_dim^-0.5, except for the 27Bs
    (_GEMMA_WIDE_QUERY_LAYERS), where it uses (hidden/heads)^-0.5, as their configs do."""
    sizes = [cfg.get(k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        return {}   # DecoderConfig.from_hf names the bad key
    hidden, heads, layers = sizes
    hd = cfg.get("head_dim") or hidden // heads
    scalar = hidden // heads if layers == _GEMMA_WIDE_QUERY_LAYERS[arch] else hd
    out = {"attn_logit_softcapping": key("attn_logit_softcapping", 0.0) or None,
           "final_logit_softcapping": key("final_logit_softcapping", 0.0) or None,
           "query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh",
           "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6)}
    if arch == "gemma3":
        out.update(_GEMMA3_FIXED)
    if window:
        out["sliding_window"] = window
    return out


def _phi3_keys(reader: gguf.GGUFReader, cfg: dict, key) -> dict:
    """Phi-3's partial rotary (rope.dimension_count of a head), its window (0: none) and LongRoPE:
    the converter writes the factors as tensors `rope_factors_long` / `rope_factors_short`, the
    pretraining context as rope.scaling.original_context_length and the attention factor."""
    out = {"sliding_window": key("attention.sliding_window", 0) or None}
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    dims = metadata(reader, "phi3.rope.dimension_count")
    if dims is not None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        out["partial_rotary_factor"] = dims / (hidden // heads)
    factors = {t.name: t for t in reader.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if factors:
        out["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
        out["rope_scaling"] = {"type": "longrope", **{f"{kind}_factor": np.asarray(t.data, np.float64).tolist()
                                                       for kind in ("long", "short")
                                                       if (t := factors.get(f"rope_factors_{kind}.weight"))}}
        attn = metadata(reader, "phi3.rope.scaling.attn_factor")
        if attn is not None:
            out["rope_scaling"]["attention_factor"] = attn
    return out


def generation_from_gguf(cfg: dict) -> dict:
    """What a generation_config.json would say, as far as GGUF metadata tells (special token ids)."""
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}


def _gpt_oss_keys(cfg: dict, key) -> dict:
    """gpt-oss's keys: experts and their width, the sliding window, YaRN. What llama.cpp fixes
    for this arch instead of writing it: sliding windows on the even layers, YaRN's betas 32 and
    1, the SwiGLU clamp at 7 (the released models' values; their truncate false)."""
    return dict(num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                intermediate_size=key("expert_feed_forward_length"), sliding_window=key("attention.sliding_window"),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(cfg["num_hidden_layers"])],
                swiglu_limit=7.0, attention_bias=True,
                rope_scaling={"rope_type": "yarn", "factor": key("rope.scaling.factor"),
                              "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})

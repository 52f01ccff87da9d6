"""A Hugging Face style config.json dict built from a GGUF file's llama.cpp metadata."""
from __future__ import annotations

import warnings
from pathlib import Path

import gguf

from ..errors import FuselmError
from .gguf_store import metadata

ARCHITECTURES = {"llama": "LlamaForCausalLM"}


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> dict:
    """The config.json keys DecoderConfig.from_hf reads, from `<arch>.*` metadata."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise FuselmError(f"{path}: GGUF architecture '{arch}' is not supported "
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
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    head_dim = metadata(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        cfg["head_dim"] = head_dim
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


def generation_from_gguf(cfg: dict) -> dict:
    """What a generation_config.json would say, as far as GGUF metadata tells (special token ids)."""
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}

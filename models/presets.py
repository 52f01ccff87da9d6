"""Real model shapes by name, for benchmarks and GPU tests with random weights."""
from __future__ import annotations

from .config import DecoderConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True,
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False,
                         max_position_embeddings=131072),
    "mistral-7b": dict(architectures=["MistralForCausalLM"], vocab_size=32768, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
                       tie_word_embeddings=False, max_position_embeddings=32768, sliding_window=None),
}


def preset(name: str) -> DecoderConfig:
    """The DecoderConfig of a preset; unknown names list the known ones."""
    from .config import ConfigError
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; presets: {', '.join(sorted(PRESETS))}")
    return DecoderConfig.from_hf(PRESETS[name], source=f"preset {name}")

"""Real model shapes by name, for benchmarks and GPU tests with random weights."""
from __future__ import annotations

from .config import DecoderConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# Gemma 3 4B-27B: every 6th layer full (RoPE base 1e6, linear x8), the others a 1024-token window
_GEMMA3 = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=1024,
               sliding_window_pattern=6, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
               tie_word_embeddings=True, max_position_embeddings=131072)

def _gpt_oss(layers: int, experts: int) -> dict:
    """A gpt-oss config.json: top 4 of `experts` per layer, sliding windows of 128 on even layers,
    YaRN from 4096 to 131072 positions, attention sinks and biases (models/gpt_oss.py)."""
    return dict(architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                rms_norm_eps=1e-5, rope_theta=150000.0, num_local_experts=experts, num_experts_per_tok=4,
                sliding_window=128, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False, max_position_embeddings=131072,
                rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096})


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
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=False, max_position_embeddings=32768,
                       use_sliding_window=False, sliding_window=131072, max_window_layers=28),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     attention_bias=False, tie_word_embeddings=False, max_position_embeddings=40960,
                     use_sliding_window=False, sliding_window=None, max_window_layers=36),
    "gemma-2-9b": dict(architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=3584,
                       intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                       hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                       sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       tie_word_embeddings=True, max_position_embeddings=8192),
    "gemma-3-12b": dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=3840,
                        intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=256, **_GEMMA3),
    "gemma-3-27b": dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=5376,
                        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, **{**_GEMMA3, "query_pre_attn_scalar": 168}),
    # LongRoPE's factors here are placeholders (1.0 short, 2.0 long): they change values, not shapes
    "phi-4-mini": dict(architectures=["Phi3ForCausalLM"], vocab_size=200064, hidden_size=3072,
                       intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                       num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.75,
                       rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
                       original_max_position_embeddings=4096, max_position_embeddings=131072,
                       sliding_window=None, tie_word_embeddings=True, hidden_act="silu"),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                         tie_word_embeddings=False, max_position_embeddings=32768),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                          sliding_window=None, max_window_layers=48, tie_word_embeddings=False,
                          max_position_embeddings=40960),
    # gpt-oss-20b's and 120b's config.json: 24 layers of 32 experts, 36 of 128 (MXFP4 experts fit
    # the 120b on one H200; its bf16 weights, 234 GB, do not)
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    "olmo-2-7b": dict(architectures=["Olmo2ForCausalLM"], vocab_size=100352, hidden_size=4096,
                      intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, rms_norm_eps=1e-6, rope_theta=500000.0,
                      attention_bias=False, tie_word_embeddings=False, max_position_embeddings=4096),
    "smollm3-3b": dict(architectures=["SmolLM3ForCausalLM"], vocab_size=128256, hidden_size=2048,
                       intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=5000000.0,
                       no_rope_layer_interval=4, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)],
                       use_sliding_window=False, sliding_window=None, tie_word_embeddings=True,
                       max_position_embeddings=65536),
}


def preset(name: str) -> DecoderConfig:
    """The DecoderConfig of a preset; unknown names list the known ones."""
    from .config import ConfigError
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; presets: {', '.join(sorted(PRESETS))}")
    return DecoderConfig.from_hf(PRESETS[name], source=f"preset {name}")

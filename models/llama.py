"""Llama (2, 3, 3.1, 3.2; SmolLM2), Mistral and Qwen2/2.5: pre-norm decoder, GQA, RoPE, SwiGLU MLP.

Qwen2 is Llama with a bias on Q, K and V only (`qkv_bias=True`, no o_proj bias) and sliding
attention only on layers >= max_window_layers when `use_sliding_window` is set.
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import cached_attention, layer_windows, linear, lm_head, rmsnorm, step_inputs


def build(cfg: DecoderConfig, qkv_bias: bool | None = None) -> Graph:
    """One step of a Llama/Mistral/Qwen2 decoder (qkv_bias: Qwen2's Q/K/V biases)."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    D, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
    bias, mlp_bias = cfg.attention_bias, bool(cfg.extra.get("mlp_bias"))
    qkv_bias = bias if qkv_bias is None else qkv_bias
    windows = layer_windows(cfg)
    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, D)), ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        q = linear(g, h, f"{p}.self_attn.q_proj", cfg.num_heads * hd, qkv_bias)
        k = linear(g, h, f"{p}.self_attn.k_proj", cfg.num_kv_heads * hd, qkv_bias)
        v = linear(g, h, f"{p}.self_attn.v_proj", cfg.num_kv_heads * hd, qkv_bias)
        q = g.op("rope", q, pos, inv_freq, head_dim=hd)
        k = g.op("rope", k, pos, inv_freq, head_dim=hd)
        a = cached_attention(g, cfg, i, q, k, v, pos, window=windows[i])
        x = x + linear(g, a, f"{p}.self_attn.o_proj", D, bias)
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        gate = linear(g, h, f"{p}.mlp.gate_proj", cfg.intermediate_size, mlp_bias)
        up = linear(g, h, f"{p}.mlp.up_proj", cfg.intermediate_size, mlp_bias)
        x = x + linear(g, g.op("silu", gate) * up, f"{p}.mlp.down_proj", D, mlp_bias)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

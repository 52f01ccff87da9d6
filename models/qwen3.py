"""Qwen3 (dense): Llama's layer plus an RMSNorm over each head of Q and K before RoPE.

`head_dim` is explicit (128 while hidden/heads may differ); `attention_bias` (default off) puts a
bias on Q, K, V and O; `use_sliding_window` / `max_window_layers` / `layer_types` as in Qwen2.
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import cached_attention, layer_windows, linear, lm_head, rmsnorm, step_inputs


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Qwen3 decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    D, hd, eps, bias = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps, cfg.attention_bias
    windows = layer_windows(cfg)
    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, D)), ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        q = linear(g, h, f"{p}.self_attn.q_proj", cfg.num_heads * hd, bias)
        k = linear(g, h, f"{p}.self_attn.k_proj", cfg.num_kv_heads * hd, bias)
        v = linear(g, h, f"{p}.self_attn.v_proj", cfg.num_kv_heads * hd, bias)
        q = rmsnorm(g, q, f"{p}.self_attn.q_norm.weight", eps, group=hd)     # per head
        k = rmsnorm(g, k, f"{p}.self_attn.k_norm.weight", eps, group=hd)
        q = g.op("rope", q, pos, inv_freq, head_dim=hd)
        k = g.op("rope", k, pos, inv_freq, head_dim=hd)
        a = cached_attention(g, cfg, i, q, k, v, pos, window=windows[i])
        x = x + linear(g, a, f"{p}.self_attn.o_proj", D, bias)
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        gate = linear(g, h, f"{p}.mlp.gate_proj", cfg.intermediate_size)
        up = linear(g, h, f"{p}.mlp.up_proj", cfg.intermediate_size)
        x = x + linear(g, g.op("silu", gate) * up, f"{p}.mlp.down_proj", D)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

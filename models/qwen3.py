"""Qwen3 (dense): Llama's layer plus an RMSNorm over each head of Q and K before RoPE.

`head_dim` is explicit (128 while hidden/heads may differ); `attention_bias` (default off) puts a
bias on Q, K, V and O; `use_sliding_window` / `max_window_layers` / `layer_types` as in Qwen2.
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import glu_mlp, layer_windows, lm_head, rmsnorm, self_attention, step_inputs


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Qwen3 decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, bias, windows = cfg.rms_norm_eps, cfg.attention_bias, layer_windows(cfg)
    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)), ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, bias, bias, qk_norm_eps=eps, window=windows[i])
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        x = x + glu_mlp(g, cfg, i, h)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

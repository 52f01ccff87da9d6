"""Llama (2, 3, 3.1, 3.2; SmolLM2), Mistral and Qwen2/2.5: pre-norm decoder, GQA, RoPE, SwiGLU MLP.

Qwen2 is Llama with a bias on Q, K and V only (`qkv_bias=True`, no o_proj bias) and sliding
attention only on layers >= max_window_layers when `use_sliding_window` is set.
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import glu_mlp, layer_windows, lm_head, rmsnorm, self_attention, step_inputs


def build(cfg: DecoderConfig, qkv_bias: bool | None = None) -> Graph:
    """One step of a Llama/Mistral/Qwen2 decoder (qkv_bias: Qwen2's Q/K/V biases)."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, bias, mlp_bias = cfg.rms_norm_eps, cfg.attention_bias, bool(cfg.extra.get("mlp_bias"))
    qkv_bias = bias if qkv_bias is None else qkv_bias
    windows = layer_windows(cfg)
    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)), ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, qkv_bias, bias, window=windows[i])
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        x = x + glu_mlp(g, cfg, i, h, bias=mlp_bias)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

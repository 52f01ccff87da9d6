"""Gemma 2: scaled embedding, (1 + w) RMSNorms around both blocks, GELU-tanh GLU, soft-capping.

Each layer: x += post_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x))).
Attention scores are scaled by query_pre_attn_scalar^-0.5 and soft-capped (attn_logit_softcapping);
sliding-window layers alternate (layer_types, else layers 0, 2, 4, ...); logits are soft-capped
(final_logit_softcapping); the LM head is the embedding (tied).
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import (activation, cached_attention, embed_scale, layer_windows, linear, lm_head,
                     rmsnorm, step_inputs)


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Gemma 2 decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    D, hd, eps, bias, ex = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps, cfg.attention_bias, cfg.extra
    act = activation(ex.get("hidden_activation") or ex.get("hidden_act") or "gelu_pytorch_tanh")
    scale = float(ex.get("query_pre_attn_scalar") or hd) ** -0.5
    windows = layer_windows(cfg, slides=lambda i: i % 2 == 0)

    def norm(x, name):
        return rmsnorm(g, x, name, eps, offset=1.0)

    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, D)), ids)
    x = g.op("scale", x, factor=embed_scale(cfg))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = norm(x, f"{p}.input_layernorm.weight")
        q = linear(g, h, f"{p}.self_attn.q_proj", cfg.num_heads * hd, bias)
        k = linear(g, h, f"{p}.self_attn.k_proj", cfg.num_kv_heads * hd, bias)
        v = linear(g, h, f"{p}.self_attn.v_proj", cfg.num_kv_heads * hd, bias)
        q = g.op("rope", q, pos, inv_freq, head_dim=hd)
        k = g.op("rope", k, pos, inv_freq, head_dim=hd)
        a = cached_attention(g, cfg, i, q, k, v, pos, window=windows[i], scale=scale,
                             softcap=float(ex.get("attn_logit_softcapping") or 0.0))
        x = x + norm(linear(g, a, f"{p}.self_attn.o_proj", D, bias), f"{p}.post_attention_layernorm.weight")
        h = norm(x, f"{p}.pre_feedforward_layernorm.weight")
        gate = linear(g, h, f"{p}.mlp.gate_proj", cfg.intermediate_size)
        up = linear(g, h, f"{p}.mlp.up_proj", cfg.intermediate_size)
        y = linear(g, g.op(act, gate) * up, f"{p}.mlp.down_proj", D)
        x = x + norm(y, f"{p}.post_feedforward_layernorm.weight")
    logits = lm_head(g, cfg, norm(x, "model.norm.weight"), tied=ex.get("tie_word_embeddings", True))
    if ex.get("final_logit_softcapping"):
        logits = g.op("softcap", logits, cap=float(ex["final_logit_softcapping"]))
    g.output(logits=logits)
    return g

"""Gemma 2: scaled embedding, (1 + w) RMSNorms around both blocks, GELU-tanh GLU, soft-capping.

Each layer: x += post_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x))).
Attention scores are scaled by query_pre_attn_scalar^-0.5 and soft-capped (attn_logit_softcapping);
sliding-window layers alternate (layer_types, else layers 0, 2, 4, ...); logits are soft-capped
(final_logit_softcapping); the LM head is the embedding (tied).
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import (activation, embed_scale, glu_mlp, layer_windows, lm_head, rmsnorm, self_attention,
                     step_inputs)


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Gemma 2 decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, bias, ex = cfg.rms_norm_eps, cfg.attention_bias, cfg.extra
    act = activation(ex.get("hidden_activation") or ex.get("hidden_act") or "gelu_pytorch_tanh")
    scale = float(ex.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
    windows = layer_windows(cfg, slides=lambda i: i % 2 == 0)

    def norm(x, name):
        return rmsnorm(g, x, name, eps, offset=1.0)

    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)), ids)
    x = g.op("scale", x, factor=embed_scale(cfg))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = norm(x, f"{p}.input_layernorm.weight")
        a = self_attention(g, cfg, i, h, pos, inv_freq, bias, bias, window=windows[i], scale=scale,
                           softcap=float(ex.get("attn_logit_softcapping") or 0.0))
        x = x + norm(a, f"{p}.post_attention_layernorm.weight")
        h = norm(x, f"{p}.pre_feedforward_layernorm.weight")
        x = x + norm(glu_mlp(g, cfg, i, h, act), f"{p}.post_feedforward_layernorm.weight")
    logits = lm_head(g, cfg, norm(x, "model.norm.weight"), tied=ex.get("tie_word_embeddings", True))
    if ex.get("final_logit_softcapping"):
        logits = g.op("softcap", logits, cap=float(ex["final_logit_softcapping"]))
    g.output(logits=logits)
    return g

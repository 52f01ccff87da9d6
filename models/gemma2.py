"""Gemma 2: scaled embedding, (1 + w) RMSNorms around both blocks, GELU-tanh GLU, soft-capping.

Each layer: x += post_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x)))
(layers.gemma_decoder). Attention scores are scaled by query_pre_attn_scalar^-0.5 and soft-capped
(attn_logit_softcapping); sliding-window layers alternate (layer_types, else layers 0, 2, 4, ...);
logits are soft-capped (final_logit_softcapping); the LM head is the embedding (tied).
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import gemma_decoder, layer_windows, self_attention, step_inputs


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Gemma 2 decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    bias, ex = cfg.attention_bias, cfg.extra
    scale = float(ex.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
    windows = layer_windows(cfg, slides=lambda i: i % 2 == 0)
    softcap = float(ex.get("attn_logit_softcapping") or 0.0)

    def attend(i, h):
        return self_attention(g, cfg, i, h, pos, inv_freq, bias, bias, window=windows[i], scale=scale,
                              softcap=softcap)

    g.output(logits=gemma_decoder(g, cfg, ids, attend))
    return g

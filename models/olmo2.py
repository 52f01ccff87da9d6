"""OLMo 2: a post-norm decoder, with Q and K RMS-normed over the whole projection before RoPE.

Each layer: x += post_attention_norm(attn(x)); x += post_feedforward_norm(mlp(x)): no norm before
either block. The Q norm spans all heads of Q at once ([H * head_dim] weights), the K norm all of
K ([KV * head_dim]), unlike Qwen3's per-head norms. `attention_bias` puts a bias on Q, K, V and O;
the MLP is SwiGLU without biases; the LM head is untied unless `tie_word_embeddings`.
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import embed, glu_mlp, lm_head, rmsnorm, self_attention, step_inputs


def build(cfg: DecoderConfig) -> Graph:
    """One step of an OLMo 2 decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, bias = cfg.rms_norm_eps, cfg.attention_bias
    x = embed(g, cfg, ids)                                                     # [T, D]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        a = self_attention(g, cfg, i, x, pos, inv_freq, bias, bias, qk_norm_eps=eps, qk_norm_per_head=False)
        x = x + rmsnorm(g, a, f"{p}.post_attention_layernorm.weight", eps)
        x = x + rmsnorm(g, glu_mlp(g, cfg, i, x), f"{p}.post_feedforward_layernorm.weight", eps)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

"""Mixtral: Mistral's attention with a sparse mixture-of-experts SwiGLU FFN (top-2 of 8 per token).

The router is an ordinary linear; `moe_ffn` takes its logits and the experts' weights stacked over
experts. A weight name with "*" is the stack of the checkpoint tensors with "*" = 0 .. E-1
(`block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down, as the Hub files name them).
"""
from ..dsl import Graph
from .config import DecoderConfig
from .layers import embed, layer_windows, lm_head, rmsnorm, self_attention, sparse_moe, step_inputs


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Mixtral decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, windows = cfg.rms_norm_eps, layer_windows(cfg)
    E, top_k = int(cfg.extra.get("num_local_experts", 8)), int(cfg.extra.get("num_experts_per_tok", 2))
    x = embed(g, cfg, ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, window=windows[i])
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        x = x + sparse_moe(g, cfg, h, f"{p}.block_sparse_moe", E, top_k, cfg.intermediate_size, ("w1", "w3", "w2"))
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

"""Mixtral: Mistral's attention with a sparse mixture-of-experts SwiGLU FFN (top-2 of 8 per token).

The router is an ordinary linear; `moe_ffn` takes its logits and the experts' weights stacked over
experts. A weight name with "*" is the stack of the checkpoint tensors with "*" = 0 .. E-1
(`block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down, as the Hub files name them).
"""
from ..dsl import Graph
from .config import ConfigError, DecoderConfig
from .layers import activation, layer_windows, linear, lm_head, rmsnorm, self_attention, step_inputs


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Mixtral decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    D, eps, I = cfg.hidden_size, cfg.rms_norm_eps, cfg.intermediate_size
    E, top_k = int(cfg.extra.get("num_local_experts", 8)), int(cfg.extra.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= E:
        raise ConfigError(f"num_experts_per_tok {top_k} with {E} experts")
    act, windows = activation(cfg.extra.get("hidden_act") or "silu"), layer_windows(cfg)
    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, D)), ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, window=windows[i])
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        moe = f"{p}.block_sparse_moe"
        logits = linear(g, h, f"{moe}.gate", E)
        w1, w3, w2 = (g.weight(f"{moe}.experts.*.{w}.weight", s) for w, s in
                      [("w1", (E, I, D)), ("w3", (E, I, D)), ("w2", (E, D, I))])
        x = x + g.op("moe_ffn", h, logits, w1, w3, w2, top_k=top_k, act=act)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, per-head Q/K norms included, with a
routed SwiGLU FFN of `num_experts` experts, `num_experts_per_tok` per token, no shared expert.

Layer i routes when it is not in `mlp_only_layers` and (i + 1) is a multiple of
`decoder_sparse_step`; the other layers keep a dense MLP of `intermediate_size`. Experts are
`moe_intermediate_size` wide, `mlp.experts.{e}.gate_proj / up_proj / down_proj` on the Hub, stacked
at load (models/mixtral.py). The router's top-k probabilities are renormalised to sum 1 only with
`norm_topk_prob` (true on the released models; transformers' default is false).
"""
from ..dsl import Graph
from .config import ConfigError, DecoderConfig
from .layers import embed, glu_mlp, layer_windows, lm_head, rmsnorm, self_attention, sparse_moe, step_inputs


def experts(cfg: DecoderConfig) -> int:
    """The expert count: config.json's `num_experts` (transformers 5 writes `num_local_experts`)."""
    return int(cfg.extra.get("num_experts") or cfg.extra.get("num_local_experts") or 0)


def routed_layers(cfg: DecoderConfig) -> list[bool]:
    """Whether each layer's FFN is the routed experts (else the dense MLP), as transformers decides."""
    step, dense = int(cfg.extra.get("decoder_sparse_step") or 1), cfg.extra.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(type(i) is int for i in dense):
        raise ConfigError(f"mlp_only_layers = {dense!r} is not a list of layer indices")
    return [experts(cfg) > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers)]


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Qwen3-MoE decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, bias, windows, routed = cfg.rms_norm_eps, cfg.attention_bias, layer_windows(cfg), routed_layers(cfg)
    top_k, ex = int(cfg.extra.get("num_experts_per_tok") or 8), cfg.extra
    inter, norm = int(ex.get("moe_intermediate_size") or cfg.intermediate_size), bool(ex.get("norm_topk_prob"))
    x = embed(g, cfg, ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, bias, bias, qk_norm_eps=eps, window=windows[i])
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        if routed[i]:
            x = x + sparse_moe(g, cfg, h, f"{p}.mlp", experts(cfg), top_k, inter, norm_topk=norm)
        else:
            x = x + glu_mlp(g, cfg, i, h)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

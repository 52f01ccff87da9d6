"""Gemma 3 (text): Gemma 2's decoder with per-head (1 + w) Q/K norms and two RoPE tables.

Sliding and full layers come from `layer_types`, else from `sliding_window_pattern` (default 6:
every 6th layer is full). Full layers rotate with `rope_theta` and the config's RoPE scaling
(linear x8 on the 4B-27B), sliding ones with `rope_local_base_freq` unscaled (transformers 5
nests both under `rope_parameters`, by layer type). Scores are scaled by
query_pre_attn_scalar^-0.5 and not soft-capped (transformers ignores attn_logit_softcapping here);
final_logit_softcapping applies where set. The LM head is the embedding unless untied.
"""
from ..dsl import Graph
from .config import DecoderConfig, rope_inv_freq_of
from .layers import gemma_decoder, layer_windows, self_attention, step_inputs


def local_rope(cfg: DecoderConfig) -> dict:
    """The RoPE parameters of the sliding layers, from either form of the config."""
    nested = cfg.extra.get("rope_parameters")
    if isinstance(nested, dict) and nested.get("sliding_attention") is not None:
        return nested["sliding_attention"]
    return {"rope_theta": cfg.extra.get("rope_local_base_freq") or 10000.0}


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Gemma 3 text decoder."""
    g = Graph(cfg.architecture)
    ids, pos, full_freq = step_inputs(g, cfg)                 # the full layers' RoPE (scaled)
    local_freq = g.constant("rope.local_inv_freq", rope_inv_freq_of(cfg, local_rope(cfg)))
    bias, eps, ex = cfg.attention_bias, cfg.rms_norm_eps, cfg.extra
    scale = float(ex.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
    every = int(ex.get("sliding_window_pattern") or ex.get("_sliding_window_pattern") or 6)
    windows = layer_windows(cfg, slides=lambda i: (i + 1) % every != 0)

    def attend(i, h):
        return self_attention(g, cfg, i, h, pos, local_freq if windows[i] else full_freq, bias, bias,
                              qk_norm_eps=eps, qk_norm_offset=1.0, window=windows[i], scale=scale)

    g.output(logits=gemma_decoder(g, cfg, ids, attend))
    return g

"""gpt-oss (20b, 120b): attention with biases, a learned sink logit per head and alternating
sliding windows (`layer_types`), YaRN RoPE, and routed experts with biases and a clamped SwiGLU.

The router is a linear with a bias; the top `num_experts_per_tok` logits are softmaxed (moe_ffn's
renormalised top-k). Each expert computes g sigmoid(`swiglu_alpha` g) (u + 1) with
g = min(gate, `swiglu_limit`) and u = up clipped to +-limit. YaRN's attention factor f scales
the rotated Q and K, so scores by f^2: the attention scale carries it. The checkpoint stacks the
experts: `mlp.experts.gate_up_proj` [E, D, 2I] with gate and up interleaved (columns 0, 2, ... and
1, 3, ...), `down_proj` [E, I, D], both transposed against ours, plus their biases; the released
checkpoints hold both matrices in MXFP4 (`_blocks`, `_scales`), read here as floats for the CPU
and kept in MXFP4 for the GPU.
"""
from __future__ import annotations

import numpy as np

from ..dsl import Graph
from .config import DecoderConfig, rope_attention_factor
from .layers import embed, layer_windows, linear, lm_head, rmsnorm, self_attention, step_inputs

EXPERTS = "mlp.experts"


def experts(cfg: DecoderConfig) -> tuple[int, int]:
    """(expert count, experts per token)."""
    return int(cfg.extra.get("num_local_experts") or 32), int(cfg.extra.get("num_experts_per_tok") or 4)


def build(cfg: DecoderConfig) -> Graph:
    """One step of a gpt-oss decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, windows, (E, top_k) = cfg.rms_norm_eps, layer_windows(cfg), experts(cfg)
    D, inter, ex = cfg.hidden_size, cfg.intermediate_size, cfg.extra
    scale = cfg.head_dim ** -0.5 * rope_attention_factor(cfg) ** 2
    clamp = {"swiglu_limit": float(ex.get("swiglu_limit", 7.0)), "swiglu_alpha": float(ex.get("swiglu_alpha", 1.702))}
    x = embed(g, cfg, ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, True, True, window=windows[i], sinks=True, scale=scale)
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        logits = linear(g, h, f"{p}.mlp.router", E, bias=True)
        w = lambda name, shape: g.weight(f"{p}.{EXPERTS}.{name}", shape)   # noqa: E731
        x = x + g.op("moe_ffn", h, logits, w("gate_proj.weight", (E, inter, D)), w("up_proj.weight", (E, inter, D)),
                     w("down_proj.weight", (E, D, inter)), w("gate_proj.bias", (E, inter)),
                     w("up_proj.bias", (E, inter)), w("down_proj.bias", (E, D)), top_k=top_k, **clamp)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g


# MXFP4's 16 code values (e2m1); a block of 32 shares a power-of-two scale (e8m0, bias 127)
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4_to_float(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's MXFP4 matrix as float32 [..., rows, K]: `blocks` [..., rows, K/32, 16] bytes
    (element 2j in byte j's low nibble, 2j + 1 in its high one), `scales` [..., rows, K/32]."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = FP4_VALUES[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return values.reshape(*scales.shape[:-1], -1)


def checkpoint_views(cfg: DecoderConfig, names: set[str]) -> dict:
    """Graph weight -> loading.tensor_views.View for each expert tensor, read from the checkpoint's
    stacks (floats or MXFP4, whichever `names` holds). Gate and up are the even and odd rows of
    gate_up (its columns where stored as floats, transposed), their biases alike."""
    from ..loading.tensor_views import View
    views = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.{EXPERTS}"
        gu, down = f"{p}.gate_up_proj", f"{p}.down_proj"
        for j, name in enumerate(("gate_proj", "up_proj")):
            views[f"{p}.{name}.bias"] = View((f"{gu}_bias",), lambda s: (s[0], s[1] // 2), lambda b, j=j: b[:, j::2])
        views[f"{p}.down_proj.bias"] = View((f"{down}_bias",), lambda s: s, lambda b: b)
        if f"{gu}_blocks" in names:       # MXFP4 [E, rows, K/32, 16] and scales [E, rows, K/32]
            views.update({f"{p}.gate_proj.weight": _mxfp4_view(gu, slice(0, None, 2)),
                          f"{p}.up_proj.weight": _mxfp4_view(gu, slice(1, None, 2)),
                          f"{p}.down_proj.weight": _mxfp4_view(down, slice(None))})
        else:                             # floats, transposed: [E, D, 2I] and [E, I, D]
            for j, name in enumerate(("gate_proj", "up_proj")):
                views[f"{p}.{name}.weight"] = View((gu,), lambda s: (s[0], s[2] // 2, s[1]),
                                                   lambda w, j=j: w[:, :, j::2].transpose(0, 2, 1))
            views[f"{p}.down_proj.weight"] = View((down,), lambda s: (s[0], s[2], s[1]), lambda w: w.transpose(0, 2, 1))
    return views


def _mxfp4_view(stack: str, rows: slice):
    """The View of rows `rows` of MXFP4 stack `stack` (its `_blocks` and `_scales`): floats, or
    kept in MXFP4 for the GPU (the Hub's nibble order is ours: quant/layout.from_mxfp4)."""
    from ..loading.tensor_views import View
    from ..quant.layout import from_mxfp4
    return View((f"{stack}_blocks", f"{stack}_scales"), lambda s, _: (s[0], len(range(s[1])[rows]), s[2] * 32),
                lambda b, sc: mxfp4_to_float(b[:, rows], sc[:, rows]), codes=True,
                keep=lambda b, sc: from_mxfp4(b[:, rows], sc[:, rows]), format="mxfp4")

"""Quantization schemes: which format each weight of a model takes, by name, as llama.cpp's file
types choose them (for presets with random weights, and for `--quant` on a bf16 checkpoint)."""
from __future__ import annotations

import re

from .formats import FORMATS

# llama.cpp's Q4_K_M (Q5_K_M): Q4_K (Q5_K) everywhere, Q6_K for the LM head, and for V and the
# MLP's down projection (the experts' w2 in a MoE) in the layers it gives more bits (the first and
# last eighth, every third between).
# mxfp4 is gpt-oss's release: its expert stacks in MXFP4, everything else bf16 (a model without
# experts: every weight in MXFP4).
SCHEMES = ("q4_k_m", "q5_k_m", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "fp8", "mxfp4")


def _more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def scheme_formats(scheme: str, weights: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """The format of each of `weights` (quantizable weight name -> shape) under `scheme`; a weight
    whose rows do not hold whole blocks of its format stays bf16 (left out)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme '{scheme}' (known: {', '.join(SCHEMES)})")
    layers = 1 + max((int(m[1]) for n in weights if (m := re.match(r"model\.layers\.(\d+)\.", n))), default=0)
    out = {}
    experts_only = scheme == "mxfp4" and any(len(shape) == 3 for shape in weights.values())
    for name, shape in weights.items():
        if experts_only and len(shape) != 3:
            continue
        fmt = scheme
        if scheme in ("q4_k_m", "q5_k_m"):
            m = re.match(r"model\.layers\.(\d+)\.", name)
            wants_more = name.startswith("lm_head") or (
                m and re.search(r"(v_proj|down_proj|experts\.\*\.w2)\.weight$", name) and _more_bits(int(m[1]), layers))
            fmt = "q6_k" if wants_more else scheme[:4]
        if FORMATS[fmt].fits(shape):
            out[name] = fmt
    return out


def graph_formats(graph, scheme: str) -> dict[str, str]:
    """The formats of a DSL graph's quantizable weights under `scheme`."""
    from ..compiler.assign_formats import quantizable_shapes
    return scheme_formats(scheme, quantizable_shapes(graph))

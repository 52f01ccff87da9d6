"""Quantization on load (`--quant`): float weights to GGUF blocks by the `gguf` library's own
quantizer, then to our layout (layout.from_gguf), so a quantized bf16 checkpoint runs the same
kernels as a GGUF file of that type."""
from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np

from .formats import FORMATS, QuantizedWeight
from .layout import from_fp8, from_gguf

# --quant names -> formats; these are the types gguf's quantizer implements
QUANT_OPTIONS = {"fp8": "fp8", "q8": "q8_0", "q4": "q4_1", "q5": "q5_1", "q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1",
                 "q5_0": "q5_0", "q5_1": "q5_1", "mxfp4": "mxfp4"}


def on_load_formats(option: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """The weights (of `shapes`: quantizable weight -> shape) that `--quant option` quantizes on
    load, and the format of each: every one whose rows hold whole blocks; for mxfp4, a MoE's
    expert stacks only, as gpt-oss is released (quant/schemes.py)."""
    fmt = QUANT_OPTIONS[option]
    if fmt == "mxfp4":
        from .schemes import scheme_formats
        return scheme_formats("mxfp4", shapes)
    return {name: fmt for name, shape in shapes.items() if FORMATS[fmt].fits(shape)}


def quantize(w: np.ndarray, fmt: str) -> QuantizedWeight:
    """float matrix [N, K] (K a multiple of 32; or a stack of experts' [E, N, K]) in format `fmt`
    (q8_0, q4_0, q4_1, q5_0, q5_1 or mxfp4 by gguf's quantizer; fp8: e4m3 with a scale per row,
    its largest magnitude at e4m3's 448, matrices only)."""
    if fmt == "fp8":
        w = np.asarray(w, np.float32)
        top = np.abs(w).max(axis=1)
        scale = np.where(top > 0, top / 448.0, 1.0).astype(np.float32)
        return from_fp8((w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn), scale)
    kind = gguf.GGMLQuantizationType[FORMATS[fmt].gguf_type]
    w = np.ascontiguousarray(w, np.float32)
    return from_gguf(fmt, gguf.quants.quantize(w, kind), w.shape)

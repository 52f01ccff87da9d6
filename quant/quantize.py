"""Quantization on load (`--quant`): float weights to GGUF blocks by the `gguf` library's own
quantizer, then to our layout (layout.from_gguf), so a quantized bf16 checkpoint runs the same
kernels as a GGUF file of that type."""
from __future__ import annotations

import gguf
import numpy as np

from .formats import FORMATS, QuantizedWeight
from .layout import from_gguf

# --quant names -> formats; these are the types gguf's quantizer implements
QUANT_OPTIONS = {"q8": "q8_0", "q4": "q4_1", "q5": "q5_1", "q8_0": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1",
                 "q5_0": "q5_0", "q5_1": "q5_1"}


def quantize(w: np.ndarray, fmt: str) -> QuantizedWeight:
    """float matrix [N, K] (K a multiple of 32) in format `fmt` (q8_0, q4_0, q4_1, q5_0 or q5_1)."""
    kind = gguf.GGMLQuantizationType[FORMATS[fmt].gguf_type]
    w = np.ascontiguousarray(w, np.float32)
    return from_gguf(fmt, gguf.quants.quantize(w, kind), w.shape)

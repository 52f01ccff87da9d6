"""Quantized weights kept in their bytes on the GPU: the formats (formats.py), GGUF blocks repacked
into the layout the kernels read and back (layout.py), and quantization on load (quantize.py)."""
from .formats import FORMATS, Format, QuantizedWeight, format_of

__all__ = ["FORMATS", "Format", "QuantizedWeight", "format_of"]

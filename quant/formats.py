"""The weight formats the generated kernels read, and a weight held in one of them.

A quantized [N, K] matrix lives on the GPU as one byte buffer of consecutive sections, each
row-major over the N rows (layout.py writes and reads them):

| format | sections (bytes per row)                        | a weight, in group g of 32      |
| ------ | ----------------------------------------------- | ------------------------------- |
| q8_0   | codes int8 (K), d f16 (K/16)                    | d[g] * code                     |
| q4_0   | nibbles (K/2), d f16 (K/16)                     | d[g] * (code - 8)               |
| q4_1   | nibbles (K/2), (d, m) f16 pairs (K/8)           | d[g] * code + m[g]              |
| q4_k   | nibbles (K/2), GGUF's 16-byte super-block       | d*sc[g] * code - dmin*mn[g]     |
|        | header per 256 weights (K/16)                   |   (6-bit sc, mn per group)      |
| q5_0   | nibbles (K/2), high bits (K/8), d f16 (K/16)    | d[g] * (code - 16)              |
| q5_1   | nibbles, high bits, (d, m) f16 pairs (K/8)      | d[g] * code + m[g]              |
| q5_k   | nibbles, high bits, Q4_K's headers (K/16)       | d*sc[g] * code - dmin*mn[g]     |
| q6_k   | low nibbles (K/2), high 2-bit pairs (K/4),      | d * sc[16-run] * (code - 32)    |
|        | int8 scale per 16 (K/16), d f16 per 256 (K/128) |                                 |
| fp8    | e4m3 codes (K), a float32 scale per row (4)     | scale * e4m3(code)              |
| mxfp4  | e2m1 nibbles in element order (K/2),            | 2^(e[g] - 128) * E2M1x2[code]   |
|        | e8m0 byte e per group (K/32)                    |   (doubled e2m1 values)         |

A stack of experts' matrices [E, N, K] (a mixture of experts) is E such buffers one after another,
expert e's at e * nbytes([N, K]).

Nibbles of a group of 32 take 16 bytes: byte i holds weight i (low nibble) and weight i + 16
(high nibble), GGUF's Q4_0 order, so one lane's 16-byte load is one group. MXFP4's nibbles are in
element order instead (byte i: weights 2i and 2i + 1), so that a 16-bit half of a nibble word is
the table lookup of 4 consecutive weights (templates/quant.cuh, MXFP4). A fifth or sixth bit
is laid out to line up with the nibbles' bytes (layout.pack_bits, pack_pairs). Every section keeps
GGUF's bytes (scales and codes are never rounded again): dequantizing ours equals dequantizing
the file's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    """A weight format: its name, the C++ struct of templates/quant.cuh that reads it, the GGUF
    type it keeps (None: our own), the K multiple its blocks need and its bits per weight."""
    name: str
    c_struct: str
    gguf_type: str | None
    block: int                 # K must be a multiple of it
    bytes_per_block: int       # on the GPU, all sections together
    bytes_per_row: int = 0     # besides the blocks (fp8's row scale)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a weight of `shape` ([..., N, K]) in this format."""
        return math.prod(shape[:-1]) * (shape[-1] // self.block * self.bytes_per_block + self.bytes_per_row)

    @property
    def integer_codes(self) -> bool:
        """Whether its codes are integers (every GGUF type but the floats): the GEMV then takes
        dp2a on the vector staged in int16 (templates/quant.cuh, StagedX)."""
        return self.gguf_type is not None

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes_per_block / self.block

    def misfit(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of `shape` cannot be held in this format, or None where it can: a matrix, or
        a stack of experts' matrices, needs rows of whole blocks; a stack also needs each expert's
        bytes a multiple of 16, since the kernels' 16-byte loads start at every expert."""
        if len(shape) not in (2, 3) or shape[-1] % self.block:
            return f"rows of a multiple of {self.block} weights"
        if len(shape) == 3 and self.nbytes(shape[1:]) % 16:
            return f"each expert's {self.nbytes(shape[1:])} bytes a multiple of 16"
        return None

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a weight of `shape` can be held in this format (see misfit)."""
        return self.misfit(shape) is None


BF16 = Format("bf16", "Bf16", None, 1, 2)
FORMATS = {f.name: f for f in [
    BF16,
    Format("q8_0", "Q8_0", "Q8_0", 32, 34),
    Format("q4_0", "Q4_0", "Q4_0", 32, 18),
    Format("q4_1", "Q4_1", "Q4_1", 32, 20),
    Format("q4_k", "Q4_K", "Q4_K", 256, 144),
    Format("q5_0", "Q5_0", "Q5_0", 32, 22),
    Format("q5_1", "Q5_1", "Q5_1", 32, 24),
    Format("q5_k", "Q5_K", "Q5_K", 256, 176),
    Format("q6_k", "Q6_K", "Q6_K", 256, 210),
    Format("fp8", "FP8", None, 32, 32, 4),        # Hugging Face fp8 checkpoints, --quant fp8
    Format("mxfp4", "MXFP4", "MXFP4", 32, 17),    # gpt-oss's experts (GGUF and the Hub's _blocks)
]}
GGUF_FORMATS = {f.gguf_type: f for f in FORMATS.values() if f.gguf_type}


def format_of(name: str) -> Format:
    """The format called `name` (KeyError naming the known ones otherwise)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown weight format '{name}' (known: {', '.join(FORMATS)})") from None


@dataclass
class QuantizedWeight:
    """A weight of `shape` held as `data` (uint8, the GPU layout of `format`, see layout.py)."""
    format: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

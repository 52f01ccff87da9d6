"""GGUF blocks to the GPU layout of formats.py and back: `from_gguf` repacks a tensor's blocks
once at load (numpy, or cupy on the GPU), `dequantize` reads our layout back to float32 (the CPU reference, and the
check that repacking loses nothing: it must equal the `gguf` library's own dequantization)."""
from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np

from .formats import FORMATS, QuantizedWeight

F16 = np.dtype("<f2")
_E4M3 = np.arange(256, dtype=np.uint8)
E4M3_STD = float(_E4M3[(_E4M3 & 0x7F) != 0x7F].view(ml_dtypes.float8_e4m3fn).astype(np.float64).std())


# Rows repacked at a time: bounds the temporaries of from_gguf to REPACK_TEMP_BYTES a weight of
# such a band (measured with tracemalloc: Q6_K and Q5_K 4.0 and 3.9, Q4_K 2.5, Q8_0 1.0).
REPACK_WEIGHTS = 1 << 24
REPACK_TEMP_BYTES = 4


def array_module(a):
    """numpy, or cupy for a cupy array (so that the repacking runs where its input lives)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy.get_array_module(a)


def from_gguf(fmt: str, raw, shape: tuple[int, ...], xp=np) -> QuantizedWeight:
    """Tensor `shape` = [N, K] (or a stack of experts' [E, N, K]) whose GGUF blocks of type `fmt`
    are `raw` (uint8, N rows of K / block blocks, per expert), in our layout, repacked by `xp`
    (numpy, or cupy: the blocks go to the GPU as they are and are repacked there), a band of
    rows at a time. ValueError when the bytes do not make N * K / block blocks."""
    if len(shape) == 3:
        raw = raw.reshape(shape[0], -1)
        return stack_experts((from_gguf(fmt, r, shape[1:], xp) for r in raw), shape[0])
    f = FORMATS[fmt]
    N, K = shape
    per_block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[f.gguf_type]][1]   # bytes of a GGUF block
    if K % f.block or raw.size != N * K // f.block * per_block:
        raise ValueError(f"{raw.size} bytes are not {N} x {K} weights in {fmt} blocks of {f.block}")
    blocks = xp.asarray(raw, dtype=xp.uint8).reshape(N, K // f.block, per_block)
    data = xp.empty(f.nbytes(shape), xp.uint8)
    widths = [per_row(K) for _, per_row in SECTIONS[fmt]]
    starts = np.cumsum([0] + [N * w for w in widths])
    band = max(1, REPACK_WEIGHTS // K)
    for r in range(0, N, band):
        rows = min(band, N - r)
        for at, w, s in zip(starts, widths, _REPACK[fmt](blocks[r: r + rows], rows, K)):
            data[at + r * w: at + (r + rows) * w] = s.reshape(-1)
    assert starts[-1] == data.size
    return QuantizedWeight(fmt, (N, K), data)


def _q8_0(b, N, K):
    return [b[..., 2:], b[..., :2]]                       # codes [N, K]; d [N, K/32]


def _q4_0(b, N, K):
    return [b[..., 2:], b[..., :2]]                       # GGUF's nibbles are already our order


def _q4_1(b, N, K):
    return [b[..., 4:], b[..., :4]]                       # nibbles; (d, m)


def _q4_k(b, N, K):
    qs = b[..., 16:].reshape(N, K // 256, 4, 32)          # 4 runs of 64 weights: low nibbles, then high
    codes = array_module(b).stack([qs & 0xF, qs >> 4], axis=3)   # [N, S, 4, 2, 32]: groups 2g and 2g + 1
    return [pack_nibbles(codes.reshape(N, K)), b[..., :16]]


def _q5_0(b, N, K):
    high = _bits_le(b[..., 2:6])                          # bit j of the group's 32-bit word: weight j
    return [b[..., 6:], pack_bits(high.reshape(N, K)), b[..., :2]]


def _q5_1(b, N, K):
    high = _bits_le(b[..., 4:8])
    return [b[..., 8:], pack_bits(high.reshape(N, K)), b[..., :4]]


def _q5_k(b, N, K):
    xp = array_module(b)
    qs = b[..., 48:].reshape(N, K // 256, 4, 32)          # nibbles as Q4_K's
    codes = xp.stack([qs & 0xF, qs >> 4], axis=3).reshape(N, K)
    qh = b[..., 16:48]                                    # byte l, bit s: weight l of group s
    high = (qh[..., None, :] >> xp.arange(8, dtype=xp.uint8)[:, None]) & 1
    return [pack_nibbles(codes), pack_bits(high.reshape(N, K)), b[..., :16]]


def _bits_le(words: np.ndarray) -> np.ndarray:
    """The 32 bits of little-endian 4-byte words [..., 4], bit j at index j [..., 32]."""
    xp = array_module(words)
    return ((words[..., None] >> xp.arange(8, dtype=xp.uint8)) & 1).reshape(*words.shape[:-1], 32)


def _q6_k(b, N, K):
    codes = q6_k_codes(b).reshape(N, K)
    return [pack_nibbles(codes & 0xF), pack_pairs(codes >> 4), b[..., 192:208], b[..., 208:210]]


def _mxfp4(b, N, K):
    codes = unpack_nibbles(b[..., 1:].reshape(N, -1))       # GGUF's Q4_0 order to element order
    return [codes[:, 0::2] | (codes[:, 1::2] << 4), b[..., 0]]


_REPACK = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q4_k": _q4_k, "q5_0": _q5_0, "q5_1": _q5_1,
           "q5_k": _q5_k, "q6_k": _q6_k, "mxfp4": _mxfp4}


def q6_k_codes(b: np.ndarray) -> np.ndarray:
    """The 6-bit codes [..., 256] of Q6_K blocks [..., 210] in weight order. Per half of 128: 64
    bytes of low nibbles (run l: weights l and l + 64 of the half, then l + 32 and l + 96 from
    byte l + 32) and 32 bytes of high bit pairs (byte l: weights l, l + 32, l + 64, l + 96)."""
    out = []
    for half in range(2):
        ql = b[..., 64 * half: 64 * half + 64]
        qh = b[..., 128 + 32 * half: 128 + 32 * half + 32]
        lo = [ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4]
        out += [lo[i] | (((qh >> (2 * i)) & 3) << 4) for i in range(4)]
    return array_module(b).concatenate(out, axis=-1)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [N, K] as bytes [N, K/2]: per group of 32, byte i = code i | code i+16 << 4."""
    g = codes.reshape(*codes.shape[:-1], -1, 32).astype(np.uint8)
    return (g[..., :16] | (g[..., 16:] << 4)).reshape(*codes.shape[:-1], -1)


def pack_pairs(hi: np.ndarray) -> np.ndarray:
    """2-bit values [N, K] as bytes [N, K/4]: per group of 32, two 32-bit words; byte b of word h
    holds, from bit 0, the pairs of weights 8h+b, 8h+b+16, 8h+b+4, 8h+b+20, so that the word
    lines up with nibble words 2h and 2h+1 of the group (templates/quant.cuh, Q6_K)."""
    g = hi.reshape(*hi.shape[:-1], -1, 32).astype(np.uint8)
    out = array_module(hi).zeros((*g.shape[:-1], 8), np.uint8)
    for w in range(4):
        shift = 4 * (w % 2)
        out[..., 4 * (w // 2): 4 * (w // 2) + 4] |= (g[..., 4 * w: 4 * w + 4] << shift) | \
                                                   (g[..., 16 + 4 * w: 20 + 4 * w] << (shift + 2))
    return out.reshape(*hi.shape[:-1], -1)


def pack_bits(hi: np.ndarray) -> np.ndarray:
    """1-bit values [N, K] as bytes [N, K/8]: per group of 32, one 32-bit word; byte b holds, from
    bit 0, the bits of weights b, b+16, b+4, b+20, b+8, b+24, b+12, b+28 (nibble word w's low
    and high halves at bits 2w and 2w+1, lining up with its bytes: templates/quant.cuh, Q5)."""
    g = hi.reshape(*hi.shape[:-1], -1, 32).astype(np.uint8)
    out = array_module(hi).zeros((*g.shape[:-1], 4), np.uint8)
    for w in range(4):
        out |= (g[..., 4 * w: 4 * w + 4] << (2 * w)) | (g[..., 16 + 4 * w: 20 + 4 * w] << (2 * w + 1))
    return out.reshape(*hi.shape[:-1], -1)


def unpack_bits(packed: np.ndarray) -> np.ndarray:
    g = packed.reshape(*packed.shape[:-1], -1, 4)
    out = np.zeros((*g.shape[:-1], 32), np.uint8)
    for w in range(4):
        out[..., 4 * w: 4 * w + 4] = (g >> (2 * w)) & 1
        out[..., 16 + 4 * w: 20 + 4 * w] = (g >> (2 * w + 1)) & 1
    return out.reshape(*packed.shape[:-1], -1)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    g = packed.reshape(*packed.shape[:-1], -1, 16)
    return array_module(packed).concatenate([g & 0xF, g >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def unpack_pairs(packed: np.ndarray) -> np.ndarray:
    g = packed.reshape(*packed.shape[:-1], -1, 8)
    out = np.zeros((*g.shape[:-1], 32), np.uint8)
    for w in range(4):
        word = g[..., 4 * (w // 2): 4 * (w // 2) + 4] >> (4 * (w % 2))
        out[..., 4 * w: 4 * w + 4] = word & 3
        out[..., 16 + 4 * w: 20 + 4 * w] = (word >> 2) & 3
    return out.reshape(*packed.shape[:-1], -1)


# Per format, its sections in buffer order: (name, bytes per row as a function of K).
SECTIONS = {
    "q8_0": [("codes", lambda K: K), ("d", lambda K: K // 16)],
    "q4_0": [("nibbles", lambda K: K // 2), ("d", lambda K: K // 16)],
    "q4_1": [("nibbles", lambda K: K // 2), ("dm", lambda K: K // 8)],
    "q4_k": [("nibbles", lambda K: K // 2), ("header", lambda K: K // 16)],
    "q5_0": [("nibbles", lambda K: K // 2), ("bits", lambda K: K // 8), ("d", lambda K: K // 16)],
    "q5_1": [("nibbles", lambda K: K // 2), ("bits", lambda K: K // 8), ("dm", lambda K: K // 8)],
    "q5_k": [("nibbles", lambda K: K // 2), ("bits", lambda K: K // 8), ("header", lambda K: K // 16)],
    "q6_k": [("nibbles", lambda K: K // 2), ("pairs", lambda K: K // 4), ("scales", lambda K: K // 16),
             ("d", lambda K: K // 128)],
    "fp8": [("codes", lambda K: K), ("scale", lambda K: 4)],
    "mxfp4": [("nibbles", lambda K: K // 2), ("e", lambda K: K // 32)],
}

# MXFP4's doubled e2m1 values by code (a weight = 2^(e - 128) times its code's)
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def from_fp8(codes: np.ndarray, scale: np.ndarray) -> QuantizedWeight:
    """e4m3 codes [N, K] (uint8 or float8_e4m3fn) with a float32 scale per row [N] (a per-tensor
    scale repeated), in our fp8 layout."""
    codes = np.ascontiguousarray(codes).view(np.uint8)
    N, K = codes.shape
    scale = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (N,))
    data = np.concatenate([codes.reshape(-1), np.ascontiguousarray(scale).view(np.uint8)])
    return QuantizedWeight("fp8", (N, K), data)


def from_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> QuantizedWeight:
    """A Hub checkpoint's MXFP4 matrix (`blocks` [N, K/32, 16] bytes, element 2j in byte j's low
    nibble; `scales` [N, K/32] e8m0 bytes) in our layout, whose nibbles are already in that order,
    or a stack of experts' ([E, N, K/32, 16] and [E, N, K/32])."""
    if blocks.ndim == 4:
        return stack_experts([from_mxfp4(b, s) for b, s in zip(blocks, scales)])
    N, groups = scales.shape
    if blocks.shape != (N, groups, 16):
        raise ValueError(f"MXFP4 blocks of shape {list(blocks.shape)} do not match scales {[N, groups]}")
    data = np.concatenate([np.ascontiguousarray(blocks, np.uint8).reshape(-1),
                           np.ascontiguousarray(scales, np.uint8).reshape(-1)])
    return QuantizedWeight("mxfp4", (N, 32 * groups), data)


def stack_experts(experts, count: int | None = None) -> QuantizedWeight:
    """Experts' matrices of one format and shape [N, K] as one stack [E, N, K] (formats.py), in
    one buffer (numpy or cupy, as theirs) filled expert by expert: `experts` may be a generator
    of `count` experts, whose bytes then go once copied, so the stack is held once, not twice."""
    if count is None:
        experts = list(experts)
        count = len(experts)
    data = None
    for e, w in enumerate(experts):
        if data is None:
            first, n = w, w.data.size
            data = array_module(w.data).empty(count * n, np.uint8)
        elif w.format != first.format or w.shape != first.shape:
            raise ValueError("experts of a stack must share one format and shape")
        data[e * n: (e + 1) * n] = w.data
    return QuantizedWeight(first.format, (count, *first.shape), data)


def expert(w: QuantizedWeight, e: int) -> QuantizedWeight:
    """Expert e's matrix [N, K] of a stack [E, N, K] (a view of its bytes)."""
    n = FORMATS[w.format].nbytes(w.shape[1:])
    return QuantizedWeight(w.format, w.shape[1:], w.data[e * n: (e + 1) * n])


def take_rows(w: QuantizedWeight, rows: np.ndarray) -> QuantizedWeight:
    """Rows `rows` of matrix `w` [N, K], in that order, in its format: every section of the layout
    is row-major over the N rows, so the rows of each are taken alike and no block is re-encoded."""
    xp = array_module(w.data)
    rows = xp.asarray(rows)
    data = xp.concatenate([s[rows].reshape(-1) for s in sections(w)])
    return QuantizedWeight(w.format, (len(rows), w.shape[1]), data)


def sections(w: QuantizedWeight) -> list:
    """The sections of `w`'s buffer (numpy or cupy), each [N, bytes per row]."""
    N, K = w.shape
    out, at = [], 0
    for _, per_row in SECTIONS[w.format]:
        n = per_row(K)
        out.append(w.data[at: at + N * n].reshape(N, n))
        at += N * n
    return out


def random_weight(fmt: str, shape: tuple[int, int], std: float, xp=np, seed: int | None = None) -> QuantizedWeight:
    """A weight of `shape` in format `fmt` with random codes and scales such that its weights
    have about `std` for standard deviation, centred near 0, made by `xp` (numpy, or cupy to
    make it on the GPU): benchmarks and tests of real shapes without any file. A 3-d shape is a
    stack of experts' matrices."""
    if len(shape) == 3:
        return stack_experts([random_weight(fmt, shape[1:], std, xp, None if seed is None else (seed * 1009 + e) % (1 << 32))
                              for e in range(shape[0])])
    N, K = shape
    rs = xp.random.RandomState(seed)
    data = rs.randint(0, 256, FORMATS[fmt].nbytes(shape), dtype=xp.int32).astype(xp.uint8)
    w = QuantizedWeight(fmt, (N, K), data)

    def f16(section, values):
        section.view(F16 if xp is np else xp.float16)[...] = values
    sec = dict(zip((n for n, _ in SECTIONS[fmt]), sections(w)))
    if fmt == "fp8":             # random bytes but NaN (0x7f, 0xff); their spread is E4M3_STD
        codes = sec["codes"]
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        sec["scale"].view(np.float32 if xp is np else xp.float32)[...] = std / E4M3_STD
    elif fmt == "q8_0":
        f16(sec["d"], std / 74)
    elif fmt == "q4_0":
        f16(sec["d"], std / 4.6)
    elif fmt == "q4_1":
        dm = sec["dm"].reshape(N, -1, 4)
        f16(dm[..., :2], std / 4.6)
        f16(dm[..., 2:], -7.5 * std / 4.6)
    elif fmt == "q5_0":
        f16(sec["d"], std / 9.2)
    elif fmt == "q5_1":
        dm = sec["dm"].reshape(N, -1, 4)
        f16(dm[..., :2], std / 9.2)
        f16(dm[..., 2:], -15.5 * std / 9.2)
    elif fmt in ("q4_k", "q5_k"):  # scale d * sc and min dmin * mn, sc and mn the random 6-bit values
        spread, mid = (4.6, 7.5) if fmt == "q4_k" else (9.2, 15.5)
        hdr = sec["header"].reshape(N, -1, 16)
        f16(hdr[..., 0:2], std / (spread * 32))
        f16(hdr[..., 2:4], mid * std / (spread * 32))
    elif fmt == "q6_k":            # int8 scales of about 64 in size
        f16(sec["d"], std / (18.5 * 64))
    elif fmt == "mxfp4":           # the power of two nearest std over the codes' spread (5.85, doubled)
        sec["e"][...] = 128 + int(round(np.log2(std / float(np.sqrt(np.mean(E2M1_DOUBLED ** 2))))))
    return w


def dequantize(w: QuantizedWeight) -> np.ndarray:
    """float32 [N, K] (or [E, N, K]) of a weight in our layout (the formulas of formats.py)."""
    if len(w.shape) == 3:
        return np.stack([dequantize(expert(w, e)) for e in range(w.shape[0])])
    N, K = w.shape
    s = sections(w)
    f = w.format
    if f == "fp8":
        return s[0].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * s[1].view(np.float32)
    if f == "mxfp4":
        codes = np.stack([s[0] & 15, s[0] >> 4], axis=-1).reshape(N, -1, 32)
        scale = np.ldexp(np.float32(1), s[1].astype(np.int32) - 128)
        return (E2M1_DOUBLED[codes] * scale[..., None]).reshape(N, K)
    if f == "q8_0":
        codes, d = s[0].view(np.int8).astype(np.float32), s[1].view(F16).astype(np.float32)
        return (codes.reshape(N, -1, 32) * d[..., None]).reshape(N, K)
    if f in ("q5_0", "q5_1", "q5_k"):
        codes = (unpack_nibbles(s[0]) | (unpack_bits(s[1]) << 4)).astype(np.float32).reshape(N, -1, 32)
        f, s = {"q5_0": ("q4_0", s[::2]), "q5_1": ("q4_1", s[::2]), "q5_k": ("q4_k", s[::2])}[f]
        zero = 16
    else:
        codes = unpack_nibbles(s[0]).astype(np.float32).reshape(N, -1, 32)
        zero = 8
    if f == "q4_0":
        return ((codes - zero) * s[1].view(F16).astype(np.float32)[..., None]).reshape(N, K)
    if f == "q4_1":
        dm = s[1].view(F16).astype(np.float32).reshape(N, -1, 2)
        return (codes * dm[..., :1] + dm[..., 1:]).reshape(N, K)
    if f == "q4_k":
        hdr = s[1].reshape(N, -1, 16)
        d, dmin = (hdr[..., :4].copy().view(F16).astype(np.float32)[..., i: i + 1] for i in (0, 1))
        sc, mn = q4_k_scales(hdr[..., 4:])
        codes = codes.reshape(N, -1, 8, 32)
        return ((d * sc)[..., None] * codes - (dmin * mn)[..., None]).reshape(N, K)
    if f == "q6_k":
        full = unpack_nibbles(s[0]) | (unpack_pairs(s[1]) << 4)
        sc = s[2].view(np.int8).astype(np.float32)                   # [N, K/16]
        d = s[3].view(F16).astype(np.float32)                        # [N, K/256]
        scale = np.repeat(d, 16, axis=1) * sc
        return ((full.astype(np.float32) - 32).reshape(N, -1, 16) * scale[..., None]).reshape(N, K)
    raise KeyError(f)


def q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes per super-block [..., 12] as the 6-bit (scale, min) of its 8 groups [..., 8]:
    groups 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7 in the nibbles
    of bytes 8-11 with their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    s = s.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)

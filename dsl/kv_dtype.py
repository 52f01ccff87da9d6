"""The KV cache's element type: bf16 (the default) or fp8 (e4m3 with a scale per token and KV head).

fp8 rule, shared by the numpy reference and the CUDA kernels bit for bit: for each cache row's
head of `head_dim` values x (float32), amax = max |x|; inv = 448 / amax and scale = amax / 448
(both float32 divisions, 0 where amax is 0); code = e4m3(x * inv), rounded to nearest even and
saturated at 448 (PTX cvt.rn.satfinite.e4m3x2.f32). The value read back is code * scale.
"""
from __future__ import annotations

import copy

import numpy as np

from ..errors import FuselmError

KV_DTYPES = ("bf16", "fp8")
KV_CHOICES = (*KV_DTYPES, "auto")   # what a user may ask for: "auto" picks by the context (resolve_kv)
# "auto" takes fp8 for contexts longer than this: there an 8B's bf16 cache of a full context reads
# over 1 GiB a token (7% of its weights' bytes and growing), and fp8 halves it
AUTO_FP8_FROM = 8192
E4M3_MAX = 448.0


class KvDtypeError(FuselmError, ValueError):
    """A KV cache dtype that is not one of `choices`; `param` names the parameter that held it."""

    def __init__(self, param: str, value, choices=KV_DTYPES):
        super().__init__(f"{param} must be one of {', '.join(choices)}, got {value!r}")
        self.param = param


def check_kv(value, param: str = "kv") -> str:
    """`value` when it is a known KV cache dtype, else KvDtypeError naming `param`."""
    if value not in KV_DTYPES:
        raise KvDtypeError(param, value)
    return value


def resolve_kv(value, ctx: int, param: str = "kv") -> str:
    """The KV cache dtype `value` (one of KV_CHOICES) means for an engine of `ctx` positions:
    "auto" is fp8 beyond AUTO_FP8_FROM positions and bf16 within, as calm switches past 4k."""
    if value not in KV_CHOICES:
        raise KvDtypeError(param, value, KV_CHOICES)
    if value == "auto":
        return "fp8" if ctx > AUTO_FP8_FROM else "bf16"
    return value


def e4m3_codes(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 (fn) bits as uint8: round to nearest even, saturate at +-448 (NaN stays NaN,
    0x7f). Exact integer arithmetic on the float32 bits, so it needs no fp8 library."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    a = np.abs(x).astype(np.float64)                # exact: every float32 is a float64
    # quantum of the e4m3 grid at |x|: 2^(e - 3) for normal exponents e >= -6, else 2^-9
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    q = np.exp2(np.maximum(e, -6.0) - 3.0)
    r = np.round(a / q) * q                         # np.round: half to even, exact here
    r = np.minimum(r, E4M3_MAX)
    # bits of r: exponent field 0 (subnormal, multiples of 2^-9) or e + 7 with a 3-bit mantissa
    re = np.floor(np.log2(np.where(r > 0, r, 1.0)))
    normal = r >= 2.0 ** -6
    mant = np.where(normal, r / np.exp2(re) * 8 - 8, r * 512)
    field = np.where(normal, (re + 7) * 8 + mant, mant)
    out = np.where(np.isnan(field), 0, field).astype(np.int64).astype(np.uint8) | sign
    return np.where(np.isnan(x), np.uint8(0x7F) | sign, out).astype(np.uint8)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """e4m3 (fn) bits (uint8) -> float32 values (0x7f / 0xff: NaN)."""
    c = np.asarray(codes, np.uint8).astype(np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * np.exp2(e - 7.0))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


def quantize_heads(x: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [T, KV * head_dim] -> (codes uint8 [T, KV * head_dim], scales float32 [T, KV]) by the
    rule in the module docstring."""
    x = np.asarray(x, np.float32)
    t = x.shape[0]
    xh = x.reshape(t, -1, head_dim)                                  # [T, KV, hd]
    amax = np.abs(xh).max(axis=-1)                                   # [T, KV]
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(E4M3_MAX) / safe, np.float32(0)).astype(np.float32)
    scales = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    codes = e4m3_codes((xh * inv[..., None]).astype(np.float32))
    return codes.reshape(x.shape), scales


def fp8_round_trip(x: np.ndarray, head_dim: int) -> np.ndarray:
    """What an fp8 cache holds for rows x, as float32: code * scale (see quantize_heads)."""
    codes, scales = quantize_heads(x, head_dim)
    t = codes.shape[0]
    v = e4m3_values(codes).reshape(t, -1, head_dim) * scales[..., None]
    return v.astype(np.float32).reshape(codes.shape)


def with_kv_dtype(graph, kv: str):
    """A copy of `graph` whose kv_write nodes store `kv` ("bf16": `graph` itself). Each fp8 write
    learns its head size from the attention node that reads its cache (attrs kv, head_dim)."""
    check_kv(kv)
    if kv == "bf16":
        return graph
    g = copy.deepcopy(graph)
    head_dims = {}
    for n in g.nodes.values():
        if n.op == "attention":
            for cache in n.inputs[1:3]:
                head_dims[cache] = n.attrs["head_dim"]
    for n in g.nodes.values():
        if n.op == "kv_write":
            if n.name not in head_dims:
                raise FuselmError(f"{n.name}: an fp8 KV cache needs an attention node reading it (for its head size)")
            n.attrs = {**n.attrs, "kv": kv, "head_dim": head_dims[n.name]}
    return g


def graph_kv_dtype(graph) -> str:
    """The KV dtype of a DSL graph's caches ("bf16" where it has none or they are bf16)."""
    return next((n.attrs.get("kv", "bf16") for n in graph.nodes.values() if n.op == "kv_write"), "bf16")

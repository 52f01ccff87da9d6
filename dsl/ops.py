"""The op registry: every op fuselm knows, with its kind, shape rule, numpy reference and C form.

Compiler passes read an op's *kind* and traits, never its name. Adding an elementwise op is one
`register(OpDef(...))` call with a numpy reference and a C expression; the fusion passes and the
code generator pick it up from there.

Shapes are tuples of ints and symbols: "T" is the number of tokens in a step and "S" the number of
rows of the KV cache. Every activation is 2-D, [T, width]; heads are flattened into the width.
The paged forms of the cache ops (`paged_kv_write`, `paged_attention`; dsl/paging.py) address the
cache through each token's page table [T, P]: the rows of one sequence lie in pages of `page`
rows anywhere in a shared pool.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import FuselmError

Shape = tuple  # of int | str


class Kind(enum.Enum):
    """What an op does to its operands, as far as fusion cares: the passes read only this."""
    SOURCE = "source"            # graph inputs, weights, constants, persistent state
    EMBEDDING = "embedding"      # gather rows of a table
    NORM = "norm"                # reduces over (groups of) a row, then scales it: a GEMV prologue
    LINEAR = "linear"            # y = x @ W.T: the GEMVs
    ELEMENTWISE = "elementwise"  # out[t, i] depends on inputs at [t, i] (or broadcast [i])
    ROW_LOCAL = "row_local"      # out[t, i] depends on a span of the row around i (RoPE: a head)
    CACHE_WRITE = "cache_write"  # writes rows into a persistent KV cache, in place
    ATTENTION = "attention"      # attends over a KV cache
    REDUCTION = "reduction"      # needs a whole row first (softmax, argmax)
    MOE = "moe"                  # routed expert FFN: reads only the weights of the experts a row picks
    COLLECTIVE = "collective"    # combines a value over the ranks of a tensor-parallel model


@dataclass(frozen=True)
class OpDef:
    """One op: how to infer its output, how to compute it in numpy, and how to write it in C.

    `c_expr` (elementwise ops only) is a C expression over `{a}`, `{b}`, ... (the operands, as
    float) and `{attr}` placeholders, which the code generator fills with C float literals. `span_attr` (row-local ops) names the attribute that gives
    how many consecutive elements of a row one output depends on.
    """
    name: str
    kind: Kind
    arity: int                     # operands, plus up to `optional` more after them
    shape_rule: Callable[[list, dict], tuple[Shape, str]]
    reference: Callable[..., np.ndarray] | None
    c_expr: str | None = None
    span_attr: str | None = None
    inplace_of: int | None = None  # the output is this input, updated in place
    attr_defaults: dict = field(default_factory=dict)
    # Row-local ops: whether the GEMV epilogue's tile layout (pairs i, i + span/2) fits this use,
    # given the operand shapes and attributes; None means always.
    tile_fits: Callable[[list, dict], bool] | None = None
    optional: int = 0              # trailing operands that may be left out (attention sinks, biases)


REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Add an op to the registry (replacing one of the same name) and return it."""
    REGISTRY[op.name] = op
    return op


def get(name: str) -> OpDef:
    """The registered op `name`; an unknown name lists the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op '{name}'; known ops: {', '.join(sorted(REGISTRY))}") from None


# ---- shape rules -------------------------------------------------------------------------------

class ShapeError(FuselmError, ValueError):
    """Operand shapes that an op's shape rule rejects."""


def _same_as_first(shapes, attrs):
    return shapes[0], "f32"


def elementwise_shape(shapes, attrs):
    """Elementwise: every operand is [T, N], [N] (broadcast over rows) or [] (a scalar)."""
    full = max(shapes, key=len)
    for s in shapes:
        if s and s[-1] != full[-1] or len(s) == 2 and s != full:
            raise ShapeError(f"operands do not broadcast: {shapes}")
    return full, "f32"


def _linear_shape(shapes, attrs):
    (t, k), (n, k2) = shapes
    if k != k2:
        raise ShapeError(f"linear: input width {k} does not match weight shape {shapes[1]}")
    return (t, n), "f32"


def _embedding_shape(shapes, attrs):
    (v, d), (t,) = shapes
    return (t, d), "f32"


def _norm_shape(shapes, attrs):
    x, w = shapes
    group = attrs.get("group") or x[-1]
    if x[-1] % group or w != (group,):
        raise ShapeError(f"rmsnorm: weight {w} does not fit rows of {x[-1]} in groups of {group}")
    return x, "f32"


def _rope_shape(shapes, attrs):
    x, pos, inv_freq = shapes
    if x[-1] % attrs["head_dim"] or inv_freq[0] * 2 > attrs["head_dim"]:
        raise ShapeError(f"rope: width {x[-1]} vs head_dim {attrs['head_dim']}, inv_freq {inv_freq}")
    return x, "f32"


def _kv_write_shape(shapes, attrs):
    cache, x, pos = shapes
    if cache[-1] != x[-1]:
        raise ShapeError(f"kv_write: cache rows of {cache[-1]} but values of width {x[-1]}")
    return cache, "f32"


def _paged_kv_write_shape(shapes, attrs):
    cache, x, pos, pages = shapes
    if len(pages) != 2 or attrs["page"] < 1:
        raise ShapeError(f"paged_kv_write: page table {pages} must be [T, P], page {attrs['page']} >= 1")
    return _kv_write_shape(shapes[:3], attrs)


def _paged_attention_shape(shapes, attrs):
    if len(shapes[4]) != 2 or attrs["page"] < 1:
        raise ShapeError(f"paged_attention: page table {shapes[4]} must be [T, P], page {attrs['page']} >= 1")
    return _attention_shape(shapes[:4] + shapes[5:], attrs)


def _attention_shape(shapes, attrs):
    q, kc, vc, pos, *sinks = shapes
    h, kv, hd = attrs["n_heads"], attrs["n_kv_heads"], attrs["head_dim"]
    if q[-1] != h * hd or kc[-1] != kv * hd or vc[-1] != kv * hd or h % kv:
        raise ShapeError(f"attention: q {q}, caches {kc} {vc} vs {h} heads, {kv} kv heads of {hd}")
    if sinks and tuple(sinks[0]) != (h,):
        raise ShapeError(f"attention: sinks {sinks[0]} must hold one logit per query head ({h})")
    return q, "f32"


def _moe_shape(shapes, attrs):
    x, logits, w_gate, w_up, w_down, *biases = shapes
    e, i, d = w_gate
    if (logits[-1] != e or x[-1] != d or w_up != (e, i, d) or w_down != (e, d, i)
            or not 1 <= attrs["top_k"] <= e):
        raise ShapeError(f"moe_ffn: x {x}, router logits {logits}, experts {w_gate} {w_up} {w_down}, "
                         f"top_k {attrs['top_k']}")
    if biases and [tuple(b) for b in biases] != [(e, i), (e, i), (e, d)]:
        raise ShapeError(f"moe_ffn: expert biases {biases} must be gate and up [{e}, {i}], down [{e}, {d}]")
    return x, "f32"


def _argmax_shape(shapes, attrs):
    return (shapes[0][0],), "i32"


# ---- numpy references (float32, [T, ...]) -------------------------------------------------------

def _rmsnorm(x, w, eps, group=None, offset=0.0):
    g = group or x.shape[-1]
    xs = x.reshape(*x.shape[:-1], -1, g)
    inv = 1.0 / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + eps)
    return (xs * inv * (w + offset)).reshape(x.shape).astype(np.float32)


def _rope(x, pos, inv_freq, head_dim, interleaved=False):
    t = x.shape[0]
    half = inv_freq.shape[0]                      # rotated pairs per head (partial rotary: < hd/2)
    ang = pos.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]  # [T, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    xh = x.reshape(t, -1, head_dim).astype(np.float64).copy()
    if interleaved:                               # pairs (2i, 2i+1)
        a, b = xh[..., 0:2 * half:2].copy(), xh[..., 1:2 * half:2].copy()
        xh[..., 0:2 * half:2], xh[..., 1:2 * half:2] = a * cos - b * sin, b * cos + a * sin
    else:                                         # Hugging Face layout: pairs (i, i + rot/2)
        a, b = xh[..., :half].copy(), xh[..., half:2 * half].copy()
        xh[..., :half], xh[..., half:2 * half] = a * cos - b * sin, b * cos + a * sin
    return xh.reshape(x.shape).astype(np.float32)


def _kv_write(cache, x, pos, kv="bf16", head_dim=0):
    """Rows `pos` of the cache become x, in place: the op is declared so (inplace_of=0), and
    copying a whole cache every token would dominate a CPU decode step. kv="fp8": x as an fp8
    cache holds it (e4m3 codes times a scale per token and head of `head_dim`, dsl/kv_dtype.py)."""
    if kv == "fp8":
        from .kv_dtype import fp8_round_trip
        x = fp8_round_trip(x, head_dim)
    cache[pos] = x
    return cache


def _attention(q, kc, vc, pos, sinks=None, *, n_heads, n_kv_heads, head_dim, scale, window=0, softcap=0.0):
    """Causal attention of each query row over cache rows [pos - window + 1, pos], in float64;
    `sinks` [H] (gpt-oss): a logit per head that joins each softmax and attends to nothing."""
    out = np.zeros((q.shape[0], n_heads * head_dim), np.float64)
    for i, p in enumerate(pos.astype(np.int64)):
        lo = max(0, p - window + 1) if window else 0
        out[i] = _attend(q[i], kc[lo:p + 1], vc[lo:p + 1], n_kv_heads, head_dim, scale, softcap, sinks)
    return out.astype(np.float32)


def _attend(q, k, v, n_kv_heads, head_dim, scale, softcap, sinks=None):
    """One query row [H * hd] over its cache rows k, v [n, KV * hd], in float64: [H * hd]."""
    k = k.reshape(-1, n_kv_heads, head_dim).astype(np.float64)             # [n, KV, hd]
    v = v.reshape(-1, n_kv_heads, head_dim).astype(np.float64)
    qh = q.reshape(n_kv_heads, -1, head_dim).astype(np.float64)            # [KV, G, hd]
    s = np.einsum("kgd,nkd->kgn", qh, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    top = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks.astype(np.float64).reshape(*top.shape))
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.astype(np.float64).reshape(*top.shape) - top)
    return np.einsum("kgn,nkd->kgd", e / total, v).reshape(-1)


def page_rows(pages, positions, page):
    """The pool rows of logical `positions` [n] of one sequence whose page table is `pages` [P]."""
    positions = np.asarray(positions, np.int64)
    return np.asarray(pages, np.int64)[positions // page] * page + positions % page


def _paged_kv_write(cache, x, pos, pages, page, kv="bf16", head_dim=0):
    """kv_write through each token's page table: row pos[t] of token t's sequence."""
    rows = np.array([page_rows(pages[t], [p], page)[0] for t, p in enumerate(pos)], np.int64)
    return _kv_write(cache, x, rows, kv, head_dim)


def _paged_attention(q, kc, vc, pos, pages, sinks=None, *, page, n_heads, n_kv_heads, head_dim, scale, window=0,
                     softcap=0.0):
    """attention of each token over its own sequence's rows, found through its page table."""
    out = np.zeros((q.shape[0], n_heads * head_dim), np.float64)
    for i, p in enumerate(pos.astype(np.int64)):
        lo = max(0, p - window + 1) if window else 0
        rows = page_rows(pages[i], np.arange(lo, p + 1), page)
        out[i] = _attend(q[i], kc[rows], vc[rows], n_kv_heads, head_dim, scale, softcap, sinks)
    return out.astype(np.float32)


def _moe_ffn(x, logits, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, top_k, act="silu",
             norm_topk=True, swiglu_limit=0.0, swiglu_alpha=1.0):
    """Mixtral's (and Qwen3-MoE's, gpt-oss's) sparse MoE block, in float64, row by row.

    softmax(logits) -> the top_k experts -> their probabilities, renormalised to sum 1 with
    `norm_topk` (the same as a softmax over the top_k logits alone), else as they are (Qwen3-MoE's
    norm_topk_prob false) -> sum of weight * down_e(act(gate_e x) * up_e x), each projection
    plus its expert's bias where given. With `swiglu_limit` L > 0 (gpt-oss) the product is
    g sigmoid(alpha g) (u + 1) for g = min(gate, L), u = up clipped to [-L, L], alpha `swiglu_alpha`.
    """
    act_ref = REGISTRY[act].reference
    out = np.zeros(x.shape, np.float64)
    bias = lambda b, e: 0.0 if b is None else b[e].astype(np.float64)   # noqa: E731
    for t in range(x.shape[0]):
        lg = logits[t].astype(np.float64)
        top = np.argsort(-lg, kind="stable")[:top_k]
        w = np.exp(lg[top] - lg[top].max())
        total = w.sum() if norm_topk else np.exp(lg - lg[top].max()).sum()
        xt = x[t].astype(np.float64)
        for e, we in zip(top, w / total):
            gate = w_gate[e].astype(np.float64) @ xt + bias(b_gate, e)
            up = w_up[e].astype(np.float64) @ xt + bias(b_up, e)
            if swiglu_limit:
                gate, up = np.minimum(gate, swiglu_limit), np.clip(up, -swiglu_limit, swiglu_limit)
                h = gate / (1 + np.exp(-swiglu_alpha * gate)) * (up + 1)
            else:
                h = act_ref(gate) * up
            out[t] += we * (w_down[e].astype(np.float64) @ h + bias(b_down, e))
    return out.astype(np.float32)


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _gelu_tanh(x):
    return (0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))).astype(np.float32)


def _elementwise(name, arity, ref, c_expr, **defaults):
    return OpDef(name, Kind.ELEMENTWISE, arity, elementwise_shape, ref, c_expr=c_expr, attr_defaults=defaults)


for _op in [
    OpDef("embedding", Kind.EMBEDDING, 2, _embedding_shape, lambda table, ids: table[ids].astype(np.float32)),
    OpDef("rmsnorm", Kind.NORM, 2, _norm_shape, _rmsnorm, attr_defaults={"group": None, "offset": 0.0}),
    OpDef("linear", Kind.LINEAR, 2, _linear_shape, lambda x, w: (x @ w.T).astype(np.float32)),
    OpDef("rope", Kind.ROW_LOCAL, 3, _rope_shape, _rope, span_attr="head_dim",
          attr_defaults={"interleaved": False},
          tile_fits=lambda shapes, attrs: 2 * shapes[2][0] == attrs["head_dim"]),  # no partial rotary
    OpDef("kv_write", Kind.CACHE_WRITE, 3, _kv_write_shape, _kv_write, inplace_of=0),
    # q, caches, positions [, sinks [H]: gpt-oss's logit per head in each softmax]
    OpDef("attention", Kind.ATTENTION, 4, _attention_shape, _attention,
          attr_defaults={"window": 0, "softcap": 0.0}, optional=1),
    # the same through page tables [T, P] (dsl/paging.py): the numpy reference only, so far
    OpDef("paged_kv_write", Kind.CACHE_WRITE, 4, _paged_kv_write_shape, _paged_kv_write, inplace_of=0),
    OpDef("paged_attention", Kind.ATTENTION, 5, _paged_attention_shape, _paged_attention,
          attr_defaults={"window": 0, "softcap": 0.0}, optional=1),
    OpDef("softmax", Kind.REDUCTION, 1, _same_as_first, _softmax),
    # x [T, D], router logits [T, E], gate and up [E, I, D], down [E, D, I] (stacked over experts)
    # [, their biases: gate and up [E, I], down [E, D]]
    OpDef("moe_ffn", Kind.MOE, 5, _moe_shape, _moe_ffn, optional=3,
          attr_defaults={"act": "silu", "norm_topk": True, "swiglu_limit": 0.0, "swiglu_alpha": 1.0}),
    OpDef("argmax", Kind.REDUCTION, 1, _argmax_shape, lambda x: np.argmax(x, axis=-1).astype(np.int32)),
    # the sum of x over the ranks (compiler/partition.py); one rank's graph alone: x itself, the
    # ranks in lockstep: runtime/reference.py run_ranks sums them
    OpDef("all_reduce", Kind.COLLECTIVE, 1, _same_as_first, lambda x, ranks: x),
    _elementwise("add", 2, lambda a, b: (a + b).astype(np.float32), "{a} + {b}"),
    _elementwise("mul", 2, lambda a, b: (a * b).astype(np.float32), "{a} * {b}"),
    _elementwise("scale", 1, lambda a, factor: (a * np.float32(factor)).astype(np.float32),
                 "{a} * {factor}"),
    _elementwise("silu", 1, lambda a: (a / (1 + np.exp(-a))).astype(np.float32),
                 "{a} / (1.0f + __expf(-{a}))"),
    _elementwise("gelu_tanh", 1, _gelu_tanh,
                 "0.5f * {a} * (1.0f + tanhf(0.7978845608f * ({a} + 0.044715f * {a} * {a} * {a})))"),
    _elementwise("softcap", 1, lambda a, cap: (cap * np.tanh(a / cap)).astype(np.float32),
                 "{cap} * tanhf({a} / {cap})"),
]:
    register(_op)

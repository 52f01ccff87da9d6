"""The attention family: flash-decoding over the KV cache (a split launch and a combine launch), and
a one-launch variant for short contexts."""
from __future__ import annotations

import os

import networkx as nx

from ..errors import FuselmError
from . import cexpr
from .params import Params, storage_of

WARPS = int(os.environ.get("FUSELM_ATTN_WARPS", 4))      # per split block
MAX_ROWS = int(os.environ.get("FUSELM_ATTN_ROWS", 8))    # cache rows per lane, at most
MAX_SCORES = 32  # cache rows x query heads whose scores one lane keeps in registers
COMBINE_WARPS = 8                                         # per combine block
SINGLE_WARPS = 8                                          # per block of the one-launch short variant
SINGLE_PASSES = int(os.environ.get("FUSELM_ATTN_SINGLE_PASSES", 2))   # its longest walk, in passes
SINGLE_ROWS = int(os.environ.get("FUSELM_ATTN_SINGLE_ROWS", 4))       # its cache rows per lane, at most


def lanes_per_row(head_dim: int) -> int:
    """Lanes sharing one cache row, 8 dims each, rounded up to a power of two (RowLanes)."""
    lanes = 1
    while lanes * 8 < head_dim:
        lanes *= 2
    return lanes


def _rows_per_lane(limit: int, group: int) -> int:
    """Cache rows a lane holds: at most `limit`, and J x group scores fit in MAX_SCORES registers."""
    return max(1, min(limit, MAX_SCORES // group))


def chunk_shape(head_dim: int, group: int) -> tuple[int, int]:
    """(rows per lane J, cache positions per split block). A lane holds J rows of K and V and the
    J x group scores in registers; the chunk is what the block's lanes cover together."""
    rows_per_lane = _rows_per_lane(MAX_ROWS, group)
    return rows_per_lane, WARPS * (32 // lanes_per_row(head_dim)) * rows_per_lane


SMEM = 48 * 1024   # static shared memory a kernel may use


def _softmax_smem(warps: int, head_dim: int, group: int) -> int:
    return 4 * warps * group * (lanes_per_row(head_dim) * 8 + 2)        # block_softmax's wacc, wm, wl


def single_warps(head_dim: int, group: int) -> int:
    """Warps per block of the one-launch variant: SINGLE_WARPS where their softmax states fit in
    shared memory (block_softmax), else WARPS."""
    return SINGLE_WARPS if _softmax_smem(SINGLE_WARPS, head_dim, group) <= SMEM else WARPS


def single_rows(group: int) -> int:
    """Cache rows per lane of the one-launch variant (by default half the split's): a short
    context's few rows spread over more lanes, less serial work per lane."""
    return _rows_per_lane(SINGLE_ROWS, group)


def single_until(head_dim: int, group: int) -> int:
    """Positions below which one block per KV head walking the whole context (attention_single,
    SINGLE_PASSES passes at most) replaces the split and combine launches: at short contexts the
    time is latency, and one launch has less of it than two."""
    return SINGLE_PASSES * single_warps(head_dim, group) * (32 // lanes_per_row(head_dim)) * single_rows(group)


def context(G: nx.DiGraph, launch: dict, params: Params, rows: int) -> dict:
    """Template variables of one attention launch over a cache of `rows` positions."""
    (n,) = launch["nodes"]
    d = G.nodes[n]
    q, kc, vc, pos = d["inputs"]
    a = d["attrs"]
    group, hd = a["n_heads"] // a["n_kv_heads"], a["head_dim"]
    if hd > 256:
        raise FuselmError(f"{n}: head_dim {hd} > 256 is not supported by the attention kernel")
    if G.nodes[storage_of(G, pos)]["op"] != "input":
        raise FuselmError(f"{n}: the position must be a graph input (the attention kernel reads it before "
                          f"waiting for the previous kernel), not a computed value")
    rows_per_lane, chunk = chunk_shape(hd, group)
    if _softmax_smem(WARPS, hd, group) > SMEM:
        raise FuselmError(f"{n}: {group} query heads per KV head of {hd} need {_softmax_smem(WARPS, hd, group)} "
                          f"bytes of shared memory in the attention kernel; at most {SMEM} are supported")
    nchunk = -(-rows // chunk)
    record = (hd + 3) // 4 * 4 + 4                                      # Record<HD>::FLOATS
    return {"H": a["n_heads"], "KV": a["n_kv_heads"], "HD": hd, "chunk": chunk, "rows_per_lane": rows_per_lane,
            "nchunk": nchunk, "window": int(a.get("window") or 0), "scale": cexpr.float_literal(a["scale"]),
            "softcap": cexpr.float_literal(a.get("softcap") or 0.0), "threads": WARPS * 32, "warps": WARPS,
            "combine_warps": COMBINE_WARPS, "combine_threads": COMBINE_WARPS * 32,
            "single_warps": single_warps(hd, group), "single_threads": single_warps(hd, group) * 32,
            "single_rows": single_rows(group),
            "single_until": min(single_until(hd, group), rows),
            "q": params.ref(q), "kc": params.ref(kc), "vc": params.ref(vc), "pos": params.ref(pos),
            "out": params.ref(n, written=True),
            "ws": params.extra("float*", "workspace"),
            "workspace_floats": a["n_heads"] * nchunk * record}

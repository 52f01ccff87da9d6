"""The attention family: flash-decoding over the KV cache (a split launch and a combine launch), and
a one-launch variant for short contexts."""
from __future__ import annotations

import networkx as nx

from ..errors import FuselmError
from . import cexpr
from .knobs import SMS, env_int, env_set
from .params import Params, storage_of

WARPS = env_int("FUSELM_ATTN_WARPS", 8, 1, 32)                 # per split block
MAX_ROWS = env_int("FUSELM_ATTN_ROWS", 8, 1, 32)               # cache rows per lane, at most (LanePass)
MAX_SCORES = 32  # cache rows x query heads whose scores one lane keeps in registers (LanePass)
COMBINE_WARPS = env_int("FUSELM_ATTN_COMBINE_WARPS", 8, 1, 32)  # per combine block
COMBINE_GROUP = env_int("FUSELM_ATTN_COMBINE_GROUP", 4, 1, 64)  # chunks per combine warp per round of loads
SINGLE_WARPS = 8                                                # per block of the one-launch short variant
SINGLE_PASSES = env_int("FUSELM_ATTN_SINGLE_PASSES", 2, 0, 64)  # its longest walk, in passes
SINGLE_ROWS = env_int("FUSELM_ATTN_SINGLE_ROWS", 4, 1, 32)      # its cache rows per lane, at most (LanePass)
# Kernels whose passes run on tensor cores (MmaPass: head size 64 or 128, at most 8 query heads
# per KV head, sm_80 on), comma-separated: "split", "single"; "0" for none.
MMA = env_set("FUSELM_ATTN_MMA", "split,single", {"split", "single"}, "kernels")
# Split kernels whose MmaPass issues its V rows after the queries, not with the K rows before the
# wait (LATE_V in attention_mma.cuh), comma-separated: "wide", "split"; "0" for none. By default
# the wide split, whose blocks fill the GPU wherever it runs (perf notes, step 66).
LATE_V = env_set("FUSELM_ATTN_LATE_V", "wide", {"split", "wide"}, "kernels")
SMEM = 48 * 1024   # static shared memory a kernel may use
# Warps per block of the wide split (wide_split), 0 for none.
WIDE_WARPS = env_int("FUSELM_ATTN_WIDE_WARPS", 9, 0, 32)


def lanes_per_row(head_dim: int) -> int:
    """Lanes sharing one cache row, 8 dims each, rounded up to a power of two (RowLanes)."""
    lanes = 1
    while lanes * 8 < head_dim:
        lanes *= 2
    return lanes


def _rows_per_lane(limit: int, group: int) -> int:
    """Cache rows a lane holds: at most `limit`, and J x group scores fit in MAX_SCORES registers."""
    return max(1, min(limit, MAX_SCORES // group))


def mma_fits(head_dim: int, group: int) -> bool:
    """Whether MmaPass serves this head layout."""
    return head_dim in (64, 128) and group <= 8


def pass_of(kernel: str, kv: int, head_dim: int, group: int, warps: int, row_limit: int,
            late_v: bool = False) -> tuple[str, int]:
    """(C++ pass type, cache positions per pass) of the `kernel` ("split" or "single") with `warps`
    warps per block. MmaPass where it fits and FUSELM_ATTN_MMA lists the kernel (with `late_v`, its
    V rows after the queries); else LanePass, whose lanes hold J <= row_limit rows each (J x group
    scores in registers)."""
    if _on_tensor_cores(kernel, head_dim, group):
        late = ", true" if late_v else ""
        return f"MmaPass<{kv}, {head_dim}, {warps}, {group}{late}>", warps * (2048 // head_dim)   # MmaPass::CHUNK
    rows = _rows_per_lane(row_limit, group)
    return (f"LanePass<{kv}, {head_dim}, {warps}, {rows}, {group}>",
            warps * (32 // lanes_per_row(head_dim)) * rows)                                 # LanePass::CHUNK


def _on_tensor_cores(kernel: str, head_dim: int, group: int) -> bool:
    return kernel in MMA and mma_fits(head_dim, group)


def split_warps(head_dim: int, group: int) -> int:
    """Warps per split block: WARPS, fewer where their softmax states would not fit in shared memory."""
    return warps_fitting("split", WARPS, head_dim, group)


def split_pass(head_dim: int, group: int, kv: int) -> tuple[str, int]:
    """(pass type, cache positions per split block): the chunk is what one pass of the block covers."""
    return pass_of("split", kv, head_dim, group, split_warps(head_dim, group), MAX_ROWS, "split" in LATE_V)


def _softmax_smem(kernel: str, warps: int, head_dim: int, group: int) -> int:
    """Bytes of the block's WarpStates: per warp and head, max, sum and one row of values (padded
    by 4 floats in MmaPass, see its block_merge; LanePass keeps its lanes' 8-dim slices)."""
    row = head_dim + 4 if _on_tensor_cores(kernel, head_dim, group) else lanes_per_row(head_dim) * 8
    return 4 * warps * group * (row + 2)


def warps_fitting(kernel: str, warps: int, head_dim: int, group: int) -> int:
    """`warps`, halved until the block's softmax states fit in shared memory (WarpStates)."""
    while warps > 1 and _softmax_smem(kernel, warps, head_dim, group) > SMEM:
        warps //= 2
    return warps


def wide_split(head_dim: int, group: int, kv: int) -> dict | None:
    """The wide split: from the position where the split's KV x chunks blocks outnumber the SMs
    (a second wave, or two blocks on the SMs that free first, where the rest end waiting for
    them) up to where blocks of WIDE_WARPS warps (longer chunks: fewer blocks than SMs) still fit
    in one wave: "from", "until", its "pass" type, "chunk" and "warps"; None where it would not be
    wider or cover no positions. Measured (perf notes, steps 60 and 63): 9 warps, the default,
    about +1% at 4k for Llama-3.2-1B, its short context unchanged."""
    warps = warps_fitting("split", WIDE_WARPS, head_dim, group) if WIDE_WARPS else 0
    per_head = SMS // kv
    if warps <= split_warps(head_dim, group) or per_head == 0:
        return None
    wide_type, chunk = pass_of("split", kv, head_dim, group, warps, MAX_ROWS, "wide" in LATE_V)
    return {"from": per_head * split_pass(head_dim, group, kv)[1], "until": per_head * chunk,
            "pass": wide_type, "chunk": chunk, "warps": warps}


def single_warps(head_dim: int, group: int) -> int:
    """Warps per block of the one-launch variant: SINGLE_WARPS, fewer where their softmax states
    would not fit in shared memory."""
    return warps_fitting("single", SINGLE_WARPS, head_dim, group)


def single_pass(head_dim: int, group: int, kv: int) -> tuple[str, int]:
    """(pass type, positions per pass) of the one-launch variant; on CUDA cores its lanes hold
    fewer rows than the split's (SINGLE_ROWS): a short context's few rows spread over more lanes."""
    return pass_of("single", kv, head_dim, group, single_warps(head_dim, group), SINGLE_ROWS)


def single_until(head_dim: int, group: int) -> int:
    """Positions below which one block per KV head walking the whole context (attention_single,
    SINGLE_PASSES passes at most) replaces the split and combine launches: at short contexts the
    time is latency, and one launch has less of it than two."""
    return SINGLE_PASSES * single_pass(head_dim, group, kv=1)[1]


def context(G: nx.DiGraph, launch: dict, params: Params, rows: int, tokens: int = 1) -> dict:
    """Template variables of one attention launch over a cache of `rows` positions, for steps of
    `tokens` tokens (more than one: the prefill kernel alone)."""
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
    kv = a["n_kv_heads"]
    split_type, chunk = split_pass(hd, group, kv)
    if _softmax_smem("split", 1, hd, group) > SMEM:
        raise FuselmError(f"{n}: {group} query heads per KV head of {hd} need {_softmax_smem('split', 1, hd, group)} "
                          f"bytes of shared memory per warp in the attention kernel; at most {SMEM} are supported")
    nchunk = -(-rows // chunk)
    record = (hd + 3) // 4 * 4 + 4                                      # Record<HD>::FLOATS
    wide = wide_split(hd, group, kv) if tokens == 1 else None
    if wide and wide["from"] < rows:   # its chunks cover the cache, so it may serve any position
        wide = {**wide, "until": min(wide["until"], rows), "nchunk": -(-rows // wide["chunk"]),
                "threads": wide["warps"] * 32}
    else:
        wide = None
    return {"H": a["n_heads"], "KV": a["n_kv_heads"], "HD": hd, "chunk": chunk, "split_pass": split_type,
            "nchunk": nchunk, "window": int(a.get("window") or 0), "scale": cexpr.float_literal(a["scale"]),
            "softcap": cexpr.float_literal(a.get("softcap") or 0.0), "threads": split_warps(hd, group) * 32,
            "combine_warps": COMBINE_WARPS, "combine_threads": COMBINE_WARPS * 32, "combine_group": COMBINE_GROUP,
            "single_threads": single_warps(hd, group) * 32,
            "single_pass": single_pass(hd, group, kv)[0],
            "single_until": min(single_until(hd, group), rows),
            "q": params.ref(q), "kc": params.ref(kc), "vc": params.ref(vc), "pos": params.ref(pos),
            "out": params.ref(n, written=True),
            "ws": params.extra("float*", "workspace") if tokens == 1 else None,   # the split's records
            "workspace_floats": a["n_heads"] * nchunk * record if tokens == 1 else 0, "tokens": tokens,
            "wide": wide}

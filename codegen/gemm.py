"""The gemm family: a gemv kernel's nodes for a step of several tokens (a prompt's batched
prefill). Each block streams its tile's weight rows once for all the step's tokens, on tensor
cores (templates/gemm.cuh), then runs the gemv epilogue for every (row, token) of its tile."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import gemv_parts, zip_sets
from .gemv import input_vector, zip_contexts
from .knobs import env_int
from .params import Params

WARPS = env_int("FUSELM_GEMM_WARPS", 4, 1, 8)   # per block; each warp computes 16 rows of the tile
SLOTS = 16 * WARPS  # rows of each member per block
SMEM = 48 * 1024    # static shared memory a kernel may use


def chunk(K: int) -> int:
    """k per staged chunk: 128 where the rows allow (a round trip to memory per chunk)."""
    return next(kc for kc in (128, 64, 32) if K % kc == 0)


def smem_bytes(K: int, members: int, tokens: int) -> int:
    """Bytes of shared memory: the staged chunk (hi and lo words, StagedX) and the dot products
    of the tile share memory; then the per-token sums of squares."""
    entries = chunk(K) // 8
    staged = 2 * tokens * (entries + (12 - entries % 8) % 8) * 16
    return max(staged, members * SLOTS * tokens * 4) + 4 * tokens


def unsupported(G: nx.DiGraph, launch: dict, tokens: int) -> str | None:
    """Why this gemv kernel has no gemm form for steps of `tokens` tokens, or None: its rows must
    be whole 32-weight spans (a warp's load of a span), and its tile and staged chunk must fit the
    static shared memory."""
    prologue, linears, _ = gemv_parts(G, launch["nodes"])
    x = G.nodes[prologue]["inputs"][0] if prologue else G.nodes[linears[0]]["inputs"][0]
    K = G.nodes[x]["shape"][-1]
    if K % 32:
        return f"its rows of {K} weights are not a multiple of 32"
    members = max(len(z["linears"]) for z in zip_sets(G, launch["nodes"]))
    if smem_bytes(K, members, tokens) > SMEM:
        return (f"{members} GEMVs meeting in one epilogue at {tokens} tokens per step need "
                f"{smem_bytes(K, members, tokens)} bytes of shared memory; at most {SMEM}")
    return None


def context(G: nx.DiGraph, launch: dict, params: Params, tokens: int) -> dict:
    """Template variables of one gemm kernel for steps of `tokens` tokens (a multiple of 8)."""
    vec = input_vector(G, launch, params)
    zips, grid = zip_contexts(G, launch, params, lambda members, pairs: SLOTS, batched=True)
    return {**vec, "zips": zips, "threads": WARPS * 32, "tokens": tokens, "kc": chunk(vec["K"]),
            "max_tile": max(z["R"] * len(z["members"]) for z in zips), "grid": grid}

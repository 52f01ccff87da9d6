"""The gemm family: a gemv kernel's nodes for a step of several tokens (a prompt's batched
prefill). Each block streams its tile's weight rows once for all the step's tokens, on tensor
cores (templates/gemm.cuh), then runs the gemv epilogue for every (row, token) of its tile."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import zip_sets
from .gemv import input_vector, zip_contexts
from .params import Params

WARPS = 4   # per block: KSPLIT warps share each group of 16 rows of the tile, a slice of k each
KC = 32     # k per chunk a warp stages (its shared memory: 4 kB at 32 tokens)


def unsupported(G: nx.DiGraph, launch: dict) -> str | None:
    """Why this gemv kernel has no gemm form, or None: its rows must be whole 32-weight spans."""
    K = input_vector(G, launch, Params(G))["K"]
    if K % KC:
        return f"its rows of {K} weights are not a multiple of {KC}"
    if max(len(z["linears"]) for z in zip_sets(G, launch["nodes"])) > 3:
        return "more than 3 GEMVs meet in one epilogue"
    return None


def context(G: nx.DiGraph, launch: dict, params: Params, tokens: int) -> dict:
    """Template variables of one gemm kernel for steps of `tokens` tokens (a multiple of 8)."""
    vec = input_vector(G, launch, params)
    ksplit = next(s for s in (WARPS, 2, 1) if vec["K"] % (s * KC) == 0)   # warps per 16 rows
    zips, grid = zip_contexts(G, launch, params, lambda members, pairs: 16 * WARPS // ksplit, batched=True)
    return {**vec, "zips": zips, "threads": WARPS * 32, "tokens": tokens, "kc": KC, "ksplit": ksplit,
            "max_tile": max(z["R"] * len(z["members"]) for z in zips), "grid": grid}

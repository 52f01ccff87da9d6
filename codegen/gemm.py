"""The gemm family: a gemv kernel's nodes for a step of several tokens (a prompt's batched
prefill). Each block streams its tile's weight rows once for all the step's tokens, on tensor
cores (templates/gemm.cuh), then runs the gemv epilogue for every (row, token) of its tile."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import zip_sets
from .gemv import input_vector, zip_contexts
from .params import Params

WARPS = 4          # per block; each warp computes 16 rows of the tile
SLOTS = 16 * WARPS  # rows of each member per block


def unsupported(G: nx.DiGraph, launch: dict) -> str | None:
    """Why this gemv kernel has no gemm form, or None: its rows must be whole 32-weight spans."""
    K = input_vector(G, launch, Params(G))["K"]
    if K % 32:
        return f"its rows of {K} weights are not a multiple of 32"
    if max(len(z["linears"]) for z in zip_sets(G, launch["nodes"])) > 3:
        return "more than 3 GEMVs meet in one epilogue"
    return None


def context(G: nx.DiGraph, launch: dict, params: Params, tokens: int) -> dict:
    """Template variables of one gemm kernel for steps of `tokens` tokens (a multiple of 8)."""
    vec = input_vector(G, launch, params)
    K = vec["K"]
    zips, grid = zip_contexts(G, launch, params, lambda members, pairs: SLOTS, batched=True)
    return {**vec, "zips": zips, "threads": WARPS * 32, "tokens": tokens,
            "kc": next(kc for kc in (128, 64, 32) if K % kc == 0),     # k per staged chunk
            "max_tile": max(z["R"] * len(z["members"]) for z in zips), "grid": grid}

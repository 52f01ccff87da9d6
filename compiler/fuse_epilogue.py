"""Pass: epilogue fusion of elementwise and row-local ops into the GEMV that feeds them.

Before: gemv kernels (possibly horizontal, possibly with a norm prologue).
After: every ELEMENTWISE, ROW_LOCAL or CACHE_WRITE node that reads a value computed in a gemv
kernel runs in that kernel's epilogue, on the tile of rows the block has just computed (bias,
RoPE, KV-cache write, SiLU(gate) * up, residual add), provided that
- the kernel graph stays acyclic (the node's other operands come from earlier kernels),
- its tiled operands line up (same width; one row-to-slot mapping per zip set: see kernels.py),
- the result stays a legal gemv kernel (kernels.check_gemv).
Ops that need a whole GEMV output first (NORM, REDUCTION such as softmax) are never fused here.
Values that other kernels still read are written by the epilogue; the rest stay in registers.
"""
from __future__ import annotations

import networkx as nx

from .kernels import EPILOGUE_KINDS, check_gemv, family, members, merge


def fuse_epilogue(G: nx.DiGraph) -> nx.DiGraph:
    G = G.copy()
    changed = True
    while changed:
        changed = False
        groups = members(G)
        for kernel, nodes in groups.items():
            if family(G, nodes) != "gemv":
                continue
            for cand in _candidates(G, nodes):
                if _try_fuse(G, kernel, cand):
                    changed = True
                    break
            if changed:
                break
    return G


def _candidates(G: nx.DiGraph, nodes: list[str]) -> list[str]:
    inside = set(nodes)
    seen = []
    for n in nodes:
        for reader in G.successors(n):
            d = G.nodes[reader]
            if reader not in inside and d["kind"] in EPILOGUE_KINDS and reader not in seen \
                    and len(members(G)[d["kernel"]]) == 1:
                seen.append(reader)
    return sorted(seen, key=lambda n: G.nodes[n]["order"])


def _try_fuse(G: nx.DiGraph, kernel: str, cand: str) -> bool:
    trial = G.copy()
    if not merge(trial, [kernel, G.nodes[cand]["kernel"]], into=kernel):
        return False
    try:
        check_gemv(trial, members(trial)[kernel])
    except ValueError:
        return False
    for n in trial:
        G.nodes[n]["kernel"] = trial.nodes[n]["kernel"]
    return True

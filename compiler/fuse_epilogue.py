"""Pass: epilogue fusion of elementwise and row-local ops into the GEMV (or experts) that feed them.

Before: gemv and moe kernels (possibly horizontal, possibly with a norm prologue).
After: every ELEMENTWISE, ROW_LOCAL or CACHE_WRITE node that reads a value computed in a gemv
kernel runs in that kernel's epilogue, on the tile of rows the block has just computed (bias,
RoPE, KV-cache write, SiLU(gate) * up, residual add), provided that
- no other operand of the node comes from a kernel that depends on this one (a cycle),
- its tiled operands line up (same width; one row-to-slot mapping per zip set: see kernels.py),
- the result stays a legal gemv kernel (kernels.check_gemv).
A moe kernel takes ELEMENTWISE ops on its output rows alone (the residual add after the experts;
kernels.check_moe). Ops that need a whole GEMV output first (NORM, REDUCTION such as softmax) are
never fused here.
Values that other kernels still read are written by the epilogue; the rest stay on chip.
"""
from __future__ import annotations

import networkx as nx

from ..dsl import Kind
from .kernels import EPILOGUE_KINDS, check_gemv, check_moe, family, kernel_successors, members, runs_after

CHECKS = {"gemv": (EPILOGUE_KINDS, check_gemv), "moe": ((Kind.ELEMENTWISE,), check_moe)}


def fuse_epilogue(G: nx.DiGraph) -> nx.DiGraph:
    """Grow every gemv and moe kernel by the epilogue ops that may join it (see the module docstring)."""
    G = G.copy()
    groups = members(G)
    for kernel in list(groups):
        if kernel not in groups or (fam := family(G, groups[kernel])) not in CHECKS:
            continue
        kinds, check = CHECKS[fam]
        nodes = groups[kernel]
        grown = True
        while grown:
            grown = False
            for cand in _candidates(G, nodes, groups, kinds):
                if _legal(G, nodes, cand, check):
                    del groups[G.nodes[cand]["kernel"]]
                    G.nodes[cand]["kernel"] = kernel
                    nodes.append(cand)
                    grown = True
                    break
    return G


def _candidates(G: nx.DiGraph, nodes: list[str], groups: dict, kinds) -> list[str]:
    """Single-op kernels of one of `kinds` that read something this kernel computes."""
    inside = set(nodes)
    found = {r for n in nodes for r in G.successors(n)
             if r not in inside and G.nodes[r]["kind"] in kinds
             and len(groups[G.nodes[r]["kernel"]]) == 1}
    return sorted(found, key=lambda n: G.nodes[n]["order"])


def _legal(G: nx.DiGraph, nodes: list[str], cand: str, check) -> bool:
    inside = set(nodes)
    outside = [i for i in G.nodes[cand]["inputs"] if i not in inside and G.nodes[i]["kind"] is not Kind.SOURCE]
    if outside:
        # An operand made by a kernel that runs after this one (directly or through any other
        # kernel) would need this kernel twice: the kernel graph would get a cycle.
        later = runs_after(kernel_successors(G), {G.nodes[nodes[0]]["kernel"]})
        if any(G.nodes[i]["kernel"] in later for i in outside):
            return False
    try:
        check(G, sorted(nodes + [cand], key=lambda n: G.nodes[n]["order"]))
    except ValueError:
        return False
    return True

"""Pass: horizontal GEMV fusion.

Before: kernels as lowered (or already fused).
After: LINEAR nodes that read the same vector run in one gemv kernel (Q, K and V; gate and up):
the vector is read once and one launch covers them all. Merges that would make the kernel graph
cyclic are skipped.
"""
from __future__ import annotations

from collections import defaultdict

import networkx as nx

from ..dsl import Kind
from .kernels import merge


def fuse_horizontal(G: nx.DiGraph) -> nx.DiGraph:
    """Merge the kernels of LINEAR nodes that read one vector (see the module docstring)."""
    G = G.copy()
    readers: dict[str, list[str]] = defaultdict(list)
    for name, data in G.nodes(data=True):
        if data["kind"] is Kind.LINEAR:
            readers[data["inputs"][0]].append(name)
    for linears in readers.values():
        if len(linears) > 1:
            merge(G, [G.nodes[n]["kernel"] for n in linears])
    return G

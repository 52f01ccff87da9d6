"""Pass: fusion of row-wise chains that touch no GEMV.

Before: kernels of the "rowwise" family (embedding, norms, elementwise and row-local ops,
reductions over a row) that no earlier pass absorbed.
After: producer and consumer row-wise kernels are merged wherever the kernel graph stays
acyclic, so a chain such as embedding -> scale, or a stand-alone norm -> softcap, is one launch.
"""
from __future__ import annotations

import networkx as nx

from .kernels import family, members, merge


def fuse_elementwise(G: nx.DiGraph) -> nx.DiGraph:
    """Merge producer/consumer row-wise kernels (see the module docstring)."""
    G = G.copy()
    rowwise = {k for k, nodes in members(G).items() if family(G, nodes) == "rowwise"}
    changed = True
    while changed:   # sweep until nothing merges: one merge can make another one legal
        changed = False
        for u, v in G.edges:
            ku, kv = G.nodes[u]["kernel"], G.nodes[v]["kernel"]
            if ku != kv and ku in rowwise and kv in rowwise and merge(G, [ku, kv]):
                rowwise.discard(kv)   # its nodes now belong to ku, which stays row-wise
                changed = True
    return G

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
    G = G.copy()
    changed = True
    while changed:
        changed = False
        groups = members(G)
        rowwise = {k for k, nodes in groups.items() if family(G, nodes) == "rowwise"}
        for u, v in G.edges:
            ku, kv = G.nodes[u]["kernel"], G.nodes[v]["kernel"]
            if ku != kv and ku in rowwise and kv in rowwise and merge(G, [ku, kv]):
                changed = True
                break
    return G

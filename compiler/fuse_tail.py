"""Pass: row-wise kernels folded into the GEMV kernel they wait for, as its tail.

Before: row-wise kernels that read the results of a gemv kernel, such as Qwen3's per-head Q/K
norms with RoPE and the KV-cache write after the Q/K/V GEMVs, or Gemma's and OLMo 2's norm and
residual add after the O and down projections. Such a kernel cannot be an epilogue (a norm needs
whole rows, which many blocks compute) and, for one token, runs as a single block between two
full-GPU kernels: a launch and a drain for little work.
After: its nodes join that gemv kernel, marked TAIL (kernels.py): for one token the block of the
GEMVs that finishes last runs them (counted in by an arrival counter, no kernel boundary); for a
step of tokens the gemm family launches them as a row-wise kernel of their own right after.
A row-wise kernel joins the latest gemv kernel among those it reads, where the kernel graph
stays acyclic (kernels.merge) and the result is a legal gemv kernel; embeddings never do.
"""
from __future__ import annotations

import networkx as nx

from ..dsl import Kind
from .kernels import TAIL, check_gemv, family, kernel_graph, members, merge


def fuse_tail(G: nx.DiGraph) -> nx.DiGraph:
    """Fold each row-wise kernel into the gemv kernel it reads last (see the module docstring)."""
    G = G.copy()
    groups = members(G)
    order = {k: i for i, k in enumerate(nx.topological_sort(kernel_graph(G)))}
    for kernel, nodes in sorted(groups.items(), key=lambda kv: order[kv[0]]):
        if family(G, nodes) != "rowwise" or any(G.nodes[n]["kind"] is Kind.EMBEDDING for n in nodes):
            continue
        inside = set(nodes)
        producers = {G.nodes[i]["kernel"] for n in nodes for i in G.nodes[n]["inputs"]
                     if i not in inside and G.nodes[i]["kernel"] is not None}
        gemvs = sorted((p for p in producers if family(G, groups[p]) == "gemv"), key=order.get, reverse=True)
        for p in gemvs[:1]:                 # the latest: the others have finished before it starts
            for n in nodes:
                G.nodes[n][TAIL] = True
            try:
                check_gemv(G, groups[p] + nodes)
            except ValueError:
                legal = False
            else:
                legal = merge(G, [p, kernel], into=p)
            if legal:
                groups[p] = sorted(groups[p] + nodes, key=lambda n: G.nodes[n]["order"])
            else:
                for n in nodes:
                    del G.nodes[n][TAIL]
    return G

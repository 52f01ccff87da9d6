"""Pass: keep only what the persistent state needs (the graph of a prompt's batched prefill).

A prompt's tokens other than the last are run only for the KV-cache rows they leave; nobody reads
their logits. So the prefill graph keeps the ops from which some write into persistent state is
reachable (the K and V projections and cache writes of every layer, and all they depend on),
and drops the rest: the final norm and LM head, and the last layer's attention output and MLP.

Before: a lowered graph with outputs (nothing fused yet).
After: the same graph without its outputs and without every compute node from which no
CACHE_WRITE is reachable; sources nothing reads any more are dropped too.
"""
from __future__ import annotations

import networkx as nx

from ..dsl import Kind


def keep_state(G: nx.DiGraph) -> nx.DiGraph:
    """Drop what no state write needs (see the module docstring)."""
    writes = [n for n, d in G.nodes(data=True) if d["kind"] is Kind.CACHE_WRITE]
    needed = set(writes).union(*(nx.ancestors(G, n) for n in writes))
    H = G.subgraph(needed).copy()
    H.graph["outputs"] = {}
    return H

"""Pass: L2 prefetch planning, weights pulled toward L2 while attention leaves HBM idle.

Decode attention is a latency chain: once its cache rows have arrived, HBM idles through the
softmax, the merge and the output projection, whose weights are already in flight (its blocks
issue their first loads before they wait for the attention). The GEMV after that one (the MLP's
gate and up projections in a Llama layer) streams the most bytes of the layer and has nothing in
flight yet, so its leading rows are what the attention kernel should ask L2 for.

Before: `G.graph["schedule"]` (see schedule.py).
After: every attention launch that is followed, in the same layer, by two GEMV launches carries
`prefetch`: the weights of the second one's first zip set (the rows its first blocks stream),
in argument order. Code generation decides how many leading bytes of them each variant asks for.
Other launches carry `prefetch = []`.
"""
from __future__ import annotations

import networkx as nx

from .kernels import zip_sets


def plan_prefetch(G: nx.DiGraph) -> nx.DiGraph:
    """Name the weights each attention launch prefetches (see the module docstring)."""
    G = G.copy()
    launches = [dict(launch, prefetch=[]) for launch in G.graph["schedule"]]
    for i, launch in enumerate(launches):
        if launch["family"] != "attention":
            continue
        gemvs = [l for l in launches[i + 1:] if l["family"] == "gemv" and l["layer"] == launch["layer"]]
        if len(gemvs) >= 2:
            first_set = zip_sets(G, gemvs[1]["nodes"])[0]
            weights = [G.nodes[lin]["inputs"][1] for lin in first_set["linears"]]
            launch["prefetch"] = [w for w in weights if G.nodes[w]["op"] == "weight"]
    G.graph["schedule"] = launches
    return G

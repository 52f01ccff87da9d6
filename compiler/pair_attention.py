"""Pass: pair each decode attention with the gemv kernel right before it that computes its inputs.

The Q/K/V projection's kernel writes the queries and, through its fused cache writes, this step's
K and V rows; the attention launch after it reads exactly those (and the position). Codegen can
then run the attention's split inside that kernel (codegen/attention.py: fused_context), so the
split's cache rows stream in while the projection does, instead of after it.

Before: G.graph["schedule"] as `schedule` leaves it.
After: the same launches; each gemv launch followed by an attention launch whose query and both
cache inputs it computes carries "attention": that attention's node.
"""
from __future__ import annotations

import networkx as nx


def pair_attention(G: nx.DiGraph) -> nx.DiGraph:
    """Mark the gemv launches that feed the attention after them (see the module docstring)."""
    G = G.copy()
    schedule = [dict(launch) for launch in G.graph["schedule"]]
    for before, launch in zip(schedule, schedule[1:]):
        if before["family"] != "gemv" or launch["family"] != "attention":
            continue
        (node,) = launch["nodes"]
        q, kc, vc, _pos = G.nodes[node]["inputs"]
        if {q, kc, vc} <= set(before["nodes"]):
            before["attention"] = node
    G.graph["schedule"] = schedule
    return G

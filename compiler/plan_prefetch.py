"""Pass: which cache rows each attention launch asks L2 for, for the next layer's attention.

At long contexts a decode attention's first phase is its cache rows arriving from HBM (the 1B at
4k: 8.7 MB per layer, 3.3 of the split's 5 us), a short scattered read that an SM cannot pull
faster than ~44 GB/s. Once its own rows are in, HBM idles through the softmax, the merge and the
combine. The rows the next layer's attention will read are known then (the same positions of the
next layer's caches, all but the newest already written), so the attention asks L2 for them, and
the next attention finds them there (the rows are read twice as fast from L2).

Before: `G.graph["schedule"]` (see schedule.py).
After: every attention launch carries `prefetch`: the (K cache, V cache) of the next attention
launch in the schedule (the last layer's: the first layer's, for the next step, whose rows are
this step's and one more) when that one has the same KV heads and head size (its rows have the same
layout), else []. Code generation decides whether and how the kernels use it.
"""
from __future__ import annotations

import networkx as nx


def plan_prefetch(G: nx.DiGraph) -> nx.DiGraph:
    """Name the caches each attention launch prefetches (see the module docstring)."""
    G = G.copy()
    launches = [dict(launch, prefetch=[]) if launch["family"] == "attention" else launch
                for launch in G.graph["schedule"]]
    attentions = [launch for launch in launches if launch["family"] == "attention"]
    for this, following in zip(attentions, attentions[1:] + attentions[:1]):
        a, b = (G.nodes[launch["nodes"][0]] for launch in (this, following))
        if all(a["attrs"][k] == b["attrs"][k] for k in ("n_kv_heads", "head_dim")):
            this["prefetch"] = b["inputs"][1:3]
    G.graph["schedule"] = launches
    return G

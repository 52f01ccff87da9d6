"""The moe family: routed expert FFN in two launches (gate/up of the chosen experts, then down)."""
from __future__ import annotations

import networkx as nx

from . import cexpr
from .params import Params

THREADS = 256    # one row per warp
UNROLL = 4


def context(G: nx.DiGraph, launch: dict, params: Params) -> dict:
    """Template variables of one moe kernel pair."""
    (n,) = launch["nodes"]
    d = G.nodes[n]
    x, logits, w_gate, w_up, w_down = d["inputs"]
    E, I, D = G.nodes[w_gate]["shape"]
    top_k = d["attrs"]["top_k"]
    if E > 64:
        raise ValueError(f"{n}: the moe kernel routes at most 64 experts, got {E}")
    rows = THREADS // 32
    return {"E": E, "I": I, "D": D, "top_k": top_k, "threads": THREADS, "unroll": UNROLL,
            "x": params.ref(x), "logits": params.ref(logits), "w_gate": params.ref(w_gate),
            "w_up": params.ref(w_up), "w_down": params.ref(w_down), "out": params.ref(n, written=True),
            "ws": params.extra("float*", "workspace"),
            "act_expr": cexpr.elementwise_op(d["attrs"].get("act", "silu"), ["a"]),
            "grid_up": top_k * -(-I // rows), "grid_down": -(-D // rows), "workspace_floats": top_k * I}

"""The moe family: routed expert FFN in two launches (gate/up of the chosen experts, then down);
for steps of several tokens, GEMMs per expert over the step's tokens (templates/moe_gemm.cuh)."""
from __future__ import annotations

import networkx as nx

from . import cexpr, gemm
from .params import Params

THREADS = 256    # one row per warp
UNROLL = 4


def _shapes(G: nx.DiGraph, launch: dict) -> tuple[str, int, int, int]:
    """(node, experts E, intermediate size I, model width D) of a moe launch."""
    (n,) = launch["nodes"]
    E, I, D = G.nodes[G.nodes[n]["inputs"][2]]["shape"]
    return n, E, I, D


def unsupported(G: nx.DiGraph, launch: dict, tokens: int) -> str | None:
    """Why this moe kernel has no form for steps of `tokens` tokens, or None: its GEMMs' rows must
    be whole 32-weight spans, and their staged chunks and tiles fit the static shared memory."""
    _, _, I, D = _shapes(G, launch)
    if tokens > gemm.WARPS * 32:
        return f"{tokens} tokens per step need a thread each to route them; its blocks have {gemm.WARPS * 32}"
    for what, K, members in (("gate/up", D, 2), ("down", I, 1)):
        if K % 32:
            return f"its {what} rows of {K} weights are not a multiple of 32"
        if (need := gemm.smem_bytes(K, members, tokens) + 4 * tokens) > gemm.SMEM:   # + the routing weights
            return f"its {what} GEMMs at {tokens} tokens per step need {need} bytes of shared memory; at most {gemm.SMEM}"
    return None


def context(G: nx.DiGraph, launch: dict, params: Params, tokens: int = 1) -> dict:
    """Template variables of one moe kernel pair, for steps of `tokens` tokens."""
    n, E, I, D = _shapes(G, launch)
    d = G.nodes[n]
    x, logits, w_gate, w_up, w_down = d["inputs"]
    top_k = d["attrs"]["top_k"]
    if E > 64:
        raise ValueError(f"{n}: the moe kernel routes at most 64 experts, got {E}")
    ctx = {"E": E, "I": I, "D": D, "top_k": top_k, "tokens": tokens,
           "x": params.ref(x), "logits": params.ref(logits), "w_gate": params.ref(w_gate),
           "w_up": params.ref(w_up), "w_down": params.ref(w_down), "out": params.ref(n, written=True),
           "ws": params.extra("float*", "workspace"),
           "act_expr": cexpr.elementwise_op(d["attrs"].get("act", "silu"), ["a"])}
    if tokens == 1:
        rows = THREADS // 32
        return {**ctx, "threads": THREADS, "unroll": UNROLL, "grid_up": top_k * -(-I // rows),
                "grid_down": -(-D // rows), "workspace_floats": top_k * I}
    # [E][tokens][I] activations; every expert's tiles (those no token chose return at once)
    return {**ctx, "threads": gemm.WARPS * 32, "kc_up": gemm.chunk(D), "kc_down": gemm.chunk(I),
            "grid_up": E * -(-I // gemm.SLOTS), "grid_down": E * -(-D // gemm.SLOTS),
            "workspace_floats": E * tokens * I}

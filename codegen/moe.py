"""The moe family: routed expert FFN in two launches (gate/up of the chosen experts, then down);
for steps of several tokens, GEMMs per expert over the step's tokens (templates/moe_gemm.cuh)."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import ScheduledKernel
from . import cexpr, gemm
from .kernel import KernelSource, KernelSpec, Launch
from .params import Params
from .render import render
from .tuning import SMEM_STATIC, Tuning

THREADS = 256    # one row per warp
UNROLL = 4


def _shapes(G: nx.DiGraph, launch: ScheduledKernel) -> tuple[str, int, int, int]:
    """(node, experts E, intermediate size I, model width D) of a moe launch."""
    (n,) = launch.nodes
    E, I, D = G.nodes[G.nodes[n]["inputs"][2]]["shape"]
    return n, E, I, D


def unsupported(G: nx.DiGraph, launch: ScheduledKernel, tokens: int, tuning: Tuning) -> str | None:
    """Why this moe kernel has no form for steps of `tokens` tokens, or None: its GEMMs' rows must
    be whole 32-weight spans, and their staged chunks and tiles fit the static shared memory."""
    _, _, I, D = _shapes(G, launch)
    if tokens > tuning.gemm_warps * 32:
        return f"{tokens} tokens per step need a thread each to route them; its blocks have {tuning.gemm_warps * 32}"
    for what, K, members in (("gate/up", D, 2), ("down", I, 1)):
        if K % 32:
            return f"its {what} rows of {K} weights are not a multiple of 32"
        if (need := gemm.smem_bytes(K, members, tokens, tuning) + 4 * tokens) > SMEM_STATIC:   # + the routing weights
            return f"its {what} GEMMs at {tokens} tokens per step need {need} bytes of shared memory; at most {SMEM_STATIC}"
    return None


def generate(spec: KernelSpec) -> KernelSource:
    """One moe kernel pair (_up, _down) for steps of spec.tokens tokens; its activations go
    through the runtime's "workspace" (`workspace_floats`)."""
    G, launch, tokens, tuning = spec.G, spec.launch, spec.tokens, spec.tuning
    params = Params(G)
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
        ctx |= {"threads": THREADS, "unroll": UNROLL, "grid_up": top_k * -(-I // rows), "grid_down": -(-D // rows)}
        workspace = top_k * I
    else:   # [E][tokens][I] activations; every expert's tiles (those no token chose return at once)
        ctx |= {"threads": tuning.gemm_warps * 32, "kc_up": gemm.chunk(D), "kc_down": gemm.chunk(I),
                "grid_up": E * -(-I // gemm.slots(tuning)), "grid_down": E * -(-D // gemm.slots(tuning))}
        workspace = E * tokens * I
    name, source = render("moe.cu.j2", "moe", f"e{E}_top{top_k}_d{D}_i{I}", params=params.decls, **ctx)
    launches = [Launch(f"{name}_up", (ctx["grid_up"], 1), ctx["threads"], params.values),
                Launch(f"{name}_down", (ctx["grid_down"], 1), ctx["threads"], params.values)]
    return KernelSource(name, "moe", source, launch.nodes, launches, launch.layer, workspace_floats=workspace)

"""The moe family: routed expert FFN in two launches (gate/up of the chosen experts, then down);
for steps of several tokens, a launch that routes the step's tokens, GEMMs per expert over the
tokens that chose it (templates/moe_gemm.cuh) and a launch that sums each token's weighted expert
outputs in a fixed order.
A norm prologue (compiler/fuse_prologue.py) is applied by the gate/up kernel to the vector it
reads, as the gemv family's is; an elementwise epilogue (the residual add) runs where each output
row is finished: in _down for one token, in _sum for a step.
The experts' stacks may be quantized (one format for gate and up, one for down): a token's GEMVs
then read the vector staged once per block in int16 groups (integer formats, where every chosen
expert's vector fits shared memory) or take the float path of templates/quant.cuh, the step's
GEMMs the quantized tiles."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import ScheduledKernel, moe_parts
from ..dsl import get
from ..errors import FuselmError
from . import cexpr, gemm
from .gemv import row_operand, staged_bytes, weight_format
from .kernel import KernelSource, KernelSpec, Launch
from .params import Params
from .render import render
from .tuning import SMEM_STATIC, Tuning

THREADS = 256    # one row per warp
MAX_EXPERTS = 512   # decode routing keeps E / 32 logits a lane in registers (templates/moe.cuh)
UNROLL = 4
# Tokens an expert's prefill GEMMs take at a time (more pass again over the tile's weights): at
# 64, ptxas spills 332 bytes in the Q4_K gate/up kernel.
PASS_TOKENS = 64
QUANT_PASS_TOKENS = 32


def _shapes(G: nx.DiGraph, launch: ScheduledKernel) -> tuple[str, int, int, int]:
    """(moe node, experts E, intermediate size I, model width D) of a moe launch."""
    _, n, _ = moe_parts(G, launch.nodes)
    E, I, D = G.nodes[G.nodes[n]["inputs"][2]]["shape"]
    return n, E, I, D


def pass_tokens(tokens: int, quantized: bool) -> int:
    """How many of a step's tokens an expert's prefill GEMMs take at a time (their tile's columns):
    the step's, up to PASS_TOKENS (QUANT_PASS_TOKENS for quantized experts)."""
    return min(tokens, QUANT_PASS_TOKENS if quantized else PASS_TOKENS)


def unsupported(G: nx.DiGraph, launch: ScheduledKernel, tokens: int, tuning: Tuning, target=None) -> str | None:
    """Why this moe kernel has no form for steps of `tokens` tokens, or None: its GEMMs' rows must
    be whole 32-weight spans, and their staged chunks and tiles fit the static shared memory (on
    any `target`: the moe tiles are mma.sync's)."""
    n, _, I, D = _shapes(G, launch)
    up_format, down_format = (f is not None for f in _formats(G, n))
    width = pass_tokens(tokens, up_format or down_format)
    threads = tuning.gemm_warps * 32
    scan = 4 * -(-tokens * G.nodes[n]["attrs"]["top_k"] // threads) * tuning.gemm_warps   # entries_routed_to's counts
    for what, K, members, grouped in (("gate/up", D, 2, up_format), ("down", I, 1, down_format)):
        if K % 32:
            return f"its {what} rows of {K} weights are not a multiple of 32"
        need = gemm.smem_bytes(K, members, width, tuning, grouped) + 8 * tokens + scan   # + the entries, tokens
        if need > SMEM_STATIC:
            return (f"its {what} GEMMs at {tokens} tokens per step ({width} at a time) need {need} bytes of "
                    f"shared memory; at most {SMEM_STATIC}")
    return None


def _formats(G: nx.DiGraph, n: str) -> tuple[str | None, str | None]:
    """The C++ structs of the formats of moe node n's gate/up and down stacks (None: bf16); a
    FuselmError naming them when gate and up differ (one tile reads one format)."""
    _, _, w_gate, w_up, w_down = G.nodes[n]["inputs"][:5]
    gate, up, down = (weight_format(G, w) for w in (w_gate, w_up, w_down))
    if gate.name != up.name:
        raise FuselmError(f"the experts' gate and up ({w_gate}, {w_up}) are in formats {gate.name} and "
                          f"{up.name}: the moe kernels read them in one")
    return tuple(None if f.name == "bf16" else f.c_struct for f in (gate, down))


def _glu(attrs: dict) -> str:
    """The C expression of an expert's product of gate `a` and up `b`: act(a) * b, or gpt-oss's
    clamped SwiGLU where `swiglu_limit` is set (templates/moe.cuh: clamped_swiglu)."""
    if limit := attrs.get("swiglu_limit"):
        return (f"clamped_swiglu(a, b, {cexpr.float_literal(limit)}, "
                f"{cexpr.float_literal(attrs.get('swiglu_alpha', 1.0))})")
    return f"{cexpr.elementwise_op(attrs.get('act', 'silu'), ['a'])} * b"


def _prologue(G: nx.DiGraph, launch: ScheduledKernel, params: Params) -> dict | None:
    """The norm prologue's gain, eps and offset (C), or None."""
    prologue, _, _ = moe_parts(G, launch.nodes)
    if prologue is None:
        return None
    a = G.nodes[prologue]["attrs"]
    return {"weight": params.ref(G.nodes[prologue]["inputs"][1]), "eps": cexpr.float_literal(a["eps"]),
            "offset": cexpr.float_literal(a.get("offset", 0.0))}


def _epilogue(G: nx.DiGraph, launch: ScheduledKernel, params: Params) -> str:
    """A C lambda (t, row, m) run once for each finished output element m = moe[t][row]: the
    epilogue's ops on it, then the stores of every value that other kernels read."""
    _, n, epilogue = moe_parts(G, launch.nodes)
    var, body = {n: "m"}, []
    for i, e in enumerate(epilogue):
        ops = [var.get(v) or row_operand(G, v, params, batched=True) for v in G.nodes[e]["inputs"]]
        body.append(f"const float v{i} = {cexpr.elementwise(G, e, ops)};")
        var[e] = f"v{i}"
    D = G.nodes[n]["shape"][-1]
    body += [f"{params.ref(v, written=True)}[t * {D} + row] = {var[v]};" for v in launch.writes
             if v in var and get(G.nodes[v]["op"]).inplace_of is None]
    return "[=](int t, int row, float m) {\n        " + "\n        ".join(body) + "\n    }"


def generate(spec: KernelSpec) -> KernelSource:
    """The moe kernels (_up, _down; _route and _sum for steps of several tokens) for steps of spec.tokens
    tokens; their activations go through the runtime's "workspace" (`workspace_floats`)."""
    G, launch, tokens, tuning = spec.G, spec.launch, spec.tokens, spec.tuning
    params = Params(G)
    n, E, I, D = _shapes(G, launch)
    d = G.nodes[n]
    prologue = _prologue(G, launch, params)
    x, logits, w_gate, w_up, w_down = d["inputs"][:5]
    if prologue:               # the norm's input: the moe kernel normalises it itself
        x = G.nodes[x]["inputs"][0]
    biases = d["inputs"][5:]                     # gate, up [E, I] and down [E, D] (gpt-oss), or none
    top_k = d["attrs"]["top_k"]
    if E > MAX_EXPERTS:
        raise ValueError(f"{n}: the moe kernel routes at most {MAX_EXPERTS} experts, got {E}")
    up_format, down_format = _formats(G, n)
    norm = "true" if d["attrs"].get("norm_topk", True) else "false"
    ctx = {"E": E, "I": I, "D": D, "top_k": top_k, "norm": norm, "tokens": tokens,
           "up_format": up_format, "down_format": down_format, "quant_unroll": tuning.gemv_quant_unroll,
           "up_bytes": weight_format(G, w_gate).nbytes((I, D)), "down_bytes": weight_format(G, w_down).nbytes((D, I)),
           "x": params.ref(x), "logits": params.ref(logits), "w_gate": params.ref(w_gate),
           "w_up": params.ref(w_up), "w_down": params.ref(w_down), "prologue": prologue,
           "epilogue": _epilogue(G, launch, params),
           "ws": params.extra("float*", "workspace"),
           "glu": _glu(d["attrs"]), "biases": [params.ref(b) for b in biases]}
    if tokens == 1:
        rows = THREADS // 32
        integer = [weight_format(G, w).integer_codes for w in (w_gate, w_down)]
        ctx |= {"threads": THREADS, "unroll": UNROLL, "grid_up": top_k * -(-I // rows), "grid_down": -(-D // rows),
                "up_staged": integer[0] and staged_bytes(D) + 1024 <= SMEM_STATIC,
                "down_staged": integer[1] and top_k * staged_bytes(I) + 1024 <= SMEM_STATIC}
        workspace = top_k * I
    else:   # the routes' experts and weights [tokens top_k], then act [tokens top_k][I] and the
        # weighted products [tokens top_k][D]; every expert's tiles (those no token chose return at once)
        threads = tuning.gemm_warps * 32
        ctx |= {"threads": threads, "kc_up": gemm.chunk(D), "kc_down": gemm.chunk(I),
                "pass_tokens": pass_tokens(tokens, bool(up_format or down_format)),
                "grid_route": -(-tokens // (threads // 32)),
                "grid_up": E * -(-I // gemm.slots(tuning)), "grid_down": E * -(-D // gemm.slots(tuning)),
                "grid_sum": -(-tokens * D // threads)}
        workspace = tokens * top_k * (2 + I + D)
    formats = "" if not (up_format or down_format) else f"_{(up_format or 'bf16').lower()}+{(down_format or 'bf16').lower()}"
    weights = "" if norm == "true" else "_probs"   # top-k probabilities not renormalised
    shape = ("norm_" if prologue else "") + f"e{E}_top{top_k}{weights}_d{D}_i{I}{formats}"
    name, source = render("moe.cu.j2", "moe", shape, params=params.decls, **ctx)
    launches = [Launch(f"{name}_{part}", (ctx[f"grid_{part}"], 1), ctx["threads"], params.values)
                for part in ("route", "up", "down", "sum") if f"grid_{part}" in ctx]
    return KernelSource(name, "moe", source, launch.nodes, launches, launch.layer, workspace_floats=workspace)

"""The rowwise family: one block per token row runs the kernel's ops one after another.

Ops whose value other positions of the row need (norms, RoPE, reductions) or that other kernels
read are stored (see compiler.kernels.materialized); pure elementwise chains are inlined into the
expression of their consumer. Each non-elementwise op has a phase emitter in PHASES.
"""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import materialized
from ..dsl import Kind
from ..errors import FuselmError
from ..quant.formats import format_of
from . import cexpr
from .kernel import KernelSource, KernelSpec, Launch
from .kv_cache import cache_row, layout_of
from .params import Params
from .render import render



def generate(spec: KernelSpec) -> KernelSource:
    """One row-wise kernel: a block per token row, a code phase per stored op. It releases the
    next kernel at its start (grid_release): its one block takes no SM slot the next kernel's
    would need, and the GEMV after it starts its weight stream sooner (measured: 4k context 1-2%
    faster)."""
    G, launch = spec.G, spec.launch
    params = Params(G)
    nodes = launch.nodes
    code = phases(G, nodes, params, set(materialized(G, nodes)) | set(launch.writes))
    # the widest row this block walks: an op's output or its first operand (argmax outputs [T];
    # ops on per-token scalars [T] walk one element)
    width = max((s[-1] for n in nodes for s in (G.nodes[n]["shape"], G.nodes[G.nodes[n]["inputs"][0]]["shape"])
                 if s and isinstance(s[-1], int)), default=1)
    # One block per token row: at decode time a single block, so its latency is the kernel's;
    # more threads mean shorter chains of dependent loads per thread.
    threads = min(1024, max(256, width // 4 // 32 * 32))
    name, source = render("rowwise.cu.j2", "rowwise", f"{len(code)}ops", params=params.decls, phases=code,
                          threads=threads, quantized=quantized(G, nodes))
    return KernelSource(name, "rowwise", source, nodes, [Launch(name, ("T", 1), threads, params.values)], launch.layer)


def quantized(G: nx.DiGraph, nodes: list[str]) -> bool:
    """Whether any of the ops reads a quantized weight (an embedding table)."""
    return any(G.nodes[i].get("format", "bf16") != "bf16" for n in nodes for i in G.nodes[n]["inputs"])


def phases(G: nx.DiGraph, nodes: list[str], params: Params, stored: set[str],
           through_l2: frozenset[str] = frozenset()) -> list[str]:
    """The C code of row-wise ops `nodes` on token t's row, one phase per op that is `stored`
    (the block puts a barrier between phases); elementwise ops not stored are inlined into their
    readers. Values in `through_l2` were written by other blocks of this kernel (a gemv kernel's
    tail reads its GEMVs' results): they are loaded through L2, which L1 does not keep coherent
    with other SMs' writes."""
    inside = set(nodes)

    def at(v: str, i: str = "i") -> str:
        """C expression for element i of value v in this token's row."""
        d = G.nodes[v]
        if v in inside and v not in stored:
            return cexpr.elementwise(G, v, [at(o, i) for o in d["inputs"]])
        p = params.ref(v)
        if len(d["shape"]) == 0:
            return f"{p}[0]"
        if len(d["shape"]) == 1:
            return f"w2f({p}[{i}])" if d["op"] == "weight" else f"{p}[{i}]"
        if v in through_l2:
            return f"__ldcg({p} + t * {d['shape'][-1]} + {i})"
        return f"{p}[t * {d['shape'][-1]} + {i}]"

    def row(v: str) -> str:
        start = f"{params.ref(v)} + t * {G.nodes[v]['shape'][-1]}"
        return f"RowFromL2{{{start}}}" if v in through_l2 else start

    out = []
    for n in nodes:
        d = G.nodes[n]
        if n not in stored and d["kind"] is Kind.ELEMENTWISE:
            continue
        emit = PHASES.get(d["op"], _elementwise)       # elementwise ops have no entry
        out.append(f"// {d['op']}\n" + emit(G, n, params, at, row))
    return out


def _loop(width, stmt: str) -> str:
    return f"for (int i = threadIdx.x; i < {width}; i += blockDim.x) {stmt}"


def _elementwise(G, n, params, at, row):
    d = G.nodes[n]
    expr = cexpr.elementwise(G, n, [at(o) for o in d["inputs"]])
    return _loop(d["shape"][-1], f"{params.ref(n, written=True)}[t * {d['shape'][-1]} + i] = {expr};")


def _embedding(G, n, params, at, row):
    table, ids = G.nodes[n]["inputs"]
    V, D = G.nodes[table]["shape"]
    fmt = format_of(G.nodes[table].get("format", "bf16"))
    out = params.ref(n, written=True)
    value = (f"w2f({params.ref(table)}[(size_t){params.ref(ids)}[t] * {D} + i])" if fmt.name == "bf16" else
             f"{fmt.c_struct}::at({params.ref(table)}, {V}, {D}, {params.ref(ids)}[t], i)")
    return _loop(D, f"{out}[t * {D} + i] = {value};")


def _rmsnorm(G, n, params, at, row):
    d = G.nodes[n]
    x, w = d["inputs"]
    width = d["shape"][-1]
    group = d["attrs"].get("group") or width
    out = f"{params.ref(n, written=True)} + t * {width}"
    return (f"rmsnorm_row({row(x)}, {params.ref(w)}, {out}, {width}, {group}, "
            f"{cexpr.float_literal(d['attrs']['eps'])}, {cexpr.float_literal(d['attrs'].get('offset', 0.0))});")


def _rope(G, n, params, at, row):
    d = G.nodes[n]
    x, pos, inv_freq = d["inputs"]
    width = d["shape"][-1]
    out = f"{params.ref(n, written=True)} + t * {width}"
    pairs = G.nodes[inv_freq]["shape"][0]
    return (f"rope_row({row(x)}, {out}, {width}, {d['attrs']['head_dim']}, {pairs}, "
            f"{str(bool(d['attrs'].get('interleaved'))).lower()}, {params.ref(pos)}[t], {params.ref(inv_freq)});")


def _kv_write(G, n, params, at, row):
    cache, x, pos = G.nodes[n]["inputs"][:3]
    width = G.nodes[n]["shape"][-1]
    lay = layout_of(G, n)
    if lay.fp8:   # the block holds the whole row: a warp per KV head writes it (kv_fp8_head)
        dst = f"{params.ref(cache, written=True)} + (size_t){cache_row(G, n, params, 't')} * {lay.stride}"
        return (f"for (int h = threadIdx.x >> 5; h < {lay.kv_heads}; h += blockDim.x >> 5) {{\n"
                f"    unsigned char* dst = {dst};\n"
                f"    kv_fp8_head<{lay.head_dim}>(dst + h * {lay.head_dim}, reinterpret_cast<float*>(dst + {lay.scale_at}) + h,\n"
                f"        [&](int d) {{ const int i = h * {lay.head_dim} + d; return (float)({at(x)}); }});\n}}")
    return _loop(width, f"{params.ref(cache, written=True)}[(size_t){cache_row(G, n, params, 't')} * {width} + i] = "
                        f"f32_to_bf16({at(x)});")


def _softmax(G, n, params, at, row):
    (x,) = G.nodes[n]["inputs"]
    width = G.nodes[n]["shape"][-1]
    return f"softmax_row({row(x)}, {params.ref(n, written=True)} + t * {width}, {width});"


def _argmax(G, n, params, at, row):
    (x,) = G.nodes[n]["inputs"]
    return (f"{{ const int best = block_argmax({row(x)}, {G.nodes[x]['shape'][-1]}); "
            f"if (threadIdx.x == 0) {params.ref(n, written=True)}[t] = best; }}")


PHASES = {"embedding": _embedding, "rmsnorm": _rmsnorm, "rope": _rope, "kv_write": _kv_write, "paged_kv_write": _kv_write,
          "softmax": _softmax, "argmax": _argmax}

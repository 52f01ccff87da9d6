"""The gemv family: norm prologue -> GEMVs side by side -> epilogue on each block's tile of rows."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import gemv_parts, zip_sets
from ..dsl import Kind, get
from . import cexpr
from .knobs import SMS, env_int
from .params import Params

WARPS = env_int("FUSELM_GEMV_WARPS", 8, 1, 32)   # per block: 1, 2, 4, 8, 16 or 32
ROWS_PER_WARP = env_int("FUSELM_GEMV_ROWS", 2, 1, 8)  # rows a warp streams at once, sharing each load of the vector
# Streaming warps a GEMV should have before split-K stops: 16 per SM keep HBM busy; 32 split more
# than needed (measured: Llama-3.1-8B 249 -> 252, 3.2-1B 1248 -> 1277 tok/s).
MIN_WARPS = env_int("FUSELM_GEMV_MIN_WARPS", SMS * 16, 1, 1 << 20)
# 1: epilogue operands that earlier kernels wrote are loaded before the wait (plan_early_reads); 0: where used.
EARLY_READS = env_int("FUSELM_GEMV_EARLY_READS", 1, 0, 1)
UNROLL = env_int("FUSELM_GEMV_UNROLL", 4, 1, 16)      # 16-byte loads in flight per lane and row


if WARPS not in (1, 2, 4, 8, 16, 32):
    raise ValueError(f"FUSELM_GEMV_WARPS={WARPS}: warps per GEMV block must be a power of 2 from 1 to 32")


def _slots(ksplit: int, members: int, pairs: bool) -> int:
    """Rows per member in one block's tile: each group of `ksplit` warps takes ROWS_PER_WARP rows."""
    r = max(1, WARPS // ksplit * ROWS_PER_WARP // members)
    return max(2, r + (r & 1)) if pairs else r


def _tiles(width: int, R: int, pairs: bool) -> int:
    return -(-width // R) if not pairs else -(-(width // 2) // (R // 2))


def _ksplit(sets: list[dict], K: int) -> int:
    """Warps per output row (split-K inside the block). Short outputs with long rows (a 2048-row
    O or down projection) give too few rows for one warp each to fill the GPU with loads in
    flight, so several warps share a row, each streaming a slice of it."""
    rows = sum(z["width"] * len(z["linears"]) for z in sets)
    ksplit = 1
    while (rows // ROWS_PER_WARP * ksplit < MIN_WARPS and ksplit < min(4, WARPS)
           and K % (2 * ksplit * 8) == 0 and K // (2 * ksplit) >= 256):
        ksplit *= 2
    return ksplit


def context(G: nx.DiGraph, launch: dict, params: Params) -> dict:
    """Template variables of one gemv kernel: prologue, zip sets with their tiles and epilogues."""
    vec = input_vector(G, launch, params)
    ksplit = _ksplit(zip_sets(G, launch["nodes"]), vec["K"])
    zips, grid = zip_contexts(G, launch, params, lambda members, pairs: _slots(ksplit, members, pairs))
    return {**vec, "zips": zips, "threads": WARPS * 32, "unroll": UNROLL, "ksplit": ksplit,
            "rows_per_warp": ROWS_PER_WARP,
            "max_tile": max(z["R"] * len(z["members"]) for z in zips), "grid": grid}


def input_vector(G: nx.DiGraph, launch: dict, params: Params) -> dict:
    """The vector a gemv kernel's linears read: `x` (its C name), its width `K`, and the norm
    `prologue` that produces it from x inside the kernel (weight, eps, offset) or None."""
    prologue, linears, _ = gemv_parts(G, launch["nodes"])
    x_value = G.nodes[prologue]["inputs"][0] if prologue else G.nodes[linears[0]]["inputs"][0]
    x = params.ref(x_value)
    pro = None
    if prologue:
        a = G.nodes[prologue]["attrs"]
        pro = {"weight": params.ref(G.nodes[prologue]["inputs"][1]), "eps": cexpr.float_literal(a["eps"]),
               "offset": cexpr.float_literal(a.get("offset", 0.0))}
    return {"x": x, "K": G.nodes[x_value]["shape"][-1], "prologue": pro}


def zip_contexts(G: nx.DiGraph, launch: dict, params: Params, slots, batched: bool = False) -> tuple[list[dict], int]:
    """Template variables of each zip set of a gemv kernel's nodes, whose tiles hold
    `slots(members, pairs)` rows of each member, and the grid: one block per tile, zip after zip."""
    nodes = launch["nodes"]
    _, _, epilogue = gemv_parts(G, nodes)
    zips, start = [], 0
    for z in zip_sets(G, nodes):
        hd, interleaved = z["pairs"] or (0, False)
        R = slots(len(z["linears"]), bool(hd))
        tiles = _tiles(z["width"], R, bool(hd))
        z_epi = [n for n in epilogue if _zip_of(G, n, z["linears"], set(nodes))]
        preload: list[str] = []
        zips.append({"N": z["width"], "R": R, "hd": hd, "interleaved": str(interleaved).lower(),
                     "start": start, "end": start + tiles,
                     "members": [params.ref(G.nodes[l]["inputs"][1]) for l in z["linears"]],
                     "epilogue": _epilogue(G, launch, z["linears"], z_epi, R, params, batched, preload),
                     "preload": "\n".join(preload)})
        start += tiles
    return zips, start


def _zip_of(G, node, linears, inside) -> bool:
    """Whether epilogue `node` descends (inside the kernel) from one of `linears`."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n in linears:
            return True
        stack += [i for i in G.nodes[n]["inputs"] if i in inside]
    return False


def _epilogue(G, launch, linears, epilogue, R, params, batched: bool = False, preload: list[str] | None = None) -> str:
    """C statements run by thread `s` < R for its slot `row`: every epilogue op, then the writes.
    `batched` (the gemm family, tokens > 1): for token `t` of the step, whose dot products
    tile_out holds as [member][slot][token] (TT tokens) and whose partner slot s ^ 1 sits in the
    neighbouring thread. Otherwise the row operands the launch may read before its wait
    (launch["early"], compiler/plan_early_reads.py) are loaded by declarations appended to
    `preload`, which the template places before the dot products."""
    def tile(i, slot):
        return f"tile_out[({i} * R + {slot}) * TT + t]" if batched else f"slices_sum(tile_out, {i} * R + {slot})"

    token = "t" if batched else "0"
    var = {l: f"({tile(i, 's')} * pscale)" for i, l in enumerate(linears)}
    partner = {l: f"({tile(i, '(s ^ 1)')} * pscale)" for i, l in enumerate(linears)}
    decls, body = [], []
    inside = set(launch["nodes"])
    for n in epilogue:
        d = G.nodes[n]
        kind = d["kind"]
        v = f"v{len(decls)}"
        if kind is Kind.CACHE_WRITE:
            cache, src, pos = d["inputs"]
            width = d["shape"][-1]
            at = _ahead(f"{params.ref(pos)}[{token}]", [pos], "int", f"__ldcg({params.ref(pos)})", launch, preload,
                        batched)
            body.append(f"if (active) {params.ref(cache, written=True)}[(size_t){at} * "
                        f"{width} + row] = f32_to_bf16({var[src]});")
            continue
        decls.append(f"float {v} = 0.0f;")
        if kind is Kind.ELEMENTWISE:
            ops = [var[i] if i in inside else _preloaded(G, i, params, launch, preload) if not batched
                   else _external(G, i, params, batched) for i in d["inputs"]]
            body.append(f"if (active) {v} = {cexpr.elementwise(G, n, ops)};")
        elif kind is Kind.ROW_LOCAL:   # RoPE: the only row-local op; its pair is in slot s ^ 1
            src, pos, inv_freq = d["inputs"]
            if src not in partner:     # an epilogue value: share it through shared memory first
                me = "threadIdx.x" if batched else "s"   # batched: slot s ^ 1 is thread ^ 1's
                size = "THREADS" if batched else "R"
                body += [f"__shared__ float t{v}[{size}];", f"if (active) t{v}[{me}] = {var[src]};", "__syncthreads();"]
                partner[src] = f"t{v}[{me} ^ 1]"
            angle = _ahead(f"(float){params.ref(pos)}[{token}] * {params.ref(inv_freq)}[pair]", [pos, inv_freq],
                           "float", f"(float)__ldcg({params.ref(pos)}) * {params.ref(inv_freq)}[pair]", launch,
                           preload, batched)
            body.append(f"if (active) {v} = rope_rotate({var[src]}, {partner[src]}, s & 1, {angle});")
        var[n] = v
    for n in launch["writes"]:
        if n in var and get(G.nodes[n]["op"]).inplace_of is None:
            at = f"t * {G.nodes[n]['shape'][-1]} + row" if batched else "row"
            body.append(f"if (active) {params.ref(n, written=True)}[{at}] = {var[n]};")
    return "\n".join("        " + line for line in decls + body)


def _ahead(expr: str, values: list[str], ctype: str, early_expr: str, launch, preload: list[str] | None,
           batched: bool) -> str:
    """`expr`, or where the launch may read all of `values` before its wait (launch["early"]), a
    register that a declaration appended to `preload` computes ahead as `early_expr`, whose loads
    of earlier kernels' values go through L2 (`__ldcg`: L1 is not kept coherent with other SMs'
    writes)."""
    if batched or not EARLY_READS or preload is None or not set(values) <= set(launch.get("early", ())):
        return expr
    name = f"e{len(preload)}"
    preload.append(f"        const {ctype} {name} = active ? {early_expr} : 0;")
    return name


def _preloaded(G, value, params, launch, preload: list[str] | None) -> str:
    """An external operand of a GEMV's epilogue with an element per row, loaded ahead where the
    launch may (see _ahead); a scalar is read where it is used."""
    if not G.nodes[value]["shape"]:
        return _external(G, value, params)
    p = params.ref(value)
    early = f"w2f({p}[row])" if G.nodes[value]["op"] == "weight" else f"__ldcg({p} + row)"
    return _ahead(_external(G, value, params), [value], "float", early, launch, preload, False)


def _external(G, value, params, batched: bool = False) -> str:
    """An operand computed by an earlier kernel (or a weight): its element for this row (and
    token t of the step, where `batched` and it has a token dimension)."""
    d = G.nodes[value]
    p = params.ref(value)
    if len(d["shape"]) == 0:
        return f"{p}[0]"
    if d["op"] == "weight":
        return f"w2f({p}[row])"
    return f"{p}[t * {d['shape'][-1]} + row]" if batched and d["shape"][0] == "T" else f"{p}[row]"

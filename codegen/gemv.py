"""The gemv family: norm prologue -> GEMVs side by side -> epilogue on each block's tile of rows."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import gemv_parts, zip_sets
from ..dsl import Kind, get
from . import cexpr
from .knobs import env_int
from .params import Params

WARPS = env_int("FUSELM_GEMV_WARPS", 8, 1, 32)   # per block: 1, 2, 4, 8, 16 or 32
ROWS_PER_WARP = env_int("FUSELM_GEMV_ROWS", 2, 1, 8)  # rows a warp streams at once, sharing each load of the vector
# Streaming warps a GEMV should have before split-K stops: 16 per SM (132 on the H200) keep HBM
# busy; 32 split more than needed (measured: Llama-3.1-8B 249 -> 252, 3.2-1B 1248 -> 1277 tok/s).
MIN_WARPS = env_int("FUSELM_GEMV_MIN_WARPS", 132 * 16, 1, 1 << 20)
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
    nodes = launch["nodes"]
    prologue, linears, epilogue = gemv_parts(G, nodes)
    x_value = G.nodes[prologue]["inputs"][0] if prologue else G.nodes[linears[0]]["inputs"][0]
    x = params.ref(x_value)
    K = G.nodes[x_value]["shape"][-1]
    pro = None
    if prologue:
        a = G.nodes[prologue]["attrs"]
        pro = {"weight": params.ref(G.nodes[prologue]["inputs"][1]), "eps": cexpr.float_literal(a["eps"]),
               "offset": cexpr.float_literal(a.get("offset", 0.0))}
    zips, start, max_tile = [], 0, 0
    sets = zip_sets(G, nodes)
    ksplit = _ksplit(sets, K)
    for z in sets:
        hd, interleaved = z["pairs"] or (0, False)
        R = _slots(ksplit, len(z["linears"]), bool(hd))
        tiles = _tiles(z["width"], R, bool(hd))
        z_epi = [n for n in epilogue if _zip_of(G, n, z["linears"], set(nodes))]
        zips.append({"N": z["width"], "R": R, "hd": hd, "interleaved": str(interleaved).lower(),
                     "start": start, "end": start + tiles,
                     "members": [params.ref(G.nodes[l]["inputs"][1]) for l in z["linears"]],
                     "epilogue": _epilogue(G, launch, z["linears"], z_epi, R, params)})
        start += tiles
        max_tile = max(max_tile, R * len(z["linears"]))
    return {"K": K, "x": x, "prologue": pro, "zips": zips, "threads": WARPS * 32, "unroll": UNROLL, "ksplit": ksplit,
            "rows_per_warp": ROWS_PER_WARP,
            "max_tile": max_tile, "grid": start}


def _zip_of(G, node, linears, inside) -> bool:
    """Whether epilogue `node` descends (inside the kernel) from one of `linears`."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n in linears:
            return True
        stack += [i for i in G.nodes[n]["inputs"] if i in inside]
    return False


def _epilogue(G, launch, linears, epilogue, R, params) -> str:
    """C statements run by thread `s` < R for its slot `row`: every epilogue op, then the writes."""
    var = {l: f"(tile_out[{i} * R + s] * pscale)" for i, l in enumerate(linears)}
    partner = {l: f"(tile_out[{i} * R + (s ^ 1)] * pscale)" for i, l in enumerate(linears)}
    decls, body = [], []
    inside = set(launch["nodes"])
    for n in epilogue:
        d = G.nodes[n]
        kind = d["kind"]
        v = f"v{len(decls)}"
        if kind is Kind.CACHE_WRITE:
            cache, src, pos = d["inputs"]
            width = d["shape"][-1]
            body.append(f"if (active) {params.ref(cache, written=True)}[(size_t){params.ref(pos)}[0] * "
                        f"{width} + row] = f32_to_bf16({var[src]});")
            continue
        decls.append(f"float {v} = 0.0f;")
        if kind is Kind.ELEMENTWISE:
            ops = [var[i] if i in inside else _external(G, i, params) for i in d["inputs"]]
            body.append(f"if (active) {v} = {cexpr.elementwise(G, n, ops)};")
        elif kind is Kind.ROW_LOCAL:   # RoPE: the only row-local op; its pair is in slot s ^ 1
            src, pos, inv_freq = d["inputs"]
            if src not in partner:     # an epilogue value: share it through shared memory first
                body += [f"__shared__ float t{v}[R];", f"if (active) t{v}[s] = {var[src]};", "__syncthreads();"]
                partner[src] = f"t{v}[s ^ 1]"
            angle = f"(float){params.ref(pos)}[0] * {params.ref(inv_freq)}[pair]"
            body.append(f"if (active) {v} = rope_rotate({var[src]}, {partner[src]}, s & 1, {angle});")
        var[n] = v
    for n in launch["writes"]:
        if n in var and get(G.nodes[n]["op"]).inplace_of is None:
            body.append(f"if (active) {params.ref(n, written=True)}[row] = {var[n]};")
    return "\n".join("        " + line for line in decls + body)


def _external(G, value, params) -> str:
    """An operand computed by an earlier kernel (or a weight): its element for this row."""
    d = G.nodes[value]
    p = params.ref(value)
    if len(d["shape"]) == 0:
        return f"{p}[0]"
    return f"w2f({p}[row])" if d["op"] == "weight" else f"{p}[row]"

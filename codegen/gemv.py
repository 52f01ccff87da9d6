"""The gemv family: norm prologue -> GEMVs side by side -> epilogue on each block's tile of rows."""
from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from ..compiler.kernels import ScheduledKernel, ZipSet, gemv_parts, split_tail, stored_rows, zip_sets
from ..dsl import Kind, get
from ..errors import FuselmError
from ..quant.formats import Format, format_of
from . import cexpr, rowwise
from .kernel import KernelSource, KernelSpec, Launch
from .kv_cache import cache_row, fixed_table, layout_of, staging
from .params import Params
from .render import render
from .tuning import SMEM_STATIC, Target, Tuning


@dataclass
class FormatGroup:
    """The members of a zip set whose weights share a format: the C++ struct that reads it
    (templates/quant.cuh; None for bf16), a row handle's type and the weight pointer type."""
    c_struct: str | None
    members: list[int]        # indices into ZipTile.members

    @property
    def row_type(self) -> str:
        return f"typename {self.c_struct}::Row" if self.c_struct else "const weight_t*"

    @property
    def pointer(self) -> str:
        return "unsigned char*" if self.c_struct else "weight_t*"


def weight_format(G: nx.DiGraph, weight: str) -> Format:
    """The format a weight is held in (compiler/assign_formats.py; bf16 unless assigned)."""
    return format_of(G.nodes[weight].get("format", "bf16"))


def format_groups(G: nx.DiGraph, linears: list[str]) -> list[FormatGroup]:
    """`linears` grouped by their weights' format, in order of first appearance."""
    groups: dict[str, FormatGroup] = {}
    for i, l in enumerate(linears):
        f = weight_format(G, G.nodes[l]["inputs"][1])
        groups.setdefault(f.name, FormatGroup(None if f.name == "bf16" else f.c_struct, [])).members.append(i)
    return list(groups.values())


@dataclass
class ZipTile:
    """A zip set as the template lays it out: blocks start .. end - 1 take its tiles of R rows of
    each member (N rows in all); `hd` and `interleaved` say how RoPE pairs a tile's slots."""
    N: int
    R: int
    hd: int
    interleaved: str          # "true" / "false", as C++
    start: int
    end: int
    members: list[str]        # the C names of its weight matrices
    epilogue: str             # C statements of its epilogue (see _epilogue)
    preload: str              # declarations loading epilogue operands before the wait
    groups: list[FormatGroup] # its members by weight format
    exchanges: int = 0        # the epilogue's shared arrays of a float per thread (RoPE of an epilogue value)
    loads: tuple = ()         # batched: (C type, array, expression) of each operand loaded ahead (_round_load)

    @property
    def formats(self) -> str:
        """The formats of its weights in a kernel name: "" for bf16, else e.g. "q4_k" or "q4_k+q6_k"."""
        names = [g.c_struct.lower() if g.c_struct else "bf16" for g in self.groups]
        return "" if names == ["bf16"] else "+".join(names)


def generate(spec: KernelSpec) -> KernelSource:
    """One gemv kernel: a block per tile of output rows (split-K inside the block where the rows
    are long and few), its launch and its shape."""
    G, launch, tuning = spec.G, spec.launch, spec.tuning
    params = Params(G)
    vec = input_vector(G, launch, params)
    sets = zip_sets(G, launch.nodes)
    formats = [weight_format(G, G.nodes[l]["inputs"][1]) for z in sets for l in z.linears]
    quantized = any(f.name != "bf16" for f in formats)
    unroll = tuning.gemv_quant_unroll if quantized else tuning.gemv_unroll
    rows_per_warp = tuning.gemv_quant_rows_per_warp if quantized else tuning.gemv_rows_per_warp
    ksplit = _ksplit(sets, vec["K"], max(f.block for f in formats), rows_per_warp, spec.target, tuning)
    zips, grid = zip_contexts(G, launch, params,
                              lambda members, pairs: _slots(ksplit, members, pairs, rows_per_warp, tuning),
                              rows_per_warp=rows_per_warp)
    max_tile = max(z.R * len(z.members) for z in zips)
    # integer formats read the vector staged in shared memory where it fits, else take the float path
    integer = all(f.integer_codes for f in formats)
    staged = integer and staged_fits(vec["K"], ksplit, max_tile)
    tail = _tail(G, launch, params)
    name, source = render("gemv.cu.j2", "gemv", shape_name(vec, zips) + ("_tail" if tail else ""),
                          params=params.decls, **vec, zips=zips, tail=tail,
                          quantized=quantized, staged=staged, threads=tuning.gemv_warps * 32, unroll=unroll, ksplit=ksplit,
                          min_blocks=tuning.gemv_quant_blocks_per_sm if quantized and not staged else 1,
                          rows_per_warp=rows_per_warp,
                          max_tile=max_tile, grid=grid)
    return KernelSource(name, "gemv", source, launch.nodes,
                        [Launch(name, (grid, 1), tuning.gemv_warps * 32, params.values)], launch.layer)


def _tail(G: nx.DiGraph, launch: ScheduledKernel, params: Params) -> dict | None:
    """The kernel's row-wise tail (compiler/fuse_tail.py) for one token: its phases, run by the
    block that finishes last (counted at `counter` of the runtime's "block_counts", after the
    counts of the kernel's fp8 cache writes), or None."""
    body, tail = split_tail(G, launch.nodes)
    if not tail:
        return None
    stored = set(stored_rows(G, tail)) | (set(launch.writes) & set(tail))
    code = rowwise.phases(G, tail, params, stored, through_l2=frozenset(body))
    counter = f"{runtime_buffer(params, 'unsigned*', 'block_counts')} + {counters(G, launch) - 1}"
    return {"phases": code, "counter": counter, "quantized": rowwise.quantized(G, tail)}


def counters(G: nx.DiGraph, launch: ScheduledKernel) -> int:
    """The arrival counters a gemv kernel uses in the runtime's "block_counts": a head's for each
    fp8 cache write (kv_cache.staging), then one for its tail, if it has one."""
    counts = staging(G, launch.nodes, G.graph.get("tokens", 1))[2]
    return counts + bool(split_tail(G, launch.nodes)[1])


def block_counts(G: nx.DiGraph) -> int:
    """The counters any gemv kernel of compiled graph G needs (at least 1): the runtime's
    "block_counts", all 0 between kernels (each kernel's last arrivals leave them at 0)."""
    return max([counters(G, k) for k in G.graph["schedule"] if k.family == "gemv"] + [1])


def staged_bytes(K: int) -> int:
    """Shared memory of a vector of K values staged as int16 groups (StagedX: 2 bytes a value, a
    scale and two sums a group), rounded up to StagedX's 16-byte alignment."""
    return -(-(2 * K + 12 * (K // 32)) // 16) * 16


def staged_fits(K: int, ksplit: int, max_tile: int) -> bool:
    """Whether a quantized GEMV's staged vector fits the static shared memory beside its tile of
    dot products (and 1 KiB for an epilogue's exchanges). Rows longer than ~19k weights take the
    float path."""
    return staged_bytes(K) + 4 * ksplit * (max_tile + 1) + 1024 <= SMEM_STATIC


def shape_name(vec: dict, zips: list[ZipTile], tokens: int | None = None) -> str:
    """A gemv / gemm kernel's shape in its name: norm_k<K>_<members>x<N>..., _t<tokens> for a gemm."""
    shape = f"k{vec['K']}_" + "_".join(f"{len(z.members)}x{z.N}{z.formats}" for z in zips)
    kv = "_kvfp8" if any("kv_fp8_epilogue" in z.epilogue for z in zips) else ""   # fp8 KV cache writes
    return ("norm_" if vec["prologue"] else "") + shape + kv + (f"_t{tokens}" if tokens else "")


def _slots(ksplit: int, members: int, pairs: bool, rows_per_warp: int, tuning: Tuning) -> int:
    """Rows per member in one block's tile: each group of `ksplit` warps takes `rows_per_warp` rows."""
    r = max(1, tuning.gemv_warps // ksplit * rows_per_warp // members)
    return max(2, r + (r & 1)) if pairs else r


def _tiles(width: int, R: int, pairs: bool) -> int:
    return -(-width // R) if not pairs else -(-(width // 2) // (R // 2))


def _ksplit(sets: list[ZipSet], K: int, block: int, rows_per_warp: int, target: Target, tuning: Tuning) -> int:
    """Warps per output row (split-K inside the block). Short outputs with long rows (a 2048-row
    O or down projection) give too few rows for one warp each to fill the GPU with loads in
    flight, so several warps share a row, each streaming a slice of it, until the kernel has
    gemv_warps_per_sm streaming warps per SM. Slices hold whole quantization blocks of `block`."""
    rows = sum(z.width * len(z.linears) for z in sets)
    min_warps = target.sms * tuning.gemv_warps_per_sm
    ksplit = 1
    while (rows // rows_per_warp * ksplit < min_warps and ksplit < min(4, tuning.gemv_warps)
           and K % (2 * ksplit * 8) == 0 and K // (2 * ksplit) >= 256 and K // (2 * ksplit) % block == 0):
        ksplit *= 2
    return ksplit


def input_vector(G: nx.DiGraph, launch: ScheduledKernel, params: Params) -> dict:
    """The vector a gemv kernel's linears read: `x` (its C name), its width `K`, and the norm
    `prologue` that produces it from x inside the kernel (weight, eps, offset) or None."""
    prologue, linears, _ = gemv_parts(G, launch.nodes)
    x_value = G.nodes[prologue]["inputs"][0] if prologue else G.nodes[linears[0]]["inputs"][0]
    x = params.ref(x_value)
    pro = None
    if prologue:
        a = G.nodes[prologue]["attrs"]
        pro = {"weight": params.ref(G.nodes[prologue]["inputs"][1]), "eps": cexpr.float_literal(a["eps"]),
               "offset": cexpr.float_literal(a.get("offset", 0.0))}
    return {"x": x, "K": G.nodes[x_value]["shape"][-1], "prologue": pro}


def zip_contexts(G: nx.DiGraph, launch: ScheduledKernel, params: Params, slots, batched: bool = False,
                 rows_per_warp: int = 1) -> tuple[list[ZipTile], int]:
    """Template variables of each zip set of a gemv kernel's nodes, whose tiles hold
    `slots(members, pairs)` rows of each member (a multiple of `rows_per_warp` where the members
    differ in format), and the grid: one block per tile, zip after zip."""
    nodes = launch.nodes
    _, _, epilogue = gemv_parts(G, nodes)
    zips, start = [], 0
    for z in zip_sets(G, nodes):
        hd, interleaved = z.pairs or (0, False)
        groups = format_groups(G, z.linears)
        R = slots(len(z.linears), bool(hd))
        if len(groups) > 1:         # a warp's NR rows must be one member's: R a multiple of NR
            step = math.lcm(rows_per_warp, 2 if hd else 1)
            R = max(step, R // step * step)
        tiles = _tiles(z.width, R, bool(hd))
        z_epi = [n for n in epilogue if _zip_of(G, n, z.linears, set(nodes))]
        preload: list[str] = []
        loads: list[tuple[str, str, str]] | None = [] if batched else None
        members = [params.ref(G.nodes[l]["inputs"][1]) for l in z.linears]
        body = _epilogue(G, launch, z.linears, z_epi, R, params, batched, preload, paired=bool(hd), loads=loads)
        # _epilogue shares each RoPE source that is not a dot product itself (a biased one) once
        exchanges = len({G.nodes[n]["inputs"][0] for n in z_epi if G.nodes[n]["kind"] is Kind.ROW_LOCAL}
                        - set(z.linears))
        zips.append(ZipTile(z.width, R, hd, str(interleaved).lower(), start, start + tiles, members, body,
                            "\n".join(preload), groups, exchanges, tuple(loads or ())))
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


def _epilogue(G, launch, linears, epilogue, R, params, batched: bool = False, preload: list[str] | None = None,
              paired: bool = False, loads: list | None = None) -> str:
    """C statements run by thread `s` < R for its slot `row`: every epilogue op, then the writes.
    `batched` (the gemm family, tokens > 1): for token `t` of the step (round `u` of a batch of
    rounds), whose dot products tile_out holds as [member][slot][token] (the block's tokens from
    t0, rows TS floats apart) and whose partner slot s ^ 1 sits in the neighbouring thread; the
    operands earlier kernels wrote are read from arrays that the template fills for the whole
    batch first (`loads`, _round_load). Otherwise the row operands the launch may read before
    its wait (launch.early, compiler/plan_early_reads.py) are loaded by declarations appended to
    `preload`, which the template places before the dot products."""
    def tile(i, slot):
        return f"tile_out[({i} * R + {slot}) * TS + t - t0]" if batched else f"slices_sum(tile_out, {i} * R + {slot})"

    token = "t" if batched else "0"
    var = {l: f"({tile(i, 's')} * pscale)" for i, l in enumerate(linears)}
    partner = {l: f"({tile(i, '(s ^ 1)')} * pscale)" for i, l in enumerate(linears)}
    decls, body = [], []
    inside = set(launch.nodes)
    for n in epilogue:
        d = G.nodes[n]
        kind = d["kind"]
        v = f"v{len(decls)}"
        if kind is Kind.CACHE_WRITE:
            cache, src, pos = d["inputs"][:3]
            if layout_of(G, n).fp8:
                body += _fp8_write(G, launch, n, var[src], R, params, batched, paired)
                continue
            width = d["shape"][-1]
            at = cache_row(G, n, params, token)
            if d["op"] != "paged_kv_write":   # a paged row comes from the page table, after the wait
                at = _ahead(at, [pos], "int", f"__ldcg({params.ref(pos)})", launch, preload, batched)
            at = _round_load(at, "int", loads)
            body.append(f"if (active) {params.ref(cache, written=True)}[(size_t){at} * "
                        f"{width} + row] = f32_to_bf16({var[src]});")
            continue
        decls.append(f"float {v} = 0.0f;")
        if kind is Kind.ELEMENTWISE:
            ops = [var[i] if i in inside else _preloaded(G, i, params, launch, preload) if not batched
                   else row_operand(G, i, params, batched) if not G.nodes[i]["shape"]
                   else _round_load(row_operand(G, i, params, batched), "float", loads) for i in d["inputs"]]
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
            angle = _round_load(angle, "float", loads)
            body.append(f"if (active) {v} = rope_rotate({var[src]}, {partner[src]}, s & 1, {angle});")
        var[n] = v
    for n in launch.writes + launch.scratch:     # scratch: what the kernel's tail reads back
        if n in var and get(G.nodes[n]["op"]).inplace_of is None:
            at = f"t * {G.nodes[n]['shape'][-1]} + row" if batched else "row"
            body.append(f"if (active) {params.ref(n, written=True)}[{at}] = {var[n]};")
    return "\n".join("        " + line for line in decls + body)


def _fp8_write(G, launch, node, value: str, R: int, params, batched: bool, paired: bool) -> list[str]:
    """The fp8 cache write of kv_write `node` (kv_cache.cuh: kv_fp8_epilogue): the block's values
    staged, the last block of each head writing it. A gemm round takes THREADS / R tokens."""
    cache, _, pos = G.nodes[node]["inputs"][:3]
    rows = params.ref(pos)            # the rows of the step's tokens: their positions, or through page tables
    if G.nodes[node]["op"] == "paged_kv_write":
        pages = G.nodes[node]["inputs"][3]
        rows = (f"PagedPositions<{G.nodes[node]['attrs']['page']}, {fixed_table(G, pages)}>"
                f"{{{params.ref(pages)}, {params.ref(pos)}}}")
    lay = layout_of(G, node)
    st = staging(G, launch.nodes, G.graph.get("tokens", 1))[0][node]
    unit = 2 if paired else 1
    # a round's first token: thread e of the round takes token (first) + e / R, whatever the first is
    ntok, t0, token, live = (("THREADS / R", "t - (int)threadIdx.x / R", "t", "THREADS") if batched
                             else ("1", "0", "0", "blockDim.x"))
    stage, counts = runtime_buffer(params, "float*", "kv_stage"), runtime_buffer(params, "unsigned*", "block_counts")
    lines = ['static_assert(THREADS % R == 0, "a round of the epilogue takes whole tokens");'] if batched else []
    return lines + [f"kv_fp8_epilogue<{lay.head_dim}, {unit}, {R // unit}, {lay.width}, {ntok}, {lay.stride}, "
                    f"{lay.scale_at}>({params.ref(cache, written=True)}, {stage} + {st.stage}, {counts} + {st.counts}, "
                    f"{rows}, {t0}, tile, active, row, {token}, active ? {value} : 0.0f, {live});"]


def runtime_buffer(params, decl: str, key: str) -> str:
    """The C name of runtime buffer `key` among a kernel's arguments, added once."""
    return f"p{params.values.index(key)}" if key in params.values else params.extra(decl, key)


def _round_load(expr: str, ctype: str, loads: list | None) -> str:
    """`expr` (an operand that earlier kernels wrote, for round u's slot and token), or where
    `loads` collects them (the gemm family's epilogue), the element u of an array that the
    template fills for every round of a batch before any round's writes: the compiler cannot
    move a load above a store to another pointer, so rounds loading in turn would each wait a
    memory round trip."""
    if loads is None:
        return expr
    name = next((n for _, n, e in loads if e == expr), None)
    if name is None:
        name = f"h{len(loads)}"
        loads.append((ctype, name, expr))
    return f"{name}[u]"


def _ahead(expr: str, values: list[str], ctype: str, early_expr: str, launch, preload: list[str] | None,
           batched: bool) -> str:
    """`expr`, or where the launch may read all of `values` before its wait (launch.early), a
    register that a declaration appended to `preload` computes ahead as `early_expr`, whose loads
    of earlier kernels' values go through L2 (`__ldcg`: L1 is not kept coherent with other SMs'
    writes)."""
    if batched or preload is None or not set(values) <= set(launch.early):
        return expr
    name = f"e{len(preload)}"
    preload.append(f"        const {ctype} {name} = active ? {early_expr} : 0;")
    return name


def _preloaded(G, value, params, launch, preload: list[str] | None) -> str:
    """An external operand of a GEMV's epilogue with an element per row, loaded ahead where the
    launch may (see _ahead); a scalar is read where it is used."""
    if not G.nodes[value]["shape"]:
        return row_operand(G, value, params)
    p = params.ref(value)
    early = f"w2f({p}[row])" if G.nodes[value]["op"] == "weight" else f"__ldcg({p} + row)"
    return _ahead(row_operand(G, value, params), [value], "float", early, launch, preload, False)


def row_operand(G, value, params, batched: bool = False) -> str:
    """An operand computed by an earlier kernel (or a weight): its element for this row (and
    token t of the step, where `batched` and it has a token dimension)."""
    d = G.nodes[value]
    p = params.ref(value)
    if len(d["shape"]) == 0:
        return f"{p}[0]"
    if d["op"] == "weight":
        return f"w2f({p}[row])"
    return f"{p}[t * {d['shape'][-1]} + row]" if batched and d["shape"][0] == "T" else f"{p}[row]"

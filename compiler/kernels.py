"""What a kernel is to the compiler: a set of graph nodes sharing a `kernel` label, of one family.

Families (each one a CUDA template in codegen/):
- "gemv":      one or more LINEAR nodes reading the same vector, optionally a NORM prologue that
               produces that vector, and an epilogue of ELEMENTWISE / ROW_LOCAL / CACHE_WRITE nodes
               computed on the tile of output rows each block owns; optionally a row-wise tail
               (nodes marked TAIL, compiler/fuse_tail.py) run on whole rows of its results by
               the block that finishes last;
- "attention": one ATTENTION node (split over the context, then combined);
- "moe":       one MOE node (gate/up of the routed experts, then their weighted down projection),
               optionally a NORM prologue that produces its input vector and an epilogue of
               ELEMENTWISE nodes on its output rows (the residual add);
- "rowwise":   any other ops (EMBEDDING, NORM, ELEMENTWISE, ROW_LOCAL, CACHE_WRITE, REDUCTION),
               one block per token row, op after op.
The helpers here are shared by the passes; they never look at op names, only at kinds and traits.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx

from ..dsl import Kind, get

EPILOGUE_KINDS = (Kind.ELEMENTWISE, Kind.ROW_LOCAL, Kind.CACHE_WRITE)
TAIL = "tail"     # node attribute: the node runs in its gemv kernel's row-wise tail
ROWWISE_KINDS = (Kind.EMBEDDING, Kind.NORM, Kind.ELEMENTWISE, Kind.ROW_LOCAL, Kind.CACHE_WRITE,
                 Kind.REDUCTION)


@dataclass(frozen=True)
class ScheduledKernel:
    """One kernel of the launch schedule (compiler/schedule.py makes them, in launch order)."""
    kernel: str               # the kernel id its nodes carry
    family: str               # "gemv", "attention", "moe" or "rowwise" (see the module docstring)
    nodes: list[str]          # graph nodes it computes, in graph order
    reads: list[str]          # values it reads that other kernels (or sources) hold
    writes: list[str]         # values it writes for other kernels, or as graph outputs
    scratch: list[str]        # values it stores for itself alone (a row-wise kernel's stored ops)
    layer: int | None         # the decoder layer it belongs to
    early: list[str] = field(default_factory=list)   # reads it may make before its wait (plan_early_reads)


@dataclass
class ZipSet:
    """Linears of a gemv kernel whose outputs meet in one epilogue op: a block computes the same
    tile of rows of each, so they share one width. `pairs` fixes how a tile's slots map to rows:
    (span, interleaved) when a row-local op (RoPE) pairs row i with i + span/2 (or 2i with 2i+1),
    None for contiguous rows."""
    linears: list[str]
    width: int
    pairs: tuple[int, bool] | None = None


def members(G: nx.DiGraph) -> dict[str, list[str]]:
    """Kernel id -> its nodes, in graph order."""
    out: dict[str, list[str]] = defaultdict(list)
    for name in sorted(G, key=lambda n: G.nodes[n]["order"]):
        k = G.nodes[name]["kernel"]
        if k is not None:
            out[k].append(name)
    return dict(out)


def kernel_graph(G: nx.DiGraph) -> nx.DiGraph:
    """The quotient graph: one node per kernel, an edge where one kernel reads another's output."""
    succ = kernel_successors(G)
    Q = nx.DiGraph()
    Q.add_nodes_from(succ)
    Q.add_edges_from((k, s) for k, after in succ.items() for s in after)
    return Q


def kernel_successors(G: nx.DiGraph) -> dict[str, set[str]]:
    """The quotient graph as plain sets, kernel -> the kernels reading its outputs, in graph order
    of the kernels (merge builds it for every merge the fusion passes try: no networkx graph)."""
    kernel = dict(G.nodes(data="kernel"))
    succ: dict[str, set[str]] = {k: set() for k in kernel.values() if k is not None}
    for u, v in G.edges:
        ku, kv = kernel[u], kernel[v]
        if ku is not None and kv is not None and ku != kv:
            succ[ku].add(kv)
    return succ


def runs_after(succ: dict[str, set[str]], kernels: set[str]) -> set[str]:
    """`kernels` and every kernel that reads, directly or through others, what they compute."""
    reached, frontier = set(kernels), list(kernels)
    while frontier:
        for s in succ[frontier.pop()]:
            if s not in reached:
                reached.add(s)
                frontier.append(s)
    return reached


def merge(G: nx.DiGraph, kernels: list[str], into: str | None = None) -> bool:
    """Relabel `kernels` as one kernel, in place, if the kernel graph stays acyclic.

    Merging two kernels is illegal when a path between them leaves the merged set: the merged
    kernel would have to run both before and after the kernel on that path. Returns whether it merged.
    """
    kernels = list(dict.fromkeys(kernels))
    into = into or kernels[0]
    if len(kernels) < 2:
        return True
    succ = kernel_successors(G)
    merged = set(kernels)
    after = {s for k in kernels for s in succ[k]} - merged     # kernels that run after the set
    if runs_after(succ, after) & merged:
        return False
    for name in G:
        if G.nodes[name]["kernel"] in merged:
            G.nodes[name]["kernel"] = into
    return True


def family(G: nx.DiGraph, nodes: list[str]) -> str:
    """The family of a kernel made of `nodes`; raises ValueError when no family can run it."""
    kinds = [G.nodes[n]["kind"] for n in nodes]
    if Kind.ATTENTION in kinds:
        if len(nodes) != 1:
            raise ValueError(f"attention cannot share a kernel: {nodes}")
        return "attention"
    if Kind.MOE in kinds:
        check_moe(G, nodes)
        return "moe"
    if Kind.LINEAR in kinds:
        check_gemv(G, nodes)
        return "gemv"
    _check_rowwise(G, nodes)
    return "rowwise"


def _check_rowwise(G: nx.DiGraph, nodes: list[str]) -> None:
    bad = [n for n in nodes if G.nodes[n]["kind"] not in ROWWISE_KINDS]
    if bad:
        raise ValueError(f"no kernel family runs {bad}")


def split_tail(G: nx.DiGraph, nodes: list[str]) -> tuple[list[str], list[str]]:
    """A kernel's nodes as (its body, its row-wise tail), each in the order given."""
    return [n for n in nodes if not G.nodes[n].get(TAIL)], [n for n in nodes if G.nodes[n].get(TAIL)]


def gemv_parts(G: nx.DiGraph, nodes: list[str]) -> tuple[str | None, list[str], list[str]]:
    """Split a gemv kernel into (prologue norm or None, linears, epilogue nodes), in graph order
    (its tail aside: split_tail)."""
    nodes, _ = split_tail(G, nodes)
    linears = [n for n in nodes if G.nodes[n]["kind"] is Kind.LINEAR]
    x = G.nodes[linears[0]]["inputs"][0]
    prologue = x if x in nodes else None
    epilogue = [n for n in nodes if n not in linears and n != prologue]
    return prologue, linears, epilogue


def check_gemv(G: nx.DiGraph, nodes: list[str]) -> None:
    """Raise ValueError unless `nodes` form a legal gemv kernel (see the module docstring)."""
    body, tail = split_tail(G, nodes)
    if tail:
        _check_rowwise(G, tail)
        if any(G.nodes[n]["kind"] is Kind.EMBEDDING for n in tail) or set(tail) & {
                i for n in body for i in G.nodes[n]["inputs"]}:
            raise ValueError(f"tail {tail} must run after its GEMVs on their results")
        nodes = body
    prologue, linears, epilogue = gemv_parts(G, nodes)
    inputs = {G.nodes[n]["inputs"][0] for n in linears}
    if len(inputs) != 1:
        raise ValueError(f"GEMVs {linears} read different vectors {sorted(inputs)}")
    if prologue is not None and G.nodes[prologue]["kind"] is not Kind.NORM:
        raise ValueError(f"prologue {prologue} is not a normalization")
    if prologue is not None and G.nodes[prologue]["attrs"].get("group") not in (None, G.nodes[prologue]["shape"][-1]):
        raise ValueError(f"prologue {prologue} normalises groups of the row: one statistic per row only")
    for n in epilogue:
        if G.nodes[n]["kind"] not in EPILOGUE_KINDS:
            raise ValueError(f"{n} ({G.nodes[n]['op']}) cannot run in a GEMV epilogue")
    if prologue is not None and (set(G.successors(prologue)) - set(linears)
                                 or prologue in G.graph["outputs"].values()):
        raise ValueError(f"prologue {prologue} is read outside its GEMVs, so it must be written")
    zip_sets(G, nodes)  # raises on misaligned tiles


def moe_parts(G: nx.DiGraph, nodes: list[str]) -> tuple[str | None, str, list[str]]:
    """Split a moe kernel into (prologue norm or None, the moe node, epilogue nodes), in graph order."""
    moes = [n for n in nodes if G.nodes[n]["kind"] is Kind.MOE]
    if len(moes) != 1:
        raise ValueError(f"a moe kernel computes one moe node, not {moes}")
    (moe,) = moes
    x = G.nodes[moe]["inputs"][0]
    prologue = x if x in nodes else None
    return prologue, moe, [n for n in nodes if n not in (moe, prologue)]


def check_moe(G: nx.DiGraph, nodes: list[str]) -> None:
    """Raise ValueError unless `nodes` form a legal moe kernel (see the module docstring): its
    prologue a whole-row norm read by the moe node alone, its epilogue elementwise ops as wide as
    its output that descend from it inside the kernel."""
    prologue, moe, epilogue = moe_parts(G, nodes)
    if prologue is not None:
        d = G.nodes[prologue]
        if d["kind"] is not Kind.NORM or d["attrs"].get("group") not in (None, d["shape"][-1]):
            raise ValueError(f"prologue {prologue} of {moe} is not a norm of whole rows")
        if set(G.successors(prologue)) != {moe} or prologue in G.graph["outputs"].values():
            raise ValueError(f"prologue {prologue} is read outside {moe}, so it must be written")
    inside = {moe}
    for n in epilogue:
        if G.nodes[n]["kind"] is not Kind.ELEMENTWISE:
            raise ValueError(f"{n} ({G.nodes[n]['op']}) cannot run in a moe epilogue")
        if tile_width(G, n) != tile_width(G, moe) or not inside & set(G.nodes[n]["inputs"]):
            raise ValueError(f"epilogue node {n} is not an elementwise op on {moe}'s rows")
        inside.add(n)


def tile_width(G: nx.DiGraph, name: str) -> int:
    """The row width of a value, which is what a GEMV tile spans."""
    return G.nodes[name]["shape"][-1]


def zip_sets(G: nx.DiGraph, nodes: list[str]) -> list[ZipSet]:
    """Group a gemv kernel's linears into zip sets (ZipSet); raises ValueError where their tiles
    cannot line up."""
    prologue, linears, epilogue = gemv_parts(G, nodes)
    inside = set(nodes)
    root = {n: n for n in linears}    # union-find over linears; epilogue nodes map to a linear

    def find(n):
        while root[n] != n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for n in epilogue:
        tiled = [i for i in G.nodes[n]["inputs"] if i in inside and i != prologue]
        if not tiled:
            raise ValueError(f"epilogue node {n} reads nothing computed by the GEMVs")
        reps = [find(i) for i in tiled]
        root[n] = reps[0]
        for r in reps[1:]:
            root[r] = reps[0]
    sets: dict[str, ZipSet] = {}
    for lin in linears:
        s = sets.setdefault(find(lin), ZipSet([], tile_width(G, lin)))
        if tile_width(G, lin) != s.width:
            raise ValueError(f"GEMVs {s.linears + [lin]} meet in an epilogue but differ in width")
        s.linears.append(lin)
    for n in epilogue:
        s = sets[find(n)]
        if tile_width(G, n) != s.width:
            raise ValueError(f"epilogue node {n} is not as wide as its GEMV")
        opdef = get(G.nodes[n]["op"])
        if opdef.kind is Kind.ROW_LOCAL:
            attrs = G.nodes[n]["attrs"]
            shapes = [G.nodes[i]["shape"] for i in G.nodes[n]["inputs"]]
            if opdef.tile_fits is not None and not opdef.tile_fits(shapes, attrs):
                raise ValueError(f"row-local {n} does not fit the GEMV tile layout")
            pairs = (attrs[opdef.span_attr], bool(attrs.get("interleaved")))
            if s.pairs not in (None, pairs) or s.width % pairs[0]:
                raise ValueError(f"row-local {n} needs tiles {pairs}, its GEMV has {s.pairs}")
            s.pairs = pairs
    return list(sets.values())


def materialized(G: nx.DiGraph, nodes: list[str]) -> list[str]:
    """The nodes a kernel must store in memory even if no other kernel reads them.

    A row-wise kernel runs its ops one after another over the whole row, so every value a later
    op reads at other positions (norms, row-local ops, reductions read whole rows) is stored;
    elementwise values read only by elementwise ops are inlined as C expressions instead.
    GEMV epilogues and attention keep their intermediates on chip; a gemv kernel's tail is a
    row-wise group of its own, reading the GEMV results it needs from memory.
    """
    fam = family(G, nodes)
    if fam == "gemv":       # a tail reads whole rows of the GEMVs' results: other blocks wrote them
        body, tail = split_tail(G, nodes)
        read = {i for n in tail for i in G.nodes[n]["inputs"]}
        return [n for n in body if n in read and get(G.nodes[n]["op"]).inplace_of is None] + \
            (stored_rows(G, tail) if tail else [])
    if fam != "rowwise":
        return []
    return stored_rows(G, nodes)


def stored_rows(G: nx.DiGraph, nodes: list[str]) -> list[str]:
    """The nodes a row-wise group of ops stores (see materialized)."""
    inside = set(nodes)
    keep = []
    for n in nodes:
        readers = list(G.successors(n))
        inlined = G.nodes[n]["kind"] is Kind.ELEMENTWISE and all(
            r in inside and G.nodes[r]["kind"] is Kind.ELEMENTWISE for r in readers)
        if not inlined and get(G.nodes[n]["op"]).inplace_of is None:
            keep.append(n)
    return keep

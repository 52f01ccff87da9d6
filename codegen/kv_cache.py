"""The KV cache as the kernels hold it: its element type, row layout and bytes, and the scratch
space its fp8 writes take (templates/kv_cache.cuh; the rule is dsl/kv_dtype.py's).

bf16: rows of `width` bf16 values. fp8: rows of `stride` bytes, the e4m3 codes of the width
values, then at `scale_at` a float32 scale per KV head, padded to 32 bytes (whole sectors: a
sector read early for row p - 1 never holds part of row p).
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..errors import FuselmError
from .params import storage_of

KV_WRITES = ("kv_write", "paged_kv_write")   # the ops that write a cache row


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class CacheLayout:
    """One KV cache of `width` = kv_heads x head_dim values per row, in `kv` ("bf16" or "fp8")."""
    kv: str
    width: int
    head_dim: int

    @property
    def fp8(self) -> bool:
        return self.kv == "fp8"

    @property
    def kv_heads(self) -> int:
        return self.width // self.head_dim

    @property
    def scale_at(self) -> int:
        """fp8: byte offset of a row's scales."""
        return _align(self.width, 4)

    @property
    def stride(self) -> int:
        """Bytes from one row to the next."""
        return _align(self.scale_at + 4 * self.kv_heads, 32) if self.fp8 else 2 * self.width

    def nbytes(self, rows: int) -> int:
        """Bytes of the cache with `rows` rows."""
        return rows * self.stride

    @property
    def c_type(self) -> str:
        """The attention passes' cache policy (kv_cache.cuh)."""
        return f"KvFp8<{self.stride}, {self.scale_at}>" if self.fp8 else "KvBf16"


def kv_write_of(G: nx.DiGraph, value: str) -> dict | None:
    """The attributes of the kv_write node that writes the cache holding `value` (None: none)."""
    store = storage_of(G, value)
    for n in G.successors(store) if store in G else ():
        if G.nodes[n]["op"] in KV_WRITES and G.nodes[n]["inputs"][0] == store:
            return G.nodes[n]["attrs"]
    return None


def layout_of(G: nx.DiGraph, value: str) -> CacheLayout:
    """The layout of the cache holding `value` (a state, or a kv_write's output)."""
    width = G.nodes[storage_of(G, value)]["shape"][-1]
    attrs = kv_write_of(G, value) or {}
    kv = attrs.get("kv", "bf16")
    return CacheLayout(kv, width, attrs.get("head_dim") or width) if kv == "fp8" else CacheLayout("bf16", width, width)


def cache_row(G: nx.DiGraph, node: str, params, token: str) -> str:
    """The C expression of the cache row that cache write `node` writes for token `token` of the
    step: its position, or where the write is paged, the pool row its sequence's page table maps
    that position to (kv_cache.cuh: paged_row)."""
    d = G.nodes[node]
    pos = f"{params.ref(d['inputs'][2])}[{token}]"
    if d["op"] != "paged_kv_write":
        return pos
    pages = d["inputs"][3]
    return f"paged_row({params.ref(pages)} + (size_t)({token}) * {fixed_table(G, pages)}, {d['attrs']['page']}, {pos})"


def fixed_table(G: nx.DiGraph, pages: str) -> int:
    """The width of page table `pages`, which kernels need fixed (dsl/paging.py: paged(table=))."""
    width = G.nodes[pages]["shape"][-1]
    if not isinstance(width, int):
        raise FuselmError(f"'{pages}': the kernels need a page table of a fixed width, not '{width}' "
                          "(paged(graph, page, table=...))")
    return width


def attention_cache(G: nx.DiGraph, node: str, target) -> CacheLayout:
    """The layout of attention `node`'s K and V caches, which must share one dtype; an fp8 cache
    needs the e4m3 conversions of sm_89 on."""
    kc, vc = G.nodes[node]["inputs"][1:3]
    k, v = layout_of(G, kc), layout_of(G, vc)
    if k.kv != v.kv:
        raise FuselmError(f"{node}: its K cache is {k.kv} but its V cache {v.kv}; both must be one dtype")
    if k.fp8 and target.capability < 89:
        raise FuselmError(f"{node}: an fp8 KV cache needs sm_89 or later (e4m3 conversions), not {target.arch}")
    return k


@dataclass(frozen=True)
class Staging:
    """Where one fp8 kv_write of a GEMV / gemm kernel stages its rows: floats [T][width] at
    `stage` of the runtime's "kv_stage", counts [T][kv_heads] at `counts` of "block_counts"."""
    stage: int
    counts: int


def staging(G: nx.DiGraph, nodes: list[str], tokens: int) -> tuple[dict[str, Staging], int, int]:
    """Each fp8 kv_write among `nodes` -> its Staging, for steps of `tokens`; and the floats and
    counts they take in all."""
    out, floats, counts = {}, 0, 0
    for n in nodes:
        d = G.nodes[n]
        if d["op"] in KV_WRITES and d["attrs"].get("kv") == "fp8":
            lay = layout_of(G, n)
            out[n] = Staging(floats, counts)
            floats += tokens * lay.width
            counts += tokens * lay.kv_heads
    return out, floats, counts


def staging_sizes(G: nx.DiGraph) -> tuple[int, int]:
    """The largest (floats, counts) any gemv kernel of compiled graph G stages (at least 1 each):
    what the runtime's "kv_stage" holds and the counts "block_counts" starts with (codegen/gemv.py:
    block_counts)."""
    tokens = G.graph.get("tokens", 1)
    sizes = [staging(G, k.nodes, tokens)[1:] for k in G.graph["schedule"] if k.family == "gemv"]
    return max([f for f, _ in sizes] + [1]), max([c for _, c in sizes] + [1])


def state_bytes(G: nx.DiGraph, rows: int) -> int:
    """Bytes of every KV cache of compiled graph G with `rows` rows."""
    return sum(layout_of(G, n).nbytes(rows) for n in G if G.nodes[n]["op"] == "state")


def graph_kv_bytes(graph, ctx: int, kv: str) -> int:
    """Bytes of a DSL graph's KV caches of `ctx` rows each held as `kv` (before any compiling)."""
    from ..dsl.kv_dtype import with_kv_dtype
    g = with_kv_dtype(graph, kv)
    writes = {n.inputs[0]: n for n in g.nodes.values() if n.op in KV_WRITES}
    total = 0
    for n in g.sources("state"):
        w = writes.get(n.name)
        fp8 = w is not None and w.attrs.get("kv") == "fp8"
        total += CacheLayout("fp8", n.shape[-1], w.attrs["head_dim"]).nbytes(ctx) if fp8 else 2 * ctx * n.shape[-1]
    return total

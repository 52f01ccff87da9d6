"""The attention family: flash-decoding over the KV cache (a split launch and a combine launch),
with variants by position: one launch walking the whole context while it is short, and the wide
split (longer chunks) where the split's blocks would outnumber the SMs. For steps of several
tokens (batched prefill), one block per KV head and token; for steps over many sequences'
paged caches (continuous batching), a block per KV head and token walking its own sequence's pages.

Where the head layout allows (head size 64 or 128, at most 8 query heads per KV head), every
pass runs on tensor cores (MmaPass), else on CUDA cores (LanePass). The wide split's MmaPass
issues its V rows after the queries (LATE_V), so the scores run while V arrives: its blocks fill
the GPU wherever it runs (measured: 4k context 0.4-1.9% faster for Llama-3.2-1B); the ordinary
split keeps them with the K rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..dsl import get
from ..errors import FuselmError
from . import cexpr
from .kernel import KernelSource, KernelSpec, Launch, Variant
from .kv_cache import attention_cache, fixed_table
from .params import Params, storage_of
from .render import render
from .tuning import SMEM_STATIC, Target, Tuning

MAX_SCORES = 32  # cache rows x query heads whose scores one lane keeps in registers (LanePass)


@dataclass(frozen=True)
class Pass:
    """A pass over a block of cache rows: its C++ type, the cache positions it covers, whether it
    runs on tensor cores (MmaPass; else LanePass) and issues its V rows after the queries."""
    type: str
    chunk: int
    on_tensor_cores: bool = False
    late_v: bool = False


@dataclass(frozen=True)
class WideSplit:
    """The wide split: positions start .. until - 1 take split blocks of `warps` warps over
    chunks of pass_.chunk positions (nchunk of them for the cache), one wave on the GPU."""
    start: int
    until: int
    pass_: Pass
    warps: int
    nchunk: int = 0

    @property
    def chunk(self) -> int:
        return self.pass_.chunk

    @property
    def threads(self) -> int:
        return self.warps * 32


def lanes_per_row(head_dim: int) -> int:
    """Lanes sharing one cache row, 8 dims each, rounded up to a power of two (RowLanes)."""
    lanes = 1
    while lanes * 8 < head_dim:
        lanes *= 2
    return lanes


def _rows_per_lane(limit: int, group: int) -> int:
    """Cache rows a lane holds: at most `limit`, and J x group scores fit in MAX_SCORES registers."""
    return max(1, min(limit, MAX_SCORES // group))


def mma_fits(head_dim: int, group: int, target: Target) -> bool:
    """Whether MmaPass (tensor cores) serves this head layout on `target`."""
    return head_dim in (64, 128) and group <= 8 and target.capability >= 80


def pass_of(kv: int, head_dim: int, group: int, warps: int, row_limit: int, target: Target,
            late_v: bool = False, cache: str = "KvBf16") -> Pass:
    """The pass of a block of `warps` warps: MmaPass where it fits (with `late_v`, its V rows
    after the queries); else LanePass, whose lanes hold J <= row_limit rows each (J x group scores
    in registers). `cache`: the cache layout's C++ policy (kv_cache.py), named only where not bf16."""
    if mma_fits(head_dim, group, target):
        late = ", true" if late_v else ""
        if cache != "KvBf16":
            late = f", {str(late_v).lower()}, 1, {cache}"
        return Pass(f"MmaPass<{kv}, {head_dim}, {warps}, {group}{late}>", warps * (2048 // head_dim),   # MmaPass::CHUNK
                    on_tensor_cores=True, late_v=late_v)
    rows = _rows_per_lane(row_limit, group)
    policy = f", {cache}" if cache != "KvBf16" else ""
    return Pass(f"LanePass<{kv}, {head_dim}, {warps}, {rows}, {group}{policy}>",
                warps * (32 // lanes_per_row(head_dim)) * rows)                                 # LanePass::CHUNK


def _softmax_smem(warps: int, head_dim: int, group: int, target: Target) -> int:
    """Bytes of the block's WarpStates: per warp and head, max, sum and one row of values (padded
    by 4 floats in MmaPass, see its block_merge; LanePass keeps its lanes' 8-dim slices)."""
    row = head_dim + 4 if mma_fits(head_dim, group, target) else lanes_per_row(head_dim) * 8
    return 4 * warps * group * (row + 2)


def warps_fitting(warps: int, head_dim: int, group: int, target: Target) -> int:
    """`warps`, halved until the block's softmax states fit in shared memory (WarpStates)."""
    while warps > 1 and _softmax_smem(warps, head_dim, group, target) > SMEM_STATIC:
        warps //= 2
    return warps


@dataclass(frozen=True)
class Layout:
    """The head layout of one attention node and what the kernels make of it on a target."""
    kv: int
    head_dim: int
    group: int               # query heads per KV head
    target: Target
    tuning: Tuning
    cache: str = "KvBf16"    # the KV cache's layout policy (kv_cache.py: CacheLayout.c_type)

    @property
    def split_warps(self) -> int:
        """Warps per split block: attn_warps, fewer where their softmax states would not fit."""
        return warps_fitting(self.tuning.attn_warps, self.head_dim, self.group, self.target)

    @property
    def split_pass(self) -> Pass:
        """The split's pass; a split block covers one pass of the cache."""
        return pass_of(self.kv, self.head_dim, self.group, self.split_warps, self.tuning.attn_rows, self.target,
                       cache=self.cache)

    @property
    def single_warps(self) -> int:
        return warps_fitting(self.tuning.attn_single_warps, self.head_dim, self.group, self.target)

    @property
    def single_pass(self) -> Pass:
        """The one-launch variant's pass; on CUDA cores its lanes hold fewer rows than the split's
        (attn_single_rows): a short context's few rows spread over more lanes."""
        return pass_of(self.kv, self.head_dim, self.group, self.single_warps, self.tuning.attn_single_rows,
                       self.target, cache=self.cache)

    @property
    def single_until(self) -> int:
        """Positions below which one block per KV head walking the whole context (attn_single_passes
        passes at most) replaces the split and combine launches: at short contexts the time is
        latency, and one launch has less of it than two."""
        return self.tuning.attn_single_passes * pass_of(1, self.head_dim, self.group, self.single_warps,
                                                         self.tuning.attn_single_rows, self.target).chunk

    def wide_split(self) -> WideSplit | None:
        """From the position where the split's KV x chunks blocks outnumber the SMs (a second
        wave, or two blocks on the SMs that free first, where the rest end waiting for them) up to
        where blocks of attn_wide_warps warps (longer chunks: fewer blocks than SMs) still fit in
        one wave; None where it would not be wider or cover no positions. Measured: 9 warps about
        +1% at 4k for Llama-3.2-1B, its short context unchanged."""
        wide = self.tuning.attn_wide_warps
        warps = warps_fitting(wide, self.head_dim, self.group, self.target) if wide else 0
        per_head = self.target.sms // self.kv
        if warps <= self.split_warps or per_head == 0:
            return None
        p = pass_of(self.kv, self.head_dim, self.group, warps, self.tuning.attn_rows, self.target, late_v=True,
                    cache=self.cache)
        return WideSplit(per_head * self.split_pass.chunk, per_head * p.chunk, p, warps)


def prefill_rows(layout: Layout, tokens: int, tuning: Tuning) -> tuple[Pass, int, int] | None:
    """The batched prefill's tensor-core pass over several tokens at once: (pass, tokens a block
    takes, warps), or None where the layout has no MmaPass (then a block per KV head and token).
    A block takes the most tokens, a power of two dividing the step, whose query heads fill at
    most the 8 rows the pass gives the queries (the 8B's 4 heads per KV head: 2 tokens, each cache
    row loaded once for both), with as many warps of attn_single_warps as their softmax states leave shared memory."""
    if not mma_fits(layout.head_dim, layout.group, layout.target):
        return None
    per = 1
    while layout.group * per * 2 <= 8 and tokens % (per * 2) == 0:
        per *= 2
    warps = warps_fitting(tuning.attn_single_warps, layout.head_dim, layout.group * per, layout.target)
    chunk = warps * (2048 // layout.head_dim)                                                  # MmaPass::CHUNK
    policy = f", {layout.cache}" if layout.cache != "KvBf16" else ""
    return Pass(f"MmaPass<{layout.kv}, {layout.head_dim}, {warps}, {layout.group}, false, {per}{policy}>", chunk,
                on_tensor_cores=True), per, warps


def sinks_arg(G: nx.DiGraph, node: str, params: Params) -> str:
    """The attention functions' last argument for `node`'s sinks (gpt-oss: an operand after the
    op's own; templates/attention_sinks.cuh), or "" where it has none."""
    d = G.nodes[node]
    extra = d["inputs"][get(d["op"]).arity:]
    return f", AttentionSinks{{{params.ref(extra[0])}}}" if extra else ""


def generate(spec: KernelSpec) -> KernelSource:
    """The attention kernels of one ATTENTION node over a KV cache of spec.ctx rows: for decode
    the split and combine launches with their variants by position (the split's records go
    through the runtime's "workspace"); for a prefill step the prefill kernel alone (prefill_rows:
    several tokens a block on tensor cores, else a block per KV head and token)."""
    G, launch, ctx, tokens, tuning = spec.G, spec.launch, spec.ctx, spec.tokens, spec.tuning
    params = Params(G)
    (n,) = launch.nodes
    d = G.nodes[n]
    q, kc, vc, pos = d["inputs"][:4]
    a = d["attrs"]
    H, KV, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    cache = attention_cache(G, n, spec.target)
    layout = Layout(KV, hd, H // KV, spec.target, tuning, cache.c_type)
    if hd > 256:
        raise FuselmError(f"{n}: head_dim {hd} > 256 is not supported by the attention kernel")
    if G.nodes[storage_of(G, pos)]["op"] != "input":
        raise FuselmError(f"{n}: the position must be a graph input (the attention kernel reads it before "
                          f"waiting for the previous kernel), not a computed value")
    if (need := _softmax_smem(1, hd, layout.group, spec.target)) > SMEM_STATIC:
        raise FuselmError(f"{n}: {layout.group} query heads per KV head of {hd} need {need} bytes of shared memory "
                          f"per warp in the attention kernel; at most {SMEM_STATIC} are supported")
    if d["op"] == "paged_attention":
        return _paged(spec, params, layout)
    split = layout.split_pass
    nchunk = -(-ctx // split.chunk)
    record = (hd + 3) // 4 * 4 + 4                                      # Record<HD>::FLOATS
    wide = layout.wide_split() if tokens == 1 else None
    if wide and wide.start < ctx:   # its chunks cover the cache, so it may serve any position
        wide = WideSplit(wide.start, min(wide.until, ctx), wide.pass_, wide.warps, -(-ctx // wide.chunk))
    else:
        wide = None
    threads, single_threads = layout.split_warps * 32, layout.single_warps * 32
    combine_threads = tuning.attn_combine_warps * 32
    single_until = min(layout.single_until, ctx)
    rows = prefill_rows(layout, tokens, tuning) if tokens > 1 else None
    name, source = render(
        "attention.cu.j2", "attention", f"h{H}_kv{KV}_d{hd}" + ("_fp8" if cache.fp8 else ""), params=params.decls, H=H, KV=KV, HD=hd,
        chunk=split.chunk, split_pass=split.type, nchunk=nchunk, window=int(a.get("window") or 0),
        scale=cexpr.float_literal(a["scale"]), softcap=cexpr.float_literal(a.get("softcap") or 0.0),
        threads=threads, combine_warps=tuning.attn_combine_warps, combine_threads=combine_threads,
        combine_group=tuning.attn_combine_group, single_threads=single_threads,
        single_pass=layout.single_pass.type, q=params.ref(q), kc=params.ref(kc), vc=params.ref(vc),
        pos=params.ref(pos), out=params.ref(n, written=True),
        ws=params.extra("float*", "workspace") if tokens == 1 else None,   # the split's records
        tokens=tokens, wide=wide, rows=rows and {"pass_": rows[0].type, "tokens": rows[1], "threads": rows[2] * 32},
        paged=None, sinks=sinks_arg(G, n, params))
    args = params.values
    if tokens > 1:
        grid, threads = ((KV, tokens // rows[1]), rows[2] * 32) if rows else ((KV, "T"), single_threads)
        return KernelSource(name, "attention", source, launch.nodes, [Launch(f"{name}_prefill", grid, threads, args)],
                            launch.layer, passes={"prefill": rows[0] if rows else layout.single_pass})
    split_launches = [Launch(f"{name}_split", (KV, nchunk), threads, args),
                      Launch(f"{name}_combine", (H, 1), combine_threads, args)]
    variants = []
    if single_until > 0:
        variants.append(Variant("single", single_until, [Launch(f"{name}_single", (KV, 1), single_threads, args)],
                                "attention in one launch per layer, a block per KV head (<kernel>_single)"))
    if wide and wide.start > single_until:
        variants.append(Variant("split", wide.start, [Launch(l.function, l.grid, l.block, args) for l in split_launches],
                                "split + combine, as beyond the wide split"))
        variants.append(Variant("wide", wide.until,
                                [Launch(f"{name}_split_wide", (KV, wide.nchunk), wide.threads, args),
                                 Launch(f"{name}_combine_wide", (H, 1), combine_threads, args)],
                                f"split + combine in chunks of {wide.chunk} positions, one wave (<kernel>_split_wide)"))
    passes = {"split": split, "one launch": layout.single_pass, **({"wide split": wide.pass_} if wide else {})}
    order = [f"{name}_{f}" for f in ("split", "combine", *(("split_wide", "combine_wide") if wide else ()), "single")]
    return KernelSource(name, "attention", source, launch.nodes, split_launches, launch.layer,
                        workspace_floats=H * nchunk * record, variants=variants, passes=passes, source_order=order)


def paged_pass(kv: int, head_dim: int, group: int, target: Target, tuning: Tuning,
               cache: str = "KvBf16") -> tuple[Pass, int]:
    """The paged kernel's pass and warps: attn_paged_warps (fewer where their softmax states
    would not fit), the one-launch pass's rows per lane, over rows of `cache` (its chunk is the
    same for every cache). A KV page holds whole chunks of it."""
    warps = warps_fitting(tuning.attn_paged_warps, head_dim, group, target)
    return pass_of(kv, head_dim, group, warps, tuning.attn_single_rows, target, cache=cache), warps


def _paged_split(spec: KernelSpec, params: Params, layout: Layout, walk: Pass, warps: int) -> KernelSource:
    """A PAGED_ATTENTION node's kernels for a step of one token (one sequence decoding alone):
    the split over chunks of the paged pass, each inside one page, and the combine; one form
    for every position (the batch engine's graphs take no variants)."""
    G, launch, ctx, tuning = spec.G, spec.launch, spec.ctx, spec.tuning
    (n,) = launch.nodes
    q, kc, vc, pos, pages = G.nodes[n]["inputs"][:5]
    a = G.nodes[n]["attrs"]
    H, KV, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    nchunk, record = -(-ctx // walk.chunk), (hd + 3) // 4 * 4 + 4            # Record<HD>::FLOATS
    combine_threads = tuning.attn_combine_warps * 32
    name, source = render(
        "attention.cu.j2", "attention", f"h{H}_kv{KV}_d{hd}_paged{a['page']}_t1{_fp8_suffix(layout)}",
        params=params.decls, H=H, KV=KV,
        HD=hd, chunk=walk.chunk, split_pass=walk.type, nchunk=nchunk, window=int(a.get("window") or 0),
        scale=cexpr.float_literal(a["scale"]), softcap=cexpr.float_literal(a.get("softcap") or 0.0),
        threads=warps * 32, combine_warps=tuning.attn_combine_warps, combine_threads=combine_threads,
        combine_group=tuning.attn_combine_group, q=params.ref(q), kc=params.ref(kc), vc=params.ref(vc),
        pos=params.ref(pos), out=params.ref(n, written=True), ws=params.extra("float*", "workspace"), tokens=1,
        paged={"page": a["page"], "pages": params.ref(pages)}, sinks=sinks_arg(G, n, params))
    launches = [Launch(f"{name}_split", (KV, nchunk), warps * 32, params.values),
                Launch(f"{name}_combine", (H, 1), combine_threads, params.values)]
    return KernelSource(name, "attention", source, launch.nodes, launches, launch.layer,
                        workspace_floats=H * nchunk * record, passes={"split": walk})


def _fp8_suffix(layout: Layout) -> str:
    """"_fp8" in the names of kernels that read fp8 cache rows."""
    return "" if layout.cache == "KvBf16" else "_fp8"


def _paged(spec: KernelSpec, params: Params, layout: Layout) -> KernelSource:
    """The kernel of a PAGED_ATTENTION node: a block per KV head and token, each token walking its
    own sequence's rows through its page table (templates/attention.cuh: attention_paged)."""
    G, launch, tokens = spec.G, spec.launch, spec.tokens
    (n,) = launch.nodes
    q, kc, vc, pos, pages = G.nodes[n]["inputs"][:5]
    a = G.nodes[n]["attrs"]
    H, KV, hd, page = a["n_heads"], a["n_kv_heads"], a["head_dim"], a["page"]
    walk, warps = paged_pass(KV, hd, layout.group, spec.target, spec.tuning, layout.cache)
    if page % walk.chunk:
        raise FuselmError(f"{n}: pages of {page} rows are no multiple of the attention pass's {walk.chunk}-row "
                          f"chunks (fewer attn_paged_warps make them shorter)")
    if tokens == 1:
        return _paged_split(spec, params, layout, walk, warps)
    name, source = render(
        "attention.cu.j2", "attention", f"h{H}_kv{KV}_d{hd}_paged{page}{_fp8_suffix(layout)}", params=params.decls,
        H=H, KV=KV, HD=hd,
        scale=cexpr.float_literal(a["scale"]), softcap=cexpr.float_literal(a.get("softcap") or 0.0),
        window=int(a.get("window") or 0), single_threads=warps * 32, single_pass=walk.type,
        q=params.ref(q), kc=params.ref(kc), vc=params.ref(vc), pos=params.ref(pos), out=params.ref(n, written=True),
        tokens=tokens, paged={"page": page, "table": fixed_table(G, pages), "pages": params.ref(pages)},
        sinks=sinks_arg(G, n, params))
    return KernelSource(name, "attention", source, launch.nodes,
                        [Launch(f"{name}_paged", (KV, "T"), warps * 32, params.values)], launch.layer,
                        passes={"paged": walk})

"""The gemm family: a gemv kernel's nodes for a step of several tokens (a prompt's batched
prefill). Each block streams its tile's weight rows once for all the step's tokens, on tensor
cores (templates/gemm.cuh), then runs the gemv epilogue for every (row, token) of its tile.

The tokens' vectors reach the tensor cores as bf16 hi and lo words (float32 accuracy in two
products). Converting them is as much work per chunk as the products, and every block of a
kernel needs the same ones: so a launch of its own (`<kernel>_stage`, a block per token) converts
them once, with the norm gain and sums of squares of a prologue, and the gemm's blocks copy each
chunk with cp.async (no registers, one round trip).

Quantized weights stay in their bytes: a tile's lanes load their codes of each group of 32, which
reach the tensor cores as bf16 integers (exact), and each group's sums are scaled in float32
(templates/gemm.cuh, QuantTile), so the products keep the accuracy of the bf16 tiles' and each
weight byte streams once per step. Their kernels stage the vectors in the codes' order.

On Hopper (sm_90) a kernel whose weights are all bf16 takes the `wgmma` form
(templates/gemm_wgmma.cuh): the vectors staged once in bf16 (no lo half: the accuracy of a bf16
transformers run), tiles of 128 weight rows x the step's tokens multiplied by warpgroup tensor
cores, both operands copied into STAGES shared-memory slots by a producer warpgroup (cp.async,
mbarriers between it and the two consumer warpgroups: every slot in flight at once). With
gemm_quant_wgmma, a kernel whose weights are all quantized takes it too: each consumer thread
loads its rows' codes itself, dequantizes them to bf16 (as a dequantize-then-bf16 run would) and
hands them to wgmma as registers, and the vectors are staged in the codes' order. Other GPUs,
and the rest of the quantized kernels, take the mma.sync form.

A block walks its k in chunks, one memory round trip each, so a kernel lasts at least its chunks'
round trips however many blocks run. Where a kernel has few tiles (short outputs: the O and down
projections) and long rows, split-K cuts that chain: `splits` blocks share a tile, each over a
slice of its k, and the last to finish adds their slices (in a fixed order) and runs the epilogue.
A wgmma kernel first cuts such tiles along the tokens instead (wgmma_plan): a block then takes
`columns` of the step's tokens."""
from __future__ import annotations

import networkx as nx

from ..compiler.kernels import ScheduledKernel, gemv_parts, zip_sets
from ..dsl import Kind
from .gemv import format_groups, input_vector, shape_name, weight_format, zip_contexts
from .kernel import KernelSource, KernelSpec, Launch
from .params import Params
from .render import render
from .tuning import SMEM_STATIC, Target, Tuning

STAGE_THREADS = 256
WGMMA_ROWS = 128            # weight rows per wgmma tile: two warpgroups of 64
WGMMA_THREADS = 384         # two consumer warpgroups (the epilogue's 256 threads) and a producer
WGMMA_CONSUMERS = 256       # (gemm_wgmma.cuh: WGMMA_CONSUMERS)
WGMMA_MAX_TOKENS = 256      # the widest wgmma (m64n256k16): a block's tokens at most
WGMMA_MAX_STAGES = 8
# the widest column tile of quantized rows: their codes and weights in registers beside 64 tokens'
# accumulators more would spill (ptxas, 168 registers a thread at 384 threads)
WGMMA_QUANT_MAX_TOKENS = 128


def slots(tuning: Tuning) -> int:
    """Rows of each member per block: 16 per warp (an mma's rows)."""
    return 16 * tuning.gemm_warps


def chunk(K: int) -> int:
    """k per staged chunk: 128 where the rows allow (a round trip to memory per chunk)."""
    return next(kc for kc in (128, 64, 32) if K % kc == 0)


def smem_bytes(K: int, members: int, tokens: int, tuning: Tuning, grouped: bool = False,
               columns: int | None = None) -> int:
    """Bytes of shared memory of a mma.sync block taking `columns` of the step's `tokens` (all of
    them by default): the staged chunk (hi and lo words, StagedChunk, and `grouped`, a sum per
    group of 32 and token) and the dot products of the tile share memory; then the step's
    per-token sums of squares."""
    columns = columns or tokens
    entries = chunk(K) // 8
    staged = 2 * columns * (entries + (12 - entries % 8) % 8) * 16 + (4 * columns * chunk(K) // 32 if grouped else 4)
    return max(staged, members * slots(tuning) * columns * 4) + 4 * tokens


def _column_widths(tokens: int) -> list[int]:
    """The tokens a mma.sync block may take of a step: all, then halves while they stay whole
    token tiles of 8."""
    widths = [tokens]
    while widths[-1] % 16 == 0:
        widths.append(widths[-1] // 2)
    return widths


def mma_columns(K: int, members: int, tokens: int, tuning: Tuning, grouped: bool = False) -> int | None:
    """The tokens a mma.sync block takes of a step of `tokens`: all of them where its tile and
    staged chunk fit the static shared memory, else the widest half, quarter, ... (whole tiles
    of 8) that fits; None where none does."""
    return next((c for c in _column_widths(tokens) if smem_bytes(K, members, tokens, tuning, grouped, c) <= SMEM_STATIC),
                None)


def splits(K: int, tiles: int, tuning: Tuning) -> int:
    """How many blocks share each of a kernel's `tiles` tiles, each over a slice of its K: the
    fewest that give gemm_blocks blocks, among those that cut K into equal slices of at least
    gemm_min_chunks chunks (1: no split)."""
    chunks = K // chunk(K)
    fitting = [s for s in range(1, chunks // tuning.gemm_min_chunks + 1) if chunks % s == 0]
    return next((s for s in fitting if tiles * s >= tuning.gemm_blocks), fitting[-1] if fitting else 1)


def grouped(G: nx.DiGraph, launch: ScheduledKernel) -> bool:
    """Whether a gemm kernel stages its vectors GROUPED (templates/gemm.cuh): any of its weights
    is quantized."""
    _, linears, _ = gemv_parts(G, launch.nodes)
    return any(weight_format(G, G.nodes[l]["inputs"][1]).name != "bf16" for l in linears)


def _input_width(G: nx.DiGraph, launch: ScheduledKernel) -> int:
    prologue, linears, _ = gemv_parts(G, launch.nodes)
    x = G.nodes[prologue]["inputs"][0] if prologue else G.nodes[linears[0]]["inputs"][0]
    return G.nodes[x]["shape"][-1]


def _routes_experts(G: nx.DiGraph, launch: ScheduledKernel) -> bool:
    """Whether the kernel computes a MoE router's logits (a moe node's second input)."""
    return any(G.nodes[s]["kind"] is Kind.MOE and G.nodes[s]["inputs"][1] == n
               for n in launch.nodes for s in G.successors(n))


def wgmma_form(G: nx.DiGraph, launch: ScheduledKernel, tokens: int, target: Target, tuning: Tuning) -> bool:
    """Whether this gemv kernel takes the wgmma form for steps of `tokens` tokens: on sm_90, with
    rows of whole 16-byte chunks, a multiple of 32 tokens (at most 256 a block: wgmma_plan), and
    each zip set's members dividing the 128 rows of a tile evenly (1, 2 or 4); its weights all
    bf16, or (gemm_quant_wgmma) all quantized, one format a zip set, in rows of whole 64-weight
    slots (quantized_wgmma). A MoE router keeps the float32-accurate mma.sync form: bf16 vectors
    flip the top-k choice of near ties, and with it the token's whole FFN."""
    return (target.capability == 90 and not _routes_experts(G, launch)
            and (not grouped(G, launch) or tuning.gemm_quant_wgmma and quantized_wgmma(G, launch))
            and _input_width(G, launch) % 8 == 0
            and tokens % 32 == 0
            and all(len(z.linears) in (1, 2, 4) for z in zip_sets(G, launch.nodes)))


def quantized_wgmma(G: nx.DiGraph, launch: ScheduledKernel) -> bool:
    """Whether a kernel's quantized weights can take the wgmma form (gemm_wgmma.cuh,
    WgmmaQuantRows): every weight quantized (the vectors are staged once, in the codes' order),
    one format a zip set, rows of whole 64-weight slots (two groups)."""
    _, linears, _ = gemv_parts(G, launch.nodes)
    formats = [weight_format(G, G.nodes[l]["inputs"][1]) for l in linears]
    return (all(f.name != "bf16" for f in formats) and _input_width(G, launch) % 64 == 0
            and all(len(format_groups(G, z.linears)) == 1 for z in zip_sets(G, launch.nodes)))


def vector_copy(tiles: int, tuning: Tuning) -> int:
    """How a wgmma kernel of `tiles` row tiles copies the step's vectors into its slots
    (gemm_wgmma.cuh, wgmma_tile's COPY): tuning.wgmma_vector_copy, clusters only where their
    size divides the row tiles (else one bulk copy a block). A cluster may span two zip sets:
    their slots are laid out alike, since a wgmma kernel's weights are all bf16 or all
    quantized (wgmma_form), and multicast bytes land at the same offsets in each block."""
    copy = tuning.wgmma_vector_copy
    return copy if copy <= 1 or tiles % copy == 0 else 1


def epilogue_batch(rounds: int, tuning: Tuning) -> int:
    """Rounds of a gemm block's epilogue whose operand loads go out together (gemm.cu.j2's U):
    tuning.gemm_epilogue_batch, or the largest power of two below it that divides the `rounds`."""
    return min(tuning.gemm_epilogue_batch, rounds & -rounds)


def wgmma_stages(columns: int, tokens: int, target: Target, exchanges: int = 0, rows: int = WGMMA_ROWS) -> int:
    """Pipeline slots of a wgmma tile of `columns` tokens (and `rows` weight rows in shared memory:
    none where they are quantized): as many as the device's shared memory per block holds beside
    the static arrays (1 kB of alignment, 1 kB for the pipeline's barriers and the like, the step's
    `tokens` sums of squares and the epilogue's `exchanges` arrays of a float per consumer thread),
    at most WGMMA_MAX_STAGES."""
    slot = (rows + columns) * 128
    static = 2048 + 4 * tokens + 4 * WGMMA_CONSUMERS * exchanges
    return min(WGMMA_MAX_STAGES, (target.smem_per_block - static) // slot)


def _wgmma_block_cost(slots: int, columns: int, tokens: int, split: int, tuning: Tuning) -> float:
    """A wgmma block's time in units of one 128 x 256 x 64 product (the busiest slot): its `slots`
    slots, each the longer of its products (in proportion to its columns) and its copies (the
    share wgmma_copy_share of a 128 x 256 slot's products, in proportion to its bytes); the fill
    of the pipeline and the epilogue (wgmma_block_overhead); split-K's slabs of the tile (written
    by each block, read all by the last: wgmma_slab_cost each, whatever the columns: costed in
    proportion to them, the 64-token batch step lost 5.6%, docs/performance.md)."""
    copy = tuning.wgmma_copy_share / 100
    slot = max(columns / 256, copy * (WGMMA_ROWS + columns) / (WGMMA_ROWS + 256))
    slabs = (split + 1) * tuning.wgmma_slab_cost / 100 if split > 1 else 0.0
    return slots * slot + tuning.wgmma_block_overhead / 100 + slabs


def wgmma_plan(K: int, tiles: int, tokens: int, target: Target, tuning: Tuning,
               widest: int = WGMMA_MAX_TOKENS) -> tuple[int, int]:
    """(columns, splits) of a wgmma kernel with `tiles` row tiles over a step of `tokens` tokens:
    each block takes `columns` of the tokens (a divisor of them, at least wgmma_min_columns and at
    most `widest`) and 1 / splits of
    the k (split-K, only where a block takes every token: its slabs are whole tiles), chosen for
    the fewest waves of one block per SM times the block's cost (_wgmma_block_cost). Few row
    tiles (the O, down and K/V projections) are cut along the tokens first: that re-reads each
    weight slot from L2 once per column tile, where split-K's slabs cost a tile's floats a block."""
    slots = K // 64 if K % 64 == 0 else 1        # rows of part slots stay whole
    fewest = min(tuning.wgmma_min_columns, tokens, widest)
    fitting = [c for c in range(min(tokens, widest), 15, -16) if tokens % c == 0]   # widest first
    plans = [(c, 1) for c in fitting if c >= fewest]
    if tokens <= widest:
        plans += [(tokens, s) for s in range(2, 17) if slots % s == 0 and slots // s >= tuning.gemm_min_chunks]
    if not plans:
        plans = [(fitting[0] if fitting else tokens, 1)]

    def cost(plan):
        columns, split = plan
        waves = -(-tiles * (tokens // columns) * split // target.sms)
        return waves * _wgmma_block_cost(-(-K // 64) // split, columns, tokens, split, tuning)
    return min(plans, key=cost)


def unsupported(G: nx.DiGraph, launch: ScheduledKernel, tokens: int, tuning: Tuning,
                target: Target | None = None) -> str | None:
    """Why this gemv kernel has no gemm form for steps of `tokens` tokens on `target`, or None:
    the wgmma form takes any shape it covers (wgmma_form); otherwise its rows must be whole
    32-weight spans (a warp's load of a span), the members of each zip set one format (a tile's
    mma reads one), and its tile and staged chunk must fit the static shared memory."""
    if wgmma_form(G, launch, tokens, target or Target(), tuning):
        return None
    K = _input_width(G, launch)
    if K % 32:
        return f"its rows of {K} weights are not a multiple of 32"
    sets = zip_sets(G, launch.nodes)
    for z in sets:
        if len(format_groups(G, z.linears)) > 1:
            weights = [G.nodes[l]["inputs"][1] for l in z.linears]
            return (f"the GEMVs of {', '.join(weights)} meet in one epilogue in formats "
                    f"{'/'.join(weight_format(G, w).name for w in weights)}: a tile reads one format")
    members = max(len(z.linears) for z in sets)
    if mma_columns(K, members, tokens, tuning, grouped(G, launch)) is None:
        narrowest = _column_widths(tokens)[-1]
        need = smem_bytes(K, members, tokens, tuning, grouped(G, launch), narrowest)
        return (f"{members} GEMVs meeting in one epilogue at {tokens} tokens per step need "
                f"{need} bytes of shared memory even {narrowest} tokens a block; at most {SMEM_STATIC}")
    return None


def generate(spec: KernelSpec) -> KernelSource:
    """One gemm kernel for steps of spec.tokens tokens (a multiple of 8), in its wgmma form where
    it has one (wgmma_form), and the launch staging its vectors. Where it splits K it needs runtime buffers shared by every gemm launch of the
    step: `slab_floats` of float32 slabs ("gemm_slabs") and `tile_counts` zeroed counts
    ("gemm_counts"); and always `staged_floats` of "gemm_x", the staged vectors (bf16 words: in
    the wgmma form half a float a value, else hi and lo, one float), then a float per token, the
    sums of squares, and where the weights are quantized (grouped), a float per group of 32 and
    token, the vectors' sums."""
    G, launch, tokens, tuning, target = spec.G, spec.launch, spec.tokens, spec.tuning, spec.target
    wgmma = wgmma_form(G, launch, tokens, target, tuning)
    params = Params(G)
    vec = input_vector(G, launch, params)
    K = vec["K"]
    rows = (lambda members, pairs: WGMMA_ROWS // members) if wgmma else (lambda members, pairs: slots(tuning))
    zips, grid = zip_contexts(G, launch, params, rows, batched=True)
    max_tile = max(z.R * len(z.members) for z in zips)
    group_order = grouped(G, launch)
    widest = WGMMA_QUANT_MAX_TOKENS if group_order else WGMMA_MAX_TOKENS
    if wgmma:
        columns, split = wgmma_plan(K, grid, tokens, target, tuning, widest)
    else:
        columns = mma_columns(K, max(len(z.members) for z in zips), tokens, tuning, group_order)
        split = splits(K, grid * (tokens // columns), tuning)
    copy = vector_copy(grid, tuning) if wgmma else 0
    slabs = counts = None
    if split > 1:
        slabs, counts = params.extra("float*", "gemm_slabs"), params.extra("unsigned*", "gemm_counts")
    stride = columns + 1 if wgmma else columns           # floats between a tile's rows (gemm.cu.j2: TS)
    tile_floats = split * (max_tile * stride + tokens)    # a tile's slabs: dot products and sums of squares
    staged_x = params.extra("float*", "gemm_x")
    if wgmma:   # the slots, which the tile of dot products takes over; the 1024-byte alignment
        a_rows = 0 if group_order else WGMMA_ROWS      # quantized A rows go to registers, not the slots
        stages = wgmma_stages(columns, tokens, target, sum(z.exchanges for z in zips), a_rows)
        threads = WGMMA_THREADS
        smem = max(stages * (a_rows + columns) * 128, WGMMA_ROWS * stride * 4) + 1024
        staged = tokens * (-(-K // 64) * 64 if copy else K) // 2 + tokens   # StagedBf16: slotted where copied in bulk
    else:
        stages, threads, smem = 0, tuning.gemm_warps * 32, 0
        staged = tokens * K + tokens + (tokens * K // 32 if group_order else 0)
    name, source = render("gemm.cu.j2", "gemm", shape_name(vec, zips, tokens), params=params.decls, **vec,
                          zips=zips, threads=threads, tokens=tokens, kc=0 if wgmma else chunk(K), max_tile=max_tile,
                          grid=grid, splits=split, slabs=slabs, counts=counts, tile_slab_floats=tile_floats,
                          staged_x=staged_x, stage_threads=STAGE_THREADS, grouped=str(group_order).lower(),
                          wgmma=wgmma, stages=stages, columns=columns, copy=copy,
                          batches=[epilogue_batch(z.R * columns // (WGMMA_CONSUMERS if wgmma else threads), tuning)
                                   for z in zips])
    tiles = grid * (tokens // columns)                   # (row tile, column tile) pairs: split-K's slabs
    launches = [Launch(f"{name}_stage", (tokens, 1), STAGE_THREADS, params.values),
                Launch(name, (grid, tokens // columns * split), threads, params.values, smem=smem)]
    return KernelSource(name, "gemm", source, launch.nodes, launches, launch.layer,
                        slab_floats=tiles * tile_floats if split > 1 else 0, tile_counts=tiles if split > 1 else 0,
                        staged_floats=staged)

"""One build: a DSL graph to everything its GPU program is, in one place.

    program = build_program(graph, ctx=4096, target=Target.of_device(), tuning=Tuning.from_env())
    program.decode.kernels      the decode step's kernels in launch order, the sampler last
    program.prefill             one PrefillStep per prompt step size (largest first), or none:
    program.prefill_refused     why prompts then go one token at a time
    program.decode.cubin        compiled by NVRTC (build_program(..., compile=False) leaves it None)
    build_batch(graph, ctx)     steps over many sequences' paged caches (continuous batching)

The CUDA engine loads weights, allocates and binds what this returns; `fuselm inspect` prints it;
the replay manifest hashes it.
"""
from __future__ import annotations

import functools
import itertools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from ..compiler import compile_graph, compile_graphs
from ..dsl import Graph
from ..dsl.kv_dtype import with_kv_dtype
from ..dsl.paging import is_paged, paged, table_width
from ..errors import FuselmError
from . import sample
from .attention import paged_pass
from .emit import generate
from .kernel import KernelSource
from .nvrtc import compile_cubins, options
from .program_cache import cached
from .render import headers
from .tuning import Target, Tuning

TRACE_EVENTS = 1 << 20   # block events the timeline buffer holds (fuselm_trace in common.cuh)


@dataclass
class DecodeStep:
    """The decode step: one token at a time, ending in the sampler where the graph has logits."""
    G: nx.DiGraph                  # the compiled graph
    kernels: list[KernelSource]    # launch order
    logits: str | None             # the graph value the sampler reads, None for a graph without logits
    source: str = ""               # the module's CUDA source
    cubin: bytes | None = None


@dataclass
class PrefillStep:
    """A prefill step of `tokens` prompt tokens: the graph cut down to what the KV caches need,
    or (the step that ends a prompt) the whole graph with `logits` for every token."""
    tokens: int
    G: nx.DiGraph
    kernels: list[KernelSource]
    source: str = ""
    cubin: bytes | None = None
    logits: str | None = None      # the graph value holding them, [tokens, vocab]


class NoBatchSteps(FuselmError):
    """A model whose batch steps no size has kernels for (build_batch)."""


@dataclass
class BatchStep:
    """A step of `tokens` tokens of many sequences over paged KV caches (continuous batching):
    the model's paged graph compiled for that many tokens, with logits for every one."""
    tokens: int
    page: int                      # rows per KV page
    G: nx.DiGraph
    kernels: list[KernelSource]
    logits: str                    # the graph value holding them, [tokens, vocab]
    source: str = ""
    cubin: bytes | None = None


@dataclass
class Program:
    """A model's whole GPU program for a KV cache of `ctx` rows (see the module docstring)."""
    ctx: int
    target: Target
    tuning: Tuning
    trace: bool                    # kernels record the block timeline (tools/trace.py)
    decode: DecodeStep
    prefill: list[PrefillStep] = field(default_factory=list)
    prefill_ends: list[PrefillStep] = field(default_factory=list)   # steps ending a prompt (ending_steps)
    prefill_refused: str | None = None
    compile_seconds: float = 0.0
    cached: bool = False           # the decode module came from the disk cache

    def steps(self) -> list[DecodeStep | PrefillStep]:
        return [self.decode, *self.prefill, *self.prefill_ends]

    def compile(self) -> "Program":
        """Compile every module with NVRTC, side by side in threads (cached on disk by source)."""
        t0 = time.perf_counter()
        results = compile_cubins([s.source for s in self.steps()], headers(), options(self.target.arch))
        for step, (cubin, _, cached) in zip(self.steps(), results):
            step.cubin = cubin
        self.cached = results[0][2]
        self.compile_seconds = time.perf_counter() - t0
        return self


def build_program(graph: Graph, ctx: int, target: Target | None = None, tuning: Tuning | None = None,
                  fuse: bool = True, prefill: bool = True, trace: bool = False, compile: bool = True,
                  pass_list=None, dump: str | Path | None = None, formats=None, kv: str = "bf16",
                  cache: bool = False) -> Program:
    """`graph` compiled, generated and (unless compile=False) built with NVRTC for a KV cache of
    `ctx` rows on `target` (default: the H200's sm_90, 132 SMs) with `tuning` (default: the
    defaults with $FUSELM_TUNE). A language model (inputs ids and pos, output logits) gets the
    sampler and, unless prefill=False, its batched prefill steps; pass_list replaces the
    compiler's passes and dump writes the graph after each (the decode graph only); `formats`
    maps weight names to the formats they are held in (quant/formats.py; bf16 otherwise); `kv`
    is the KV cache's dtype, "bf16" or "fp8" (dsl/kv_dtype.py). `cache` keeps the program on disk
    before NVRTC and takes it from there next time (program_cache.py: what engines load)."""
    if ctx <= 0:
        raise FuselmError(f"context must be a positive number of tokens, got {ctx}")
    if is_paged(graph):
        raise FuselmError(f"graph '{graph.name}' reads paged KV caches: its steps come from build_batch")
    if any(n.op == "all_reduce" for n in graph.nodes.values()):
        raise FuselmError(f"graph '{graph.name}' is a tensor-parallel rank's: the GPU has no all-reduce for it yet "
                          "(NCCL); the numpy reference runs the ranks (runtime/reference.py: run_ranks)")
    target = target or Target()
    tuning = tuning or Tuning.from_env()
    build = functools.partial(_build_program, graph, ctx, target, tuning, fuse, prefill, trace, pass_list, dump,
                              formats, kv)
    if cache and pass_list is None and dump is None:
        program = cached("program", (graph, ctx, target, tuning, fuse, prefill, trace, _sorted(formats), kv), build)
    else:
        program = build()
    return program.compile() if compile else program


def _sorted(formats) -> tuple:
    """A weight-format mapping as a key that pickles the same whatever order it was built in."""
    return tuple(sorted((formats or {}).items()))


def _build_program(graph, ctx, target, tuning, fuse, prefill, trace, pass_list, dump, formats, kv) -> Program:
    graph = with_kv_dtype(graph, kv)
    G = compile_graph(graph, fuse=fuse, tokens=1, pass_list=pass_list, dump=dump, formats=formats)
    kernels = generate(G, ctx=ctx, target=target, tuning=tuning)
    logits = G.graph["outputs"].get("logits")
    if logits:
        kernels.append(sample.generate(G.nodes[logits]["shape"][-1], tuning))
    program = Program(ctx, target, tuning, trace, DecodeStep(G, kernels, logits, module_source(kernels, trace)))
    language_model = logits and {n.name for n in graph.sources("input")} == {"ids", "pos"}
    if not prefill:
        program.prefill_refused = "turned off"
    elif not language_model or pass_list is not None:
        program.prefill_refused = "not a whole language model (a test graph or pass list)"
    else:
        steps = prefill_steps(graph, ctx, target, tuning, fuse, formats=formats)
        if isinstance(steps, str):
            program.prefill_refused = steps
        else:
            program.prefill = [PrefillStep(s.tokens, s.G, s.kernels, module_source(s.kernels, trace)) for s in steps]
            program.prefill_ends = ending_steps(graph, ctx, target, tuning, [s.tokens for s in steps], fuse, trace,
                                                formats)
    return program


def ending_steps(graph: Graph, ctx: int, target: Target, tuning: Tuning, sizes: list[int], fuse: bool = True,
                 trace: bool = False, formats=None) -> list[PrefillStep]:
    """The steps that end a prompt, one per size of `sizes` that has kernels: the whole graph
    (not cut down to the caches) with the logits of every token, so that the prompt's last
    token takes no decode step (one more pass over every weight) before its pick."""
    ends = []
    for tokens, G in compile_graphs(graph, sizes, fuse=fuse, formats=formats).items():
        try:
            kernels = generate(G, ctx=ctx, target=target, tuning=tuning, tokens=tokens)
        except FuselmError:
            continue
        ends.append(PrefillStep(tokens, G, kernels, module_source(kernels, trace), logits=G.graph["outputs"]["logits"]))
    return ends


def prefill_steps(graph: Graph, ctx: int, target: Target, tuning: Tuning, fuse: bool = True,
                  sizes: tuple[int, ...] | None = None, formats=None) -> list[PrefillStep] | str:
    """The prefill steps of `graph` for each of `sizes` tokens (default tuning.prefill_tokens)
    that it has kernels for (sizes whose tiles do not fit are left out), or why it has none (the
    smallest size's reason: the one no step size gets around)."""
    if target.capability < 80:
        return "the gemm kernels need tensor cores with bf16 (sm_80 on)"
    steps, why = [], None
    sizes = list(sizes or tuning.prefill_tokens)
    for tokens, G in compile_graphs(graph, sizes, fuse=fuse, state_only=True, formats=formats).items():
        if not G.graph["schedule"]:
            return f"{graph.name}: nothing to prefill (no KV cache)"
        try:
            steps.append(PrefillStep(tokens, G, generate(G, ctx=ctx, target=target, tuning=tuning, tokens=tokens)))
        except FuselmError as e:
            why = str(e)
    return steps or why


def batch_page(graph: Graph, target: Target, tuning: Tuning) -> int:
    """Rows per KV page of `graph`'s batch steps: the longest chunk of its paged attention passes
    (a chunk lies inside one page), at least 16."""
    chunks = [paged_pass(n.attrs["n_kv_heads"], n.attrs["head_dim"], n.attrs["n_heads"] // n.attrs["n_kv_heads"],
                         target, tuning)[0].chunk for n in graph.nodes.values() if n.op == "attention"]
    return max([16, *chunks])


def build_batch(graph: Graph, ctx: int, target: Target | None = None, tuning: Tuning | None = None,
                formats=None, sizes: tuple[int, ...] | None = None, compile: bool = True,
                kv: str = "bf16", cache: bool = False) -> list[BatchStep]:
    """`graph`'s batch steps (continuous batching), one per size of `sizes` tokens (default one
    token, for a sequence decoding alone, and tuning.prefill_tokens) that it has kernels for: its
    paged graph (dsl/paging.py; pages of batch_page rows, a table
    for sequences of at most `ctx` tokens) compiled with logits for every token, and (unless
    compile=False) built with NVRTC. The caches are the pool's, in `kv` ("bf16" or "fp8");
    `formats` and `cache` as build_program's."""
    if ctx <= 0:
        raise FuselmError(f"context must be a positive number of tokens, got {ctx}")
    target = target or Target()
    tuning = tuning or Tuning.from_env()
    sizes = tuple(sizes or (1, *tuning.prefill_tokens))
    build = functools.partial(_build_batch, graph, ctx, target, tuning, formats, sizes, kv)
    steps = cached("batch", (graph, ctx, target, tuning, _sorted(formats), sizes, kv), build) if cache else build()
    if compile:
        results = compile_cubins([s.source for s in steps], headers(), options(target.arch))
        for step, (cubin, _, _) in zip(steps, results):
            step.cubin = cubin
    return steps


def _build_batch(graph, ctx, target, tuning, formats, sizes, kv) -> list[BatchStep]:
    page = batch_page(graph, target, tuning)
    g = paged(with_kv_dtype(graph, kv), page, table=table_width(ctx, page))
    steps, why = [], None
    for tokens, G in compile_graphs(g, list(sizes), formats=formats).items():
        logits = G.graph["outputs"].get("logits")
        if not logits:
            raise FuselmError(f"graph '{graph.name}' has no logits: batch steps are for language models")
        try:   # a size whose tiles do not fit is left out
            kernels = generate(G, ctx=ctx, target=target, tuning=tuning, tokens=tokens)
        except FuselmError as e:
            why = why or str(e)
            continue
        steps.append(BatchStep(tokens, page, G, kernels, logits, module_source(kernels)))
    if not steps:
        raise NoBatchSteps(f"graph '{graph.name}' has no batch steps: {why}")
    return steps


def module_source(kernels: list[KernelSource], trace: bool = False) -> str:
    """One translation unit holding every distinct kernel (layers with one structure share one);
    with `trace` the block timeline is compiled in, the i-th function of the module recording id i
    (tools/trace.py: trace_ids)."""
    seen, parts = set(), [f"#define FUSELM_TRACE 1\n#define FUSELM_TRACE_EVENTS {TRACE_EVENTS}"] if trace else []
    for k in kernels:
        if k.name not in seen:
            seen.add(k.name)
            parts.append(k.source)
    source = "\n".join(parts)
    if trace:
        ids = itertools.count()
        source = re.sub(r"TRACE_BLOCK\(\);", lambda _: f"TRACE_BLOCK_AS({next(ids)});", source)
    return source


def trace_ids(kernels: list[KernelSource]) -> list[str]:
    """The function names of a traced module in the order of their ids (module_source)."""
    seen, out = set(), []
    for k in kernels:
        if k.name not in seen:
            seen.add(k.name)
            out += k.functions()
    return out

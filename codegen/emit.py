"""Code generation for a compiled graph: one KernelSource per scheduled kernel, each made by its
family's module (gemv, gemm, attention, flash, moe, rowwise), which owns its template, its launch shape
and its name."""
from __future__ import annotations

import networkx as nx
import numpy as np

from dataclasses import replace

from ..compiler.kernels import moe_parts, split_tail
from ..dsl import Kind, get
from ..errors import FuselmError
from ..quant.formats import format_of
from . import attention, flash, gemm, gemv, moe, rowwise
from .kernel import KernelSource, KernelSpec
from .params import storage_of
from .tuning import Target, Tuning

FAMILIES = {"gemv": gemv, "gemm": gemm, "rowwise": rowwise, "attention": attention, "flash": flash, "moe": moe}


def generate(G: nx.DiGraph, ctx: int, target: Target | None = None, tuning: Tuning | None = None,
             tokens: int = 1) -> list[KernelSource]:
    """CUDA for every kernel of the compiled graph `G`, with a KV cache of `ctx` rows, for
    steps of `tokens` tokens: 1 (decode), or a chunk of a prompt (batched prefill: gemv kernels
    in their gemm form, attention as flash attention where it fits, else blocks of a few tokens
    per KV head; see prefill_unsupported), on
    `target` with `tuning` (default: the H200 and the default tuning)."""
    target, tuning = target or Target(), tuning or Tuning()
    if tokens > 1 and (why := prefill_unsupported(G, tokens, tuning, target)):
        raise FuselmError(f"no steps of {tokens} tokens: {why}")
    out = []
    for launch in _launches(G, tokens):
        family = launch.family
        if tokens > 1 and family == "gemv":
            family = "gemm"
        elif tokens > 1 and family == "attention" and flash.fits(G, launch.nodes[0], tokens):
            family = "flash"
        k = FAMILIES[family].generate(KernelSpec(G, launch, ctx, tokens, target, tuning))
        k.bytes_read, k.bytes_written = _traffic(G, launch, ctx, tokens)
        out.append(k)
    return out


def _launches(G: nx.DiGraph, tokens: int) -> list:
    """The schedule's launches as the kernels run them: for steps of several tokens a gemv
    kernel's row-wise tail (compiler/fuse_tail.py) is a row-wise launch of its own after the gemm,
    which stores for it what the tail reads (the kernel's scratch)."""
    out = []
    for launch in G.graph["schedule"]:
        body, tail = split_tail(G, launch.nodes)
        if tokens == 1 or not tail:
            out.append(launch)
            continue
        inside = set(tail)
        mine = lambda values, part: [v for v in values if v in set(part)]   # noqa: E731
        out.append(replace(launch, nodes=body, writes=mine(launch.writes, body) + mine(launch.scratch, body),
                           scratch=[]))
        reads = list(dict.fromkeys(i for n in tail for i in G.nodes[n]["inputs"] if i not in inside))
        out.append(replace(launch, kernel=f"{launch.kernel}.tail", family="rowwise", nodes=tail, reads=reads,
                           writes=mine(launch.writes, tail), scratch=mine(launch.scratch, tail), early=[]))
    return out


def prefill_unsupported(G: nx.DiGraph, tokens: int, tuning: Tuning | None = None,
                        target: Target | None = None) -> str | None:
    """Why the compiled graph `G` cannot run steps of `tokens` tokens (generate(tokens > 1)) on
    `target` (default: the H200), or None."""
    for launch in G.graph["schedule"]:
        family = {"gemv": gemm, "moe": moe}.get(launch.family)
        if family and (why := family.unsupported(G, launch, tokens, tuning or Tuning(), target or Target())):
            return f"{launch.kernel}: {why}"
    return None


def _traffic(G: nx.DiGraph, launch, ctx: int, tokens: int = 1) -> tuple[int, int]:
    """Bytes a launch reads and writes per step of `tokens` tokens (weights in their formats, KV
    cache in bf16 counted at `ctx` rows; activations as one token's, for a prefill step)."""
    def nbytes(v):
        d = G.nodes[v]
        shape = [1 if s == "T" else ctx if s == "S" else s for s in d["shape"]]
        rows = 1
        if any(G.nodes[n]["kind"] is Kind.EMBEDDING and G.nodes[n]["inputs"][0] == v for n in launch.nodes):
            rows = shape[0]                         # an embedding reads one row of its table
        if d["op"] == "weight":
            return format_of(d.get("format", "bf16")).nbytes(tuple(shape)) // rows
        per = 2 if d["op"] == "state" else 4
        if d["op"] not in ("constant", "input", "state") and get(d["op"]).inplace_of is not None:
            per = 2                                 # a write into the bf16 KV cache
        return int(np.prod(shape)) * per // rows
    read = sum(nbytes(v) for v in launch.reads if G.nodes[storage_of(G, v)]["op"] != "state"
               or launch.family == "attention")
    if launch.family == "moe" and tokens == 1:   # only the chosen experts' weights are streamed
        _, n, _ = moe_parts(G, launch.nodes)
        experts = G.nodes[G.nodes[n]["inputs"][2]]["shape"][0]
        read -= sum(nbytes(w) for w in G.nodes[n]["inputs"][2:]) * (1 - G.nodes[n]["attrs"]["top_k"] / experts)
    written = sum(nbytes(v) for v in launch.writes if get(G.nodes[v]["op"]).inplace_of is None)
    return read, written

"""The compiler: a DSL graph through a list of passes to a launch schedule with a buffer plan.

Each pass is a pure function nx.DiGraph -> nx.DiGraph in its own file; the graph is validated
after every pass, and `dump=DIR` writes it after each pass (NN_<pass>.txt and .dot).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

import networkx as nx

from ..dsl import Graph
from .assign_formats import assign_formats
from .dump import dump as dump_graph
from .fuse_elementwise import fuse_elementwise
from .fuse_epilogue import fuse_epilogue
from .fuse_horizontal import fuse_horizontal
from .fuse_prologue import fuse_prologue
from .fuse_tail import fuse_tail
from .infer_shapes import infer_shapes
from .keep_state import keep_state
from .lower import to_networkx
from .plan_buffers import plan_buffers
from .plan_early_reads import plan_early_reads
from .schedule import schedule
from .validate import validate

Pass = Callable[[nx.DiGraph], nx.DiGraph]

FUSION_PASSES: list[Pass] = [fuse_horizontal, fuse_prologue, fuse_epilogue, fuse_elementwise, fuse_tail]


def passes(fuse: bool = True, tokens: int = 1, state_only: bool = False, formats=None) -> list[Pass]:
    """The pass list, in order: the weights' formats (where `formats` names any), what the state
    needs (state_only: a prompt's prefill), shapes, the fusion passes (unless fuse=False),
    schedule, early reads, buffers (the only one that `tokens` changes)."""
    return [*([partial(assign_formats, formats=formats)] if formats else []), *([keep_state] if state_only else []),
            infer_shapes, *(FUSION_PASSES if fuse else []), schedule, plan_early_reads,
            partial(plan_buffers, tokens=tokens)]


def compile_graphs(graph: Graph, sizes: list[int], fuse: bool = True, state_only: bool = False,
                   formats=None) -> dict[int, nx.DiGraph]:
    """compile_graph for each of `sizes` tokens per step. Only the buffer plan depends on the step
    size, so the passes before it run once (a model's prefill graphs: start-up time). The graphs
    share their schedule and node attributes: read-only, as every compiled graph is to codegen and
    the runtime."""
    *before, last = passes(fuse, 1, state_only, formats)
    assert last.func is plan_buffers, "the buffer plan is the last pass"
    G = compile_graph(graph, pass_list=before)
    out = {}
    for tokens in sizes:
        out[tokens] = plan_buffers(G, tokens=tokens)
        validate(out[tokens])
    return out


def compile_graph(graph: Graph, fuse: bool = True, tokens: int = 1, dump: str | Path | None = None,
                  pass_list: list[Pass] | None = None, state_only: bool = False, formats=None) -> nx.DiGraph:
    """Run the pipeline on `graph` for `tokens` tokens per step (state_only: only what the KV
    caches need, see keep_state; formats: weight name -> format, see assign_formats); the
    result carries G.graph["schedule"] and ["buffers"]."""
    G = to_networkx(graph)
    validate(G)
    if dump:
        dump_graph(G, dump, 0, "lower")
    for i, p in enumerate(pass_list if pass_list is not None else passes(fuse, tokens, state_only, formats), start=1):
        G = p(G)
        validate(G)
        if dump:
            dump_graph(G, dump, i, getattr(p, "func", p).__name__)
    return G

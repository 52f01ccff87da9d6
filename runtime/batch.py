"""Steps over many sequences at once: the engine behind continuous batching.

A step feeds a list of chunks, each some tokens of one sequence at its next positions with that
sequence's page table; prompt chunks and single decode tokens mix freely in one step. The model
runs as its paged graph (dsl/paging.py) over one pool of KV pages, which runtime/kv_pages.py
hands out. The step returns the logits of each chunk's last token.

`CpuBatchEngine` runs it on the numpy reference executor, sharing a CpuEngine's weights;
runtime/cuda_batch.py's CudaBatchEngine runs it on the compiler's kernels.

Each chunk's row is picked where the logits are (runtime/picks.py): its argmax, or where
`draws` gives the chunk a runtime/sampling.Draw, what its Sampler would draw; only the ids come
back.
A step may take some of its chunks' tokens from the step queued before it (`picks`): a chunk of
one placeholder token is fed that step's pick of one of its rows, on the engine, so the host
can queue the next step before the picks of the running one are back (server/batcher.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..dsl.paging import paged, table_width
from ..errors import FuselmError
from .picks import StepLogits, row_logprobs, row_picks
from .reference import new_state, run_graph


@dataclass(frozen=True)
class Chunk:
    """`ids` of one sequence fed at positions start, start + 1, ...; `table` is the sequence's page
    table (its pages in position order), covering at least start + len(ids) rows."""
    ids: Sequence[int]
    start: int
    table: Sequence[int]


def step_feeds(chunks: Sequence[Chunk], table_width: int) -> dict[str, np.ndarray]:
    """The paged graph's inputs for one step: ids [T], pos [T] and pages [T, table_width] (each
    token its sequence's table, padded with page 0, which no position it reads maps to)."""
    ids, pos, pages = [], [], []
    for c in chunks:
        if len(c.table) > table_width:
            raise FuselmError(f"a page table of {len(c.table)} pages is wider than {table_width}")
        row = np.zeros(table_width, np.int32)
        row[:len(c.table)] = c.table
        ids.extend(c.ids)
        pos.extend(range(c.start, c.start + len(c.ids)))
        pages.extend([row] * len(c.ids))
    return {"ids": np.asarray(ids, np.int32), "pos": np.asarray(pos, np.int32),
            "pages": np.asarray(pages, np.int32).reshape(len(ids), table_width)}


def fed_picks(chunks: Sequence[Chunk], picks) -> tuple[list[int], list[int]]:
    """The step tokens that `picks` = (step before, [(chunk, row of that step)]) feed, and the
    rows of the step before that they take; each such chunk is one placeholder token."""
    if not picks:
        return [], []
    starts = np.cumsum([0] + [len(c.ids) for c in chunks])
    if any(len(chunks[c].ids) != 1 for c, _ in picks[1]):
        raise FuselmError("a chunk fed a pick of the step before must be one token")
    return [int(starts[c]) for c, _ in picks[1]], [row for _, row in picks[1]]


class CpuBatchEngine:
    """A model's paged graph on the numpy reference executor, over a pool of `pages` KV pages of
    `page` rows; sequences are at most `max_context` tokens long."""

    device = "cpu"

    def __init__(self, graph, weights, pages: int, page: int, max_context: int):
        if pages * page < max_context:
            raise FuselmError(f"a KV pool of {pages} pages of {page} rows cannot hold one sequence of "
                              f"{max_context} tokens")
        self.graph, self.weights = paged(graph, page), weights
        self.pages, self.page, self.max_context = pages, page, max_context
        self.table_width = table_width(max_context, page)
        self.state = new_state(self.graph, pages * page)     # each cache [pages * page, KV * hd]

    PAGE_ROWS = 16     # small pages share more of a prompt prefix

    @classmethod
    def page_rows(cls, engine) -> int:
        """Rows per page beside `engine` (the same for any model on the CPU)."""
        return cls.PAGE_ROWS

    @classmethod
    def beside(cls, engine, pages: int) -> "CpuBatchEngine":
        """A batch engine on `engine`'s (a CpuEngine's) graph and weights, with the same context,
        over `pages` pages of page_rows rows."""
        return cls(engine.graph, engine.weights, pages, cls.page_rows(engine), engine.max_context)

    @staticmethod
    def row_bytes(graph, kv: str = "bf16") -> int:
        """Bytes of one KV row over every layer (float32 caches, whatever `kv` the values round to)."""
        return sum(4 * math.prod(n.shape[1:]) for n in graph.sources("state"))

    def step(self, chunks: Sequence[Chunk]) -> np.ndarray:
        """Feed `chunks` in one step; the logits [len(chunks), vocab] of each one's last token."""
        if not chunks or any(not c.ids for c in chunks):
            raise FuselmError("a batch step needs at least one chunk, each of at least one token")
        for c in chunks:
            if c.start + len(c.ids) > self.max_context:
                raise FuselmError(f"{len(c.ids)} tokens at position {c.start} pass the context of {self.max_context}")
        logits = run_graph(self.graph, self.weights, step_feeds(chunks, self.table_width), self.state)["logits"]
        last = np.cumsum([len(c.ids) for c in chunks]) - 1
        return logits[last]

    def warm_up(self) -> None:
        """Nothing to prepare on the CPU (the CUDA engine's captures its graphs)."""

    def launch(self, chunks: Sequence[Chunk], picks=None, draws=None) -> "Done":
        """step() as the batch scheduler calls it (the CUDA engine's runs while it waits), with
        `picks` fed from the step before and rows picked by `draws` (module docstring): here at
        once, its rows as StepLogits."""
        slots, rows = fed_picks(chunks, picks)
        if slots:
            best = picks[0].result().picks()
            ids = np.concatenate([np.asarray(c.ids, np.int64) for c in chunks])
            ids[slots] = best[rows]
            starts = np.cumsum([0] + [len(c.ids) for c in chunks])
            chunks = [Chunk(ids[a:b].tolist(), c.start, c.table) for c, a, b in zip(chunks, starts, starts[1:])]
        logits = self.step(chunks)
        best = row_picks(logits, draws, latest=np.array([c.ids[-1] for c in chunks]))
        return Done(StepLogits(logits, best, row_logprobs(logits, best, draws)))


class Done:
    """A batch step already run: result() gives its StepLogits."""

    def __init__(self, logits: StepLogits):
        self._logits = logits

    def result(self) -> StepLogits:
        return self._logits

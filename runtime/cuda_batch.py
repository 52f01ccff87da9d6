"""Continuous batching on the GPU: steps over many sequences' paged KV caches.

A step feeds chunks of several sequences at once (runtime/batch.py: Chunk), prompt chunks and
single decode tokens alike, through the model's batch steps (codegen/build.py: build_batch):
its paged graph compiled for steps of a few sizes, every GEMV a GEMM over the step's tokens (each
weight streams once for all the sequences), attention a block per KV head and token walking its
own sequence's pages, and logits for every token. A step takes the smallest size that holds its
tokens; the rest is padding, whose tokens write and read one page kept for them alone (the
pool's last), so the real sequences never see them.

The batch engine shares a CudaEngine's weights and constants; its KV pool is its own, bf16. One
CUDA graph per step size, captured on first use or by warm_up. launch() queues a step and
returns at once, so the host can stream the previous step's text while the GPU runs it.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..codegen.build import build_batch
from ..codegen.params import storage_of
from ..dsl.paging import table_width
from ..errors import FuselmError
from .batch import Chunk, StepLogits, step_feeds
from .launch import arena_view, bind_launch, load_cubin
from .prefill import step_buffers


POLL_S = 50e-6   # between looks at a queued step's event (a step takes milliseconds)


class CudaBatchEngine:
    """Batch steps of a CudaEngine's model over a pool of `pages` KV pages (see the module
    docstring); sequences are at most the engine's context long. `page` is the rows per page the
    kernels chose (build_batch)."""

    device = "cuda"

    def __init__(self, engine, pages: int, sizes: tuple[int, ...] | None = None):
        cp = engine.cp
        if engine.kv_dtype != "bf16":
            raise FuselmError(f"continuous batching on the GPU pages a bf16 KV cache, not {engine.kv_dtype}")
        self.engine, self.cp, self.max_context = engine, cp, engine.max_context
        program = engine.program
        self.steps = build_batch(engine.graph, self.max_context, program.target, program.tuning,
                                 formats=engine.formats, sizes=sizes)
        self.page = self.steps[0].page
        if pages * self.page < self.max_context:
            raise FuselmError(f"a KV pool of {pages} pages of {self.page} rows cannot hold one sequence of "
                              f"{self.max_context} tokens")
        self.pages, self.table_width = pages, table_width(self.max_context, self.page)
        self.sizes = tuple(sorted(s.tokens for s in self.steps))
        G = self.steps[0].G
        # each cache: [(pages + 1) * page, KV * hd] bf16; the last page takes the padding's rows
        self.states = {n: cp.zeros(((pages + 1) * self.page, G.nodes[n]["shape"][-1]), cp.uint16)
                       for n in G if G.nodes[n]["op"] == "state"}
        self.arena = cp.empty(max(s.G.graph["arena_bytes"] for s in self.steps), cp.uint8)
        self.buffers = step_buffers(cp, self.steps)
        self._steps = {s.tokens: _Step(self, s) for s in self.steps}
        cp.cuda.Device().synchronize()      # the zero-filled counters before any launch

    @classmethod
    def beside(cls, engine, pages: int, page: int) -> "CudaBatchEngine":
        """A batch engine on `engine`'s (a CudaEngine's) weights, with the same context, whose
        kernels take pages of `page` rows (codegen/build.py: batch_page says which)."""
        batch = cls(engine, pages)
        if batch.page != page:
            raise FuselmError(f"the batch kernels take KV pages of {batch.page} rows, not {page}")
        return batch

    def warm_up(self) -> None:
        """Run every step size once (one token on page 0, the rest padding) and the picks on its
        rows: the CUDA graphs are captured and CuPy's kernels for the picks compiled before the
        first request waits for them (seconds on a fresh machine). Leaves page 0's first row
        written, which any sequence given page 0 writes again before reading it."""
        for size in self.sizes:
            logits = self._steps[size].run(step_feeds([Chunk([0], 0, [0])], self.table_width), np.array([0])).result()
            logits.finite(), logits.argmax(), logits.row(0)

    @staticmethod
    def row_bytes(graph) -> int:
        """Bytes of one KV row over every layer (bf16 caches)."""
        return sum(2 * n.shape[-1] for n in graph.sources("state"))

    @property
    def step_tokens(self) -> int:
        """The most tokens one step takes."""
        return self.sizes[-1]

    def step(self, chunks: Sequence[Chunk]) -> np.ndarray:
        """Feed `chunks` in one step; the logits [len(chunks), vocab] of each one's last token."""
        return self.launch(chunks).result().rows.get()

    def launch(self, chunks: Sequence[Chunk]) -> "Queued":
        """Queue step(chunks) on the engine's stream and return at once; its result() waits and
        gives the rows as StepLogits, left on the GPU (greedy picks without copying them)."""
        tokens = sum(len(c.ids) for c in chunks)
        if not chunks or any(not c.ids for c in chunks):
            raise FuselmError("a batch step needs at least one chunk, each of at least one token")
        if tokens > self.step_tokens:
            raise FuselmError(f"a batch step of {tokens} tokens is larger than the largest, {self.step_tokens}")
        for c in chunks:
            if c.start + len(c.ids) > self.max_context:
                raise FuselmError(f"{len(c.ids)} tokens at position {c.start} pass the context of {self.max_context}")
            if any(not 0 <= p < self.pages for p in c.table):
                raise FuselmError(f"a page table names a page outside the pool of {self.pages}")
        step = self._steps[min(s for s in self.sizes if s >= tokens)]
        last = np.cumsum([len(c.ids) for c in chunks]) - 1
        return step.run(step_feeds(chunks, self.table_width), last)


class Queued:
    """A batch step queued on the stream: result() waits for it."""

    def __init__(self, rows, done):
        self._rows, self._done = rows, done    # the logits rows [chunks, vocab], the event after them

    def result(self) -> StepLogits:
        while not self._done.done:   # polled, sleeping between: the server's HTTP thread may take the GIL
            time.sleep(POLL_S)
        return StepLogits(self._rows)


class _Step:
    """One batch step size: its module, launches and inputs (ids, pos, pages), bound to the batch
    engine's pool, arena and runtime buffers and to the CudaEngine's weights."""

    def __init__(self, batch: CudaBatchEngine, step):
        cp = batch.cp
        self.batch, self.G, self.tokens, self.kernels = batch, step.G, step.tokens, step.kernels
        self.inputs = {"ids": cp.zeros(step.tokens, cp.int32),                          # [T]
                       "pos": cp.zeros(step.tokens, cp.int32),                          # [T]
                       "pages": cp.zeros((step.tokens, batch.table_width), cp.int32)}   # [T, table]
        self.logits = arena_view(cp, batch.arena, step.G, storage_of(step.G, step.logits))
        self.logits = self.logits.reshape(step.tokens, -1)                               # [T, vocab]
        module = load_cubin(cp, step.cubin)
        self.calls = [bind_launch(module, l, self.buffer, batch.engine.pdl, tokens=step.tokens)
                      for k in step.kernels for l in k.launches]
        self._module, self._graph = module, None

    def buffer(self, value: str):
        """The device array of `value`: the engine's weights and constants, the pool's caches,
        this step's inputs, activations in the arena and the shared runtime buffers."""
        batch = self.batch
        if value in batch.buffers:
            return batch.buffers[value]
        store = storage_of(self.G, value)
        op = self.G.nodes[store]["op"]
        if op == "state":
            return batch.states[store]
        if op == "input":
            return self.inputs[store]
        if op in ("weight", "constant"):
            return batch.engine.buffer(store)
        return arena_view(batch.cp, batch.arena, self.G, store)

    def replay(self) -> None:
        """Queue the step on the inputs in place: its CUDA graph (captured on first use), or its
        launches one by one where the engine uses no graphs."""
        engine = self.batch.engine
        with engine.stream:
            if not engine.use_graph:
                for call in self.calls:
                    call(engine.stream)
                return
            if self._graph is None:
                self._graph = engine.capture([(None, None, c) for c in self.calls])
            self._graph.launch(engine.stream)

    def run(self, feeds: dict[str, np.ndarray], last: np.ndarray) -> Queued:
        """Queue one step on `feeds` (fewer tokens than the step takes: padded onto the pad page),
        then a copy of its logits rows `last` [len(last), vocab]."""
        engine, n = self.batch.engine, len(feeds["ids"])
        ids, pos = np.zeros(self.tokens, np.int32), np.zeros(self.tokens, np.int32)
        pages = np.full((self.tokens, self.batch.table_width), self.batch.pages, np.int32)
        ids[:n], pos[:n], pages[:n] = feeds["ids"], feeds["pos"], feeds["pages"]
        stream = engine.stream
        with stream:
            for name, host in (("ids", ids), ("pos", pos), ("pages", pages)):
                self.inputs[name].set(host, stream=stream)
            self.replay()
            rows = self.logits[self.batch.cp.asarray(last)]    # a copy: the next step reuses the arena
            done = self.batch.cp.cuda.Event(disable_timing=True)
            done.record(stream)
        return Queued(rows, done)

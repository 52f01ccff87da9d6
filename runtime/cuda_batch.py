"""Continuous batching on the GPU: steps over many sequences' paged KV caches.

A step feeds chunks of several sequences at once (runtime/batch.py: Chunk), prompt chunks and
single decode tokens alike, through the model's batch steps (codegen/build.py: build_batch):
its paged graph compiled for steps of a few sizes, every GEMV a GEMM over the step's tokens (each
weight streams once for all the sequences), attention a block per KV head and token walking its
own sequence's pages, and logits for every token. A step takes the smallest size that holds its
tokens; the rest is padding, whose tokens write and read one page kept for them alone (the
pool's last), so the real sequences never see them.

The batch engine shares a CudaEngine's weights and constants; its KV pool is its own, in the
engine's KV dtype (bf16, or fp8 rows with a scale per token and KV head). One CUDA graph per step size, captured on first use or by warm_up. launch() queues a step and
returns at once, so the host can stream the previous step's text while the GPU runs it.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..codegen.build import batch_page, build_batch
from ..codegen.kv_cache import graph_kv_bytes, layout_of
from ..codegen.params import storage_of
from ..dsl.paging import table_width
from ..errors import FuselmError
from .batch import Chunk, fed_picks, step_feeds
from .picks import StepLogits, logprob_rows, row_logprobs, row_picks, sampled_rows
from .engine import SamplingParams
from .sampling import ROW_PARAMS, Sampler, row_params
from .launch import arena_view
from .prefill import BoundStep, step_buffers


POLL_S = 50e-6   # between looks at a queued step's event (a step takes milliseconds)


class CudaBatchEngine:
    """Batch steps of a CudaEngine's model over a pool of `pages` KV pages (see the module
    docstring); sequences are at most the engine's context long. `page` is the rows per page the
    kernels chose (build_batch)."""

    device = "cuda"

    def __init__(self, engine, pages: int, sizes: tuple[int, ...] | None = None):
        cp = engine.cp
        self.engine, self.cp, self.max_context = engine, cp, engine.max_context
        program = engine.program
        self.steps = build_batch(engine.graph, self.max_context, program.target, program.tuning,
                                 formats=engine.formats, sizes=sizes, kv=engine.kv_dtype,
                                 cache=engine.cache_program)
        self.page = self.steps[0].page
        if pages * self.page < self.max_context:
            raise FuselmError(f"a KV pool of {pages} pages of {self.page} rows cannot hold one sequence of "
                              f"{self.max_context} tokens")
        self.pages, self.table_width = pages, table_width(self.max_context, self.page)
        self.sizes = tuple(sorted(s.tokens for s in self.steps))
        G = self.steps[0].G
        # each cache: (pages + 1) * page rows, bf16 values or fp8 rows (codegen/kv_cache.py); the
        # last page takes the padding's rows
        rows = (pages + 1) * self.page
        self.states = {}
        for n in (n for n in G if G.nodes[n]["op"] == "state"):
            lay = layout_of(G, n)
            self.states[n] = cp.zeros((rows, lay.stride), cp.uint8) if lay.fp8 else cp.zeros((rows, lay.width), cp.uint16)
        self.arena = cp.empty(max(s.G.graph["arena_bytes"] for s in self.steps), cp.uint8)
        self.buffers = step_buffers(cp, self.steps)
        T = self.sizes[-1]
        self.last = cp.zeros(T, cp.int32)       # [chunks] the logits rows a step returns
        self.slots = cp.zeros(T, cp.int32)      # [picks] the tokens fed a pick of the step before
        self.rows = cp.zeros(T, cp.int32)       # [picks] ... and that step's rows they take
        self.sampled = cp.zeros(T, cp.int32)    # [draws] the rows picked by a draw
        self.asked = cp.zeros(T, cp.int32)      # [logprobs] the rows whose logprobs are asked for
        self.draw_params = cp.zeros(len(ROW_PARAMS) * T, cp.float64)   # [ROW_PARAMS, draws] their numbers
        self._staging, self._turn = [_Staging(cp, T, self.table_width) for _ in range(2)], 0
        self._steps = {s.tokens: _Step(self, s) for s in self.steps}
        cp.cuda.Device().synchronize()      # the zero-filled counters before any launch

    @staticmethod
    def page_rows(engine) -> int:
        """Rows per page of the batch kernels beside `engine`: whole chunks of the paged attention
        pass (codegen/build.py: batch_page)."""
        return batch_page(engine.graph, engine.program.target, engine.program.tuning)

    @classmethod
    def beside(cls, engine, pages: int) -> "CudaBatchEngine":
        """A batch engine on `engine`'s (a CudaEngine's) weights, with the same context."""
        return cls(engine, pages)

    def warm_up(self) -> None:
        """Run every step size once (one token on page 0, the rest padding) and the picks on its
        rows, greedy and drawn with every filter, a grammar's mask and logprobs: the CUDA graphs
        are captured and CuPy's kernels for the picks compiled before the first request waits
        for them (seconds on a fresh machine). Leaves page 0's first row written, which any
        sequence given page 0 writes again before reading it."""
        vocab = self._steps[self.sizes[0]].logits.shape[1]
        every = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                               presence_penalty=0.1, frequency_penalty=0.1)
        sampler = Sampler(every)
        sampler.record(1)
        for size in self.sizes:
            rows = min(2, size)         # a drawn row beside a greedy one where the step has room
            feeds = step_feeds([Chunk([0], 0, [0])] * rows, self.table_width)
            drawn = [sampler.draw([1], np.ones(vocab, bool), logprobs=1), None][:rows]
            for draws in (None, drawn):
                logits = self._steps[size].run(feeds, np.arange(rows), draws=draws).result()
                logits.finite(), logits.picks(), logits.row(0)

    @staticmethod
    def row_bytes(graph, kv: str = "bf16") -> int:
        """Bytes of one KV row over every layer, in caches of `kv`."""
        return graph_kv_bytes(graph, 1, kv)

    def staging(self) -> _Staging:
        """The pinned inputs for the next launch, once the copies of their last use have run."""
        host = self._staging[self._turn]
        self._turn ^= 1
        host.copied.synchronize()
        return host

    @property
    def step_tokens(self) -> int:
        """The most tokens one step takes."""
        return self.sizes[-1]

    def step(self, chunks: Sequence[Chunk]) -> np.ndarray:
        """Feed `chunks` in one step; the logits [len(chunks), vocab] of each one's last token."""
        return self.launch(chunks).result().rows.get()

    def launch(self, chunks: Sequence[Chunk], picks=None, draws=None) -> "Queued":
        """Queue step(chunks) on the engine's stream and return at once; its result() waits and
        gives the rows as StepLogits, left on the GPU, each row picked there (its argmax, or by
        its Draw in `draws`, one per chunk or None) so that only the ids come back.
        `picks` = (a Queued step before it, [(chunk, row of that step)]): those one-token chunks
        are fed that step's picks on the GPU (runtime/batch.py)."""
        tokens = sum(len(c.ids) for c in chunks)
        if not chunks or any(not c.ids for c in chunks):
            raise FuselmError("a batch step needs at least one chunk, each of at least one token")
        if tokens > self.step_tokens:
            raise FuselmError(f"a batch step of {tokens} tokens is larger than the largest, {self.step_tokens}")
        for c in chunks:
            if c.start + len(c.ids) > self.max_context:
                raise FuselmError(f"{len(c.ids)} tokens at position {c.start} pass the context of {self.max_context}")
        feeds = step_feeds(chunks, self.table_width)
        if feeds["pages"].min() < 0 or feeds["pages"].max() >= self.pages:   # one look at every table
            raise FuselmError(f"a page table names a page outside the pool of {self.pages}")
        step = self._steps[min(s for s in self.sizes if s >= tokens)]
        slots, rows = fed_picks(chunks, picks)
        fed = (picks[0].best, slots, rows) if slots else None
        return step.run(feeds, np.cumsum([len(c.ids) for c in chunks]) - 1, fed, draws)


class _Staging:
    """Pinned host arrays for one step's inputs, so that their copies queue behind the running
    step instead of waiting for it (a copy from pageable memory may wait for the stream), and
    the event after those copies: two take turns, each written again once its last copies ran."""

    def __init__(self, cp, tokens: int, table_width: int):
        import cupyx
        self.ids = cupyx.empty_pinned(tokens, np.int32)
        self.pos = cupyx.empty_pinned(tokens, np.int32)
        self.pages = cupyx.empty_pinned((tokens, table_width), np.int32)
        self.last = cupyx.empty_pinned(tokens, np.int32)
        self.slots = cupyx.empty_pinned(tokens, np.int32)
        self.rows = cupyx.empty_pinned(tokens, np.int32)
        self.sampled = cupyx.empty_pinned(tokens, np.int32)
        self.asked = cupyx.empty_pinned(tokens, np.int32)
        self.draw_params = cupyx.empty_pinned(len(ROW_PARAMS) * tokens, np.float64)
        self.copied = cp.cuda.Event(disable_timing=True)
        self.copied.record()


class Queued:
    """A batch step queued on the stream: result() waits for it. `best`: its rows' argmax [chunks]
    on the GPU, which a later step's picks read."""

    def __init__(self, rows, best, done, logprobs=None):
        self._rows, self.best, self._done = rows, best, done   # logits rows [chunks, vocab]; the event after
        self._logprobs = logprobs

    def result(self) -> StepLogits:
        while not self._done.done:   # polled, sleeping between: the server's HTTP thread may take the GIL
            time.sleep(POLL_S)
        return StepLogits(self._rows, self.best, self._logprobs)


class _Step(BoundStep):
    """One batch step size (a BoundStep) with the tokens' page tables, on the batch engine's pool,
    arena and runtime buffers and the CudaEngine's weights."""

    def __init__(self, batch: CudaBatchEngine, step):
        self.batch = batch
        self.pages = batch.cp.zeros((step.tokens, batch.table_width), batch.cp.int32)   # [T, table]
        super().__init__(batch.engine, batch.arena, batch.buffers, step)
        self.logits = arena_view(batch.cp, batch.arena, step.G, storage_of(step.G, step.logits))
        self.logits = self.logits.reshape(step.tokens, -1)                               # [T, vocab]

    def buffer(self, value: str):
        """BoundStep's, but the page tables and the pool's caches."""
        if value not in self.buffers:
            store = storage_of(self.G, value)
            if store == "pages":
                return self.pages
            if self.G.nodes[store]["op"] == "state":
                return self.batch.states[store]
        return super().buffer(value)

    def run(self, feeds: dict[str, np.ndarray], last: np.ndarray, fed=None, draws=None) -> Queued:
        """Queue one step on `feeds` (fewer tokens than the step takes: padded onto the pad page),
        then a copy of its logits rows `last` [len(last), vocab], their picks (by `draws`,
        runtime/picks.row_picks) and the logprobs asked for. `fed` = (best, slots, rows): token
        slots whose ids are best[rows], the picks of a step before on the same stream. Nothing
        here waits for the GPU (but the copies of penalties and grammar masks: sampling.py)."""
        batch, cp, stream = self.batch, self.batch.cp, self.engine.stream
        T, n = self.tokens, len(feeds["ids"])
        host = batch.staging()

        def put(values, name, device=None):   # through host's pinned array `name` to the device's
            values = np.asarray(values)
            staged = getattr(host, name)[:values.size]
            staged.reshape(values.shape)[...] = values
            device = getattr(batch, name)[:values.size] if device is None else device
            device.set(staged, stream=stream)
            return device
        ids, pos, pages = host.ids[:T], host.pos[:T], host.pages[:T]
        ids[n:], pos[n:], pages[n:] = 0, 0, batch.pages            # padding: the pad page
        ids[:n], pos[:n], pages[:n] = feeds["ids"], feeds["pos"], feeds["pages"]
        sampled, chosen = sampled_rows(draws)
        asked = logprob_rows(draws)
        with stream:
            for device, values in ((self.ids, ids), (self.pos, pos), (self.pages, pages)):
                device.set(values, stream=stream)
            try:
                last = put(last.astype(np.int32), "last")
                if fed:
                    best, slots, rows = fed
                    self.ids[put(slots, "slots")] = best[put(rows, "rows")]
                index = put(sampled, "sampled") if sampled else None
                params = put(row_params(chosen), "draw_params").reshape(len(ROW_PARAMS), -1) if sampled else None
                asked = put(asked, "asked") if asked else None
            finally:   # whatever was queued from `host` is behind this event
                host.copied.record(stream)
            latest = self.ids[last] if any(d and d.pending for d in draws or ()) else None   # [chunks] last fed ids
            self.capture()            # where the engine uses graphs and this step has none yet
            self.replay()
            rows = self.logits[last]    # a copy: the next step reuses the arena
            best = row_picks(rows, draws, params, index, latest)
            logprobs = row_logprobs(rows, best, draws, asked)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
        return Queued(rows, best, done, logprobs)

"""Batched prefill: a prompt's tokens, many at a time, through CUDA graphs that fill the KV caches
and, in the step that ends the prompt, give its last token's logits.

A prompt's tokens are run for the cache rows they leave, not for logits, so the prefill graph is
the model's graph compiled for steps of several tokens and cut down to what the caches need
(compiler: state_only), but for the step that ends the prompt: the whole graph with the logits
of every token (codegen/build.ending_steps), whose row of the last token the decode step's
sampler picks from, so the first answer token costs no decode step (a pass over every weight)
of its own. Its GEMVs become GEMMs that stream each weight once per step
instead of once per token (codegen's gemm family), and attention runs one block per KV head and
token. It shares the decode engine's weights, constants and caches; it has its own arena and its
own ids / positions.

The graph is compiled once per step size (codegen's Tuning.prefill_tokens: 256, 64 and 32), and
once more per size in its form that ends a prompt. A step costs about the same however few of
its tokens are real, and a step of 64 costs less than two of 32 (each weight streams once for
all of them), so a prompt goes in steps of the largest size
while more remain, then in the smallest step that holds the rest (step_sizes). The last step is
padded: the padding's cache rows lie past the prompt, where the decode steps overwrite each row
before any step reads it.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..codegen.build import PrefillStep
from ..codegen.gemv import block_counts
from ..codegen.kv_cache import staging_sizes
from ..codegen.params import storage_of
from ..errors import FuselmError
from .launch import arena_view, bind_launch, load_cubin


def step_sizes(n: int, room: int, sizes: tuple[int, ...]) -> list[int]:
    """The steps, in order, that feed `n` prompt tokens where `room` cache rows are left: steps of
    the largest size while more tokens remain than it holds, then the smallest one that holds the
    rest. No step ends past the cache; where none fits, the list stops short (the tokens it leaves
    go one at a time). Near the end of the cache that greedy choice covers as many tokens as any
    when each size divides the next larger one (the default 64, 32); with sizes such as 64, 48 it
    may leave tokens that two smaller steps would have taken."""
    steps = []
    while n > 0:
        fitting = [s for s in sizes if s <= room]
        if not fitting:
            break
        holding = [s for s in fitting if s >= n]
        step = min(holding) if holding else max(fitting)
        steps.append(step)
        n, room = n - step, room - step
    return steps


def step_buffers(cp, steps) -> dict:
    """The runtime buffers that steps of several tokens (prefill or batch steps, run one after
    another on one stream) share, each as large as the largest step needs."""
    kernels = [k for s in steps for k in s.kernels]
    return {
        # the moe kernels' activations of every expert for every token of the step
        "workspace": cp.empty(max([k.workspace_floats for k in kernels] + [1]), cp.float32),
        # split-K gemm tiles: each block's slice of the dot products, and per tile a count of
        # the blocks done, which the last one leaves at 0
        "gemm_slabs": cp.empty(max([k.slab_floats for k in kernels] + [1]), cp.float32),
        "gemm_counts": cp.zeros(max([k.tile_counts for k in kernels] + [1]), cp.uint32),
        # the step's vectors as the gemms stage them, and their sums of squares per token
        "gemm_x": cp.empty(max([k.staged_floats for k in kernels] + [1]), cp.float32),
        # fp8 cache writes: the gemm blocks' staged values, and per (token, head) the blocks
        # counted in (the last one writes the head and leaves 0)
        "kv_stage": cp.empty(max(staging_sizes(s.G)[0] for s in steps), cp.float32),
        "block_counts": cp.zeros(max(block_counts(s.G) for s in steps), cp.uint32),
    }


class Prefill:
    """The prefill graphs of a CudaEngine's model, one per step size, bound to the engine's
    buffers (see the module docstring); `steps` are its Program's, compiled. The steps run one
    after another on the engine's stream, so they share one arena and the runtime buffers."""

    def __init__(self, engine, steps: list[PrefillStep], ends: list[PrefillStep] = ()):
        cp = engine.cp
        # A weak reference: the engine holds this object, and a cycle would keep both (and every
        # weight) alive after the engine is dropped, until the garbage collector ran.
        self.engine = weakref.proxy(engine)
        self.sizes = tuple(s.tokens for s in steps)
        every = [*steps, *ends]
        self.arena = cp.empty(max([s.G.graph["arena_bytes"] for s in every] + [256]), cp.uint8)
        self.buffers = step_buffers(cp, every)
        self.workspace = self.buffers["workspace"]
        self.steps = {s.tokens: _Step(self.engine, self.arena, self.buffers, s) for s in steps}
        # by size, the steps that end a prompt, with the logits of their tokens (build.ending_steps)
        self.ends = {s.tokens: _Step(self.engine, self.arena, self.buffers, s) for s in ends}

    def plan(self, tokens: int, start: int) -> list[int]:
        """The step sizes that feed `tokens` prompt tokens from position `start` (step_sizes)."""
        return step_sizes(tokens, self.engine.max_context - start, self.sizes)

    def capture(self) -> None:
        """Capture every step's CUDA graph now (run() otherwise does on first use)."""
        for step in [*self.steps.values(), *self.ends.values()]:
            step.capture()

    def plan_to_logits(self, n: int, start: int) -> list[int] | None:
        """The steps (plan) of a whole prompt of `n` tokens from position `start` whose last
        step gives their logits, or None where that cannot be: a one-token prompt (a decode step
        costs less than a step of 32), a prompt the steps cannot hold to its end (the cache ends
        too soon), or a last step size without a form that ends a prompt."""
        sizes = self.plan(n, start)
        return sizes if n > 1 and sum(sizes) >= n and sizes[-1] in self.ends else None

    def run_to_logits(self, ids, start: int, sizes: list[int]):
        """Queue the steps `sizes` (plan_to_logits) over `ids` from position `start`; the logits
        [vocab] (float32, on the device) of the last token, once the steps have run."""
        first = sum(sizes[:-1])
        self._run_steps(ids[:first], start, sizes[:-1])
        end = self.ends[sizes[-1]]
        end.run(ids[first:], start + first)
        return end.logits_rows(len(ids) - first)[-1]

    def logits_of(self, ids, start: int) -> np.ndarray | None:
        """Every token's logits [len(ids), vocab] of `ids` from position `start`, each step of the
        plan run in its form with logits and its rows copied to the host (perplexity); None where
        the steps cannot hold them to the end of the cache or a size has no such form."""
        sizes = self.plan(len(ids), start)
        if sum(sizes) < len(ids) or not all(size in self.ends for size in sizes):
            return None
        out, first = [], 0
        for size in sizes:
            end, chunk = self.ends[size], ids[first:first + size]
            end.run(chunk, start + first)
            out.append(end.logits_rows(len(chunk)).get(stream=self.engine.stream))
            first += size
        return np.concatenate(out)

    def run(self, ids, start: int) -> None:
        """Queue the steps that put `ids` into the caches at positions start, start + 1, ..."""
        sizes = self.plan(len(ids), start)
        if sum(sizes) < len(ids):
            raise FuselmError(f"prefill of {len(ids)} tokens from position {start} does not fit the context "
                              f"of {self.engine.max_context} in steps of {' or '.join(map(str, self.sizes))}")
        self._run_steps(ids, start, sizes)

    def _run_steps(self, ids, start: int, sizes: list[int]) -> None:
        first = 0
        for size in sizes:
            self.steps[size].run(ids[first:first + size], start + first)
            first += size


class BoundStep:
    """A compiled step of `tokens` tokens bound once to its buffers: its module and launches, its
    ids and positions; weights, constants and caches from the engine, activations in `arena`
    and the runtime `buffers` shared with the other steps that run on the same stream. Its CUDA
    graph is captured on the first run where the engine uses graphs."""

    def __init__(self, engine, arena, buffers: dict, step):
        cp = engine.cp
        self.engine, self.arena, self.buffers = engine, arena, buffers
        tokens = step.tokens
        self.tokens, self.G, self.kernels = tokens, step.G, step.kernels
        self.logits_value = step.logits   # the graph value of every token's logits, where the step has them
        self.module = load_cubin(cp, step.cubin)
        self.ids = cp.zeros(tokens, cp.int32)         # [tokens] token ids of the step
        self.pos = cp.zeros(tokens, cp.int32)         # [tokens] their positions
        self.calls = [bind_launch(self.module, l, self.buffer, engine.pdl, tokens=tokens)
                      for k in step.kernels for l in k.launches]
        self._graph = None

    def buffer(self, value: str):
        """The device array of `value`: the engine's weights, constants and caches; the step's
        ids and positions; activations in the arena and the runtime buffers."""
        engine, G = self.engine, self.G
        if value in self.buffers:
            return self.buffers[value]
        store = storage_of(G, value)
        op = G.nodes[store]["op"]
        if op == "input":
            return {"ids": self.ids, "pos": self.pos}[store]
        if op in ("weight", "constant", "state"):
            return engine.buffer(store)
        return arena_view(engine.cp, self.arena, G, store)

    def logits_rows(self, n: int):
        """The logits [n, vocab] (float32, on the device) of the first `n` tokens of the step's
        last run, where the step has logits."""
        vocab = self.G.nodes[self.logits_value]["shape"][-1]
        return self.buffer(self.logits_value)[:n * vocab].reshape(n, vocab)

    def capture(self) -> None:
        engine = self.engine
        if engine.use_graph and self._graph is None:
            with engine.stream:
                self._graph = engine.capture([(None, None, c) for c in self.calls])

    def replay(self) -> None:
        """Queue the step again, on the inputs its last run left on the device."""
        with self.engine.stream:
            if self._graph is not None:
                self._graph.launch(self.engine.stream)
            else:
                for call in self.calls:
                    call(self.engine.stream)


class _Step(BoundStep):
    """The prefill graph for steps of `tokens` tokens, which the Prefill's steps run one after
    another on the engine's stream."""

    def run(self, ids, start: int) -> None:
        """Queue one step: `ids` (at most `tokens`; the rest padding) at positions start, ..."""
        engine = self.engine
        stream = engine.stream
        chunk = np.zeros(self.tokens, np.int32)
        chunk[:len(ids)] = np.asarray(ids, np.int32)
        with stream:
            self.ids.set(chunk, stream=stream)
            self.pos.set(np.arange(start, start + self.tokens, dtype=np.int32), stream=stream)
        self.capture()                # where the engine uses graphs and this step has none yet
        self.replay()

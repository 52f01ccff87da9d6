"""Batched prefill: a prompt's tokens, TOKENS at a time, through one CUDA graph that only fills
the KV caches.

A prompt's tokens but the last are run for the cache rows they leave, not for logits, so the
prefill graph is the model's graph compiled for steps of TOKENS tokens and cut down to what the
caches need (compiler: state_only). Its GEMVs become GEMMs that stream each weight once per step
instead of once per token (codegen's gemm family), and attention runs one block per KV head and
token. It shares the decode engine's weights, constants and caches; it has its own arena and its
own ids / positions. A prompt's last step is padded: the padding's cache rows lie past the prompt,
where the decode steps overwrite each row before any step reads it.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..codegen import generate, headers, module_source
from ..codegen.knobs import env_int
from ..codegen.nvrtc import compile_cubin, options
from ..codegen.params import storage_of
from ..compiler import compile_graph
from ..errors import FuselmError
from .launch import arena_view, bind_launch, load_cubin

TOKENS = env_int("FUSELM_PREFILL_TOKENS", 32, 8, 64)   # tokens per prefill step (a multiple of 8)
if TOKENS % 8:
    raise ValueError(f"FUSELM_PREFILL_TOKENS={TOKENS}: must be a multiple of 8")


def prefill_kernels(graph, ctx: int, fuse: bool = True):
    """(compiled graph, kernels) of `graph`'s prefill for a cache of `ctx` rows; a FuselmError
    saying why where it has none."""
    G = compile_graph(graph, fuse=fuse, tokens=TOKENS, state_only=True)
    if not G.graph["schedule"]:
        raise FuselmError(f"{graph.name}: nothing to prefill (no KV cache)")
    return G, generate(G, rows=ctx, tokens=TOKENS)


def build(graph, ctx: int, arch: str, fuse: bool = True):
    """(compiled graph, kernels, cubin) of `graph`'s prefill for `arch`, or the reason it has none."""
    if int(arch.removeprefix("sm_").rstrip("a")) < 80:
        return "the gemm kernels need tensor cores with bf16 (sm_80 on)"
    try:
        G, kernels = prefill_kernels(graph, ctx, fuse)
    except FuselmError as e:
        return str(e)
    cubin, _, _ = compile_cubin(module_source(kernels), headers(), options(arch))
    return G, kernels, cubin


class Prefill:
    """The prefill graph of a CudaEngine's model, bound to the engine's buffers (see the module
    docstring); `built` comes from build()."""

    def __init__(self, engine, built):
        cp = engine.cp
        G, kernels, cubin = built
        # A weak reference: the engine holds this object, and a cycle would keep both (and every
        # weight) alive after the engine is dropped, until the garbage collector ran.
        self.engine, self.G, self.kernels, self.tokens = weakref.proxy(engine), G, kernels, TOKENS
        self.module = load_cubin(cp, cubin)
        self.arena = cp.empty(max(G.graph["arena_bytes"], 256), cp.uint8)
        self.ids = cp.zeros(TOKENS, cp.int32)         # [TOKENS] token ids of the step
        self.pos = cp.zeros(TOKENS, cp.int32)         # [TOKENS] their positions
        # the moe kernels' activations of every expert for every token of the step
        self.workspace = cp.empty(max([k.workspace_floats for k in kernels] + [1]), cp.float32)
        self.calls = [bind_launch(self.module, l, self.buffer, engine.pdl, tokens=TOKENS)
                      for k in kernels for l in k.launches]
        self._graph = None

    def buffer(self, value: str):
        """The device array of `value`: the engine's weights, constants and caches; the step's
        ids and positions; activations in this graph's own arena and workspace."""
        cp, G = self.engine.cp, self.G
        if value == "workspace":
            return self.workspace
        store = storage_of(G, value)
        op = G.nodes[store]["op"]
        if op == "input":
            return {"ids": self.ids, "pos": self.pos}[store]
        if op in ("weight", "constant", "state"):
            return self.engine.buffer(store)
        return arena_view(cp, self.arena, G, store)

    def fitting(self, tokens: int, start: int) -> int:
        """How many of `tokens` prompt tokens from position `start` whole steps take: as many as
        there are, unless the padded last step would pass the end of the caches."""
        steps = min(-(-tokens // self.tokens), (self.engine.max_context - start) // self.tokens)
        return min(tokens, steps * self.tokens)

    def capture(self) -> None:
        """Capture the step's CUDA graph now (run() otherwise does on first use)."""
        if self.engine.use_graph and self._graph is None:
            with self.engine.stream:
                self._graph = self.engine.capture([(None, None, c) for c in self.calls])

    def run(self, ids, start: int) -> None:
        """Queue the steps that put `ids` into the caches at positions start, start + 1, ..."""
        if len(ids) != self.fitting(len(ids), start):
            raise FuselmError(f"prefill of {len(ids)} tokens from position {start} does not fit the context "
                              f"of {self.engine.max_context} in steps of {self.tokens}")
        stream = self.engine.stream
        for first in range(0, len(ids), self.tokens):
            chunk = np.zeros(self.tokens, np.int32)
            part = np.asarray(ids[first:first + self.tokens], np.int32)
            chunk[:len(part)] = part
            with stream:
                self.ids.set(chunk, stream=stream)
                self.pos.set(np.arange(start + first, start + first + self.tokens, dtype=np.int32), stream=stream)
                if not self.engine.use_graph:
                    for call in self.calls:
                        call(stream)
                    continue
                self.capture()
                self._graph.launch(stream)

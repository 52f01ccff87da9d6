"""The CPU backend: the numpy reference executor behind the `Engine` protocol.

A prompt is fed as one step of T tokens (prefill); every later token is one step of its own
(decode). The KV cache lives in the executor's state buffers, `max_context` rows per layer.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

from ..dsl import Graph
from ..dsl.kv_dtype import check_kv, with_kv_dtype
from ..errors import FuselmError
from .engine import SamplingParams, check_logits, size_text, value_counts
from .reference import new_state, run_graph
from .sampling import Sampler


class CpuEngine:
    """A model graph, its float32 weights and a KV cache of `ctx` rows, run on the CPU. kv "fp8":
    the cache holds what an fp8 cache would (dsl/kv_dtype.py), kept as float32."""

    device = "cpu"

    def __init__(self, graph: Graph, weights: Mapping[str, np.ndarray], ctx: int, kv: str = "bf16"):
        if ctx <= 0:
            raise FuselmError(f"context must be a positive number of tokens, got {ctx}")
        self.kv_dtype = check_kv(kv)
        graph = with_kv_dtype(graph, kv)
        self.graph, self.weights, self.max_context = graph, weights, ctx
        self.state = new_state(graph, ctx)
        self.position = 0
        self.tokens: list[int] = []             # every id fed since reset, for the repetition penalty
        self.last_logits: np.ndarray | None = None  # [vocab] of the last position fed
        self._sampler: Sampler | None = None

    @classmethod
    def from_checkpoint(cls, ckpt, graph: Graph, ctx: int, progress: bool = True,
                        quant: str | None = None, kv: str = "bf16") -> "CpuEngine":
        """Load `ckpt`'s weights as float32 arrays and build the engine; refused before any weight
        is read when they and the KV cache would not fit in the machine's memory. `quant` gives
        the matrices the values the GPU would hold: "bf16" rounded to bf16, "q8" / "q4"
        quantized on load and dequantized (quant/quantize.py), so quality can be measured here."""
        from ..loading.checkpoint import load_weights   # deferred: written in parallel, heavy imports
        check_kv(kv)
        need, have = memory_needed(graph, ctx), physical_memory()
        if have is not None and need > have:
            raise FuselmError(f"the CPU engine needs {size_text(need)} (float32 weights and a KV cache of {ctx} "
                              f"tokens) but this machine has {size_text(have)}; lower --ctx")
        weights = load_weights(ckpt, graph, dtype=np.float32, progress=progress)
        if quant is not None:
            weights = {**weights, **as_the_gpu_holds(graph, weights, quant)}
        return cls(graph, weights, ctx, kv=kv)

    def reset(self) -> None:
        """Forget the conversation. The cache is not cleared: attention reads only rows at or
        before the current position, and each of those is written before it is read."""
        self.position = 0
        self.tokens.clear()
        self._sampler = None

    def prefill(self, ids: Sequence[int], sampling: SamplingParams) -> int:
        """Feed `ids` at the current position in one step; return the sampled next id. Starts a
        new sampler, so a seeded generation is reproducible from its prompt on."""
        if len(ids) == 0:
            raise FuselmError("empty prompt: nothing to feed")
        if self.position + len(ids) > self.max_context:
            raise FuselmError(f"prompt of {len(ids)} token{'s' * (len(ids) != 1)} at position {self.position} does not fit the "
                              f"context of {self.max_context}")
        self._sampler = Sampler(sampling)
        return self._step(ids)

    def decode(self, token: int, sampling: SamplingParams) -> int:
        """Feed one token; return the sampled next id."""
        if self.position >= self.max_context:
            raise FuselmError(f"the conversation reached the context of {self.max_context} tokens")
        if self._sampler is None or self._sampler.params != sampling:
            self._sampler = Sampler(sampling)
        return self._step([token])

    def logits_of(self, ids: Sequence[int]) -> np.ndarray:
        """Feed `ids` at the current position in one step; every position's logits [len, vocab]."""
        if self.position + len(ids) > self.max_context:
            raise FuselmError(f"{len(ids)} tokens at position {self.position} do not fit the context of {self.max_context}")
        ids_arr = np.asarray(ids, np.int32)
        pos = np.arange(self.position, self.position + len(ids_arr), dtype=np.int32)
        out = run_graph(self.graph, self.weights, {"ids": ids_arr, "pos": pos}, self.state)
        self.position += len(ids_arr)
        self.tokens.extend(int(i) for i in ids_arr)
        return out["logits"]

    def _step(self, ids: Sequence[int]) -> int:
        self.last_logits = self.logits_of(ids)[-1]
        check_logits(self.last_logits, self.position - 1)
        return self._sampler(self.last_logits, self.tokens)


def as_the_gpu_holds(graph: Graph, weights: Mapping[str, np.ndarray], quant: str) -> dict[str, np.ndarray]:
    """The quantizable matrices of `weights` as float32 holding what the GPU would hold under
    `quant` ("bf16", or an option of quant/quantize.py: on_load_formats says which weights it
    quantizes; the others stay as they are)."""
    import ml_dtypes

    from ..quant.layout import dequantize
    from ..quant.quantize import QUANT_OPTIONS, on_load_formats, quantize
    from ..compiler.assign_formats import quantizable_shapes
    if quant != "bf16" and quant not in QUANT_OPTIONS:
        raise FuselmError(f"--quant must be bf16 or one of {', '.join(QUANT_OPTIONS)}, got '{quant}'")
    shapes = quantizable_shapes(graph)
    if quant == "bf16":
        return {name: weights[name].astype(ml_dtypes.bfloat16).astype(np.float32) for name in shapes}
    return {name: dequantize(quantize(weights[name], fmt)) for name, fmt in on_load_formats(quant, shapes).items()}


def memory_needed(graph: Graph, ctx: int) -> int:
    """Bytes of the CPU engine's float32 weights and state (KV cache rows = ctx) for `graph`."""
    return 4 * sum(value_counts(graph, ctx))


def physical_memory() -> int | None:
    """The machine's memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


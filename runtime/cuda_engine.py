"""The CUDA backend: compiled kernels replayed as one CUDA graph per decode step (one graph per
schedule: kernels with variants, attention's, run different launches at different positions).

Everything a step needs lives on the GPU: weights (bf16), one arena for activations (planned by
the compiler), the KV caches (bf16, `ctx` rows), the token id and position (device int32), and
the sampler's state. The sampling kernel writes the next token id and advances the position, so
the captured graphs are replayed unchanged every step; only the sampled id is copied back.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import numpy as np

from ..codegen import Target, Tuning, build_program
from ..codegen.gemv import block_counts
from ..codegen.kv_cache import graph_kv_bytes, layout_of, staging_sizes
from ..codegen.params import storage_of
from ..codegen.sample import scratch_words
from ..compiler.assign_formats import quantizable_shapes
from ..dsl import Graph
from ..dsl.kv_dtype import check_kv, e4m3_values, quantize_heads
from ..errors import FuselmError
from ..quant.formats import QuantizedWeight, format_of
from .engine import NonFiniteLogits, SamplingError, SamplingParams, size_text
from .launch import arena_view, bind_launch, load_cubin, pdl_wanted
from .prefill import Prefill

SAMPLING_ARGS = np.dtype([("temperature", "f4"), ("top_p", "f4"), ("min_p", "f4"),
                          ("repetition_penalty", "f4"), ("top_k", "i4"), ("seed", "i4"),
                          ("step", "i4"), ("pad", "i4")])   # mirrors SamplingArgs in sampling.cuh


# Launch arguments that are the engine's own buffers (attributes of the same name), not graph values.
RUNTIME_BUFFERS = ("workspace", "seen", "sampled", "pos", "sampling_args", "sampler_scratch", "kv_stage", "block_counts")


def check_variant(kernels, variant: str | None) -> None:
    """A one-line error unless `variant` is None, "general" or the name of some kernel's variant."""
    known = {v.name for k in kernels for v in k.variants} | {"general"}
    if variant is not None and variant not in known:
        raise FuselmError(f"variant '{variant}': no kernel of this graph has it (known: {', '.join(sorted(known))})")


def check_weights(graph: Graph, weights: Mapping[str, object]) -> None:
    """A one-line error naming the first of `graph`'s weights that `weights` lacks or has in
    another shape (before anything is compiled or uploaded)."""
    for node in graph.sources("weight"):
        w = weights[node.name] if node.name in weights else None
        if w is None:
            raise FuselmError(f"missing weight '{node.name}'")
        if tuple(w.shape) != node.shape:
            raise FuselmError(f"weight '{node.name}' has shape {tuple(w.shape)}, expected {node.shape}")


def weight_bytes(graph: Graph, formats: Mapping[str, str] | None = None) -> int:
    """Bytes of `graph`'s weights on the GPU, each in its format (bf16 where `formats` names none)."""
    formats = formats or {}
    return sum(format_of(formats.get(n.name, "bf16")).nbytes(n.shape) for n in graph.sources("weight"))


def largest_bytes(graph: Graph, formats: Mapping[str, str]) -> int:
    """Bytes of the largest of `graph`'s weights that `formats` names, in its format."""
    return max((format_of(formats[n.name]).nbytes(n.shape) for n in graph.sources("weight") if n.name in formats),
               default=0)


def free_device_memory(cp) -> int:
    """Bytes the engine may still allocate: the device's free memory and what CuPy's pool holds
    unused (tests fake this figure)."""
    return cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()


def check_device_memory(cp, graph: Graph, ctx: int, resident: int = 0, extra: int = 0,
                        formats: Mapping[str, str] | None = None, kv: str = "bf16", free: int | None = None) -> None:
    """A one-line error, before anything is uploaded, when `graph`'s weights (in `formats`, bf16
    otherwise) and a KV cache of `ctx` rows in `kv` (plus `extra` bytes: the arena) do not fit
    the GPU's `free` memory (default: free_device_memory); `resident` bytes of weights are on the
    GPU already. It says which --ctx would fit, when any would."""
    weight_bytes_, kv_bytes = weight_bytes(graph, formats) - resident, graph_kv_bytes(graph, ctx, kv)
    free = free_device_memory(cp) if free is None else free
    if weight_bytes_ + kv_bytes + extra <= free:
        return
    per_token = kv_bytes // ctx if ctx else 0
    room = free - weight_bytes_ - extra
    advice = (f"lower --ctx to at most {room // per_token}" if per_token and room >= per_token
              else "the weights alone do not fit")
    raise FuselmError(f"the model needs {size_text(weight_bytes_ + kv_bytes + extra)} of GPU memory (weights "
                      f"{size_text(weight_bytes_)}, a KV cache of {ctx} tokens in {kv} {size_text(kv_bytes)}) but "
                      f"{_device_label()} has {size_text(free)} free; {advice}")


def _device_label() -> str:
    """The GPU's name for a message, or "the GPU" where the runtime cannot say (no driver)."""
    try:
        return gpu_name()
    except Exception:
        return "the GPU"


def gpu_available() -> bool:
    """Whether CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def gpu_name() -> str:
    """The name of the current CUDA device."""
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def to_bf16_bits(x):
    """float32 array (numpy or cupy) -> uint16 bfloat16 bits, round to nearest even."""
    if type(x).__module__.startswith("cupy"):
        import cupy as xp
    else:
        xp = np
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)


class CudaEngine:
    """A model compiled for the GPU. Implements runtime.engine.Engine."""
    device = "cuda"

    def __init__(self, graph: Graph, weights: Mapping[str, object], ctx: int = 4096, fuse: bool = True,
                 use_graph: bool = True, pass_list=None, variant: str | None = None,
                 batched_prefill: bool = True, tuning: Tuning | None = None, trace: bool = False,
                 kv: str = "bf16", cache_program: bool = False):
        """`cache_program` keeps the built program on disk and reads it from there next time
        (codegen/program_cache.py), as loads from a checkpoint do; tests that patch the code
        generators build afresh."""
        import cupy
        if ctx <= 0:
            raise FuselmError(f"context must be a positive number of tokens, got {ctx}")
        self.kv_dtype = check_kv(kv)
        check_weights(graph, weights)
        self.cp, self.graph, self.max_context, self.use_graph = cupy, graph, ctx, use_graph
        # None: each kernel's variant by position; a name ("single", or "general" for the launches
        # without variants): that one at every position, where a kernel has it (tests).
        self.variant = variant
        self.position = 0
        target = Target.of_device()
        self.pdl = pdl_wanted(target.capability)
        # quantized weights are read in their format (quant/formats.py), the rest as bf16
        self.formats = {n.name: weights[n.name].format for n in graph.sources("weight")
                        if isinstance(weights[n.name], QuantizedWeight)}
        # A forced variant runs only the decode graphs: prompts then go one token at a time.
        self.program = build_program(graph, ctx, target, tuning, fuse=fuse, trace=trace, pass_list=pass_list,
                                     prefill=batched_prefill and variant is None, formats=self.formats, kv=kv,
                                     cache=cache_program)
        self.cache_program = cache_program
        self.G, self.kernels = self.program.decode.G, self.program.decode.kernels
        check_variant(self.kernels, variant)
        self.logits_value = self.program.decode.logits   # None: a graph without a sampler (tests, tools)
        vocab = self.G.nodes[self.logits_value]["shape"][-1] if self.logits_value else 1
        self.traced = trace     # kernels that record the block timeline (tools/trace.py)
        self.compile_seconds, self.compile_cached = self.program.compile_seconds, self.program.cached
        self.module = load_cubin(cupy, self.program.decode.cubin)
        resident = sum(w.nbytes for w in (weights[n.name] for n in graph.sources("weight"))
                       if isinstance(w, cupy.ndarray) or isinstance(w, QuantizedWeight) and isinstance(w.data, cupy.ndarray))
        check_device_memory(cupy, graph, ctx, resident, extra=self.G.graph["arena_bytes"], formats=self.formats,
                            kv=kv)
        self._allocate(weights, vocab)
        self._bind()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # why prompts go one token at a time, or None
        self.prefill_refused = self.program.prefill_refused
        self.batched_prefill = (Prefill(self, self.program.prefill, self.program.prefill_ends)
                                if self.program.prefill else None)
        cupy.cuda.Device().synchronize()   # zero-filled buffers (counters) ready before any launch
        self._sampling: SamplingParams | None = None
        self._on_device: tuple[int, int] | None = None   # (id, position) the sampler left in ids, pos

    @classmethod
    def from_checkpoint(cls, ckpt, graph: Graph, ctx: int = 4096, fuse: bool = True,
                        quant: str | None = None, progress: bool = True, kv: str = "bf16") -> "CudaEngine":
        """Load `ckpt`'s weights and compile `graph` for this GPU. Quantized matrices of a GGUF or
        an fp8 checkpoint stay in their format where the kernels read it, the rest goes to bf16;
        `quant` "bf16" takes everything to bf16, "fp8" / "q8" / "q5" / "q4" quantize the rest on
        load, "mxfp4" a MoE's expert stacks (quant/quantize.py). Tensors go to the GPU one at a time (host memory holds one).
        Refused before any weight is read when weights and KV cache would not fit the GPU's
        free memory (a KV cache of `kv`: bf16 or fp8)."""
        import cupy
        import ml_dtypes

        from tqdm import tqdm

        from ..loading.checkpoint import gpu_formats, iter_weights, repack_margin
        from ..quant.quantize import QUANT_OPTIONS, on_load_formats, quantize
        if quant not in (None, "bf16", *QUANT_OPTIONS):
            raise FuselmError(f"--quant must be bf16 or one of {', '.join(QUANT_OPTIONS)}, got '{quant}'")
        keep = quant != "bf16"
        formats = kept = gpu_formats(ckpt, graph) if keep else {}
        if quant in QUANT_OPTIONS:     # the file's own quantized formats stay as they are
            formats = {**on_load_formats(quant, quantizable_shapes(graph)), **kept}
        # room for the repacking's temporaries too, where the file's blocks are repacked on the GPU
        margin = repack_margin(largest_bytes(graph, kept)) if kept else 0
        check_device_memory(cupy, graph, ctx, formats=formats, kv=check_kv(kv), extra=margin)
        # one tensor at a time from the (mapped) file to the GPU: host memory holds one, not all
        weights = {}
        total = weight_bytes(graph, formats)
        with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=not progress,
                  leave=False) as bar:
            # GGUF blocks go up as they are and are repacked on the GPU (quant/layout.from_gguf)
            for name, w in iter_weights(ckpt, graph, dtype=ml_dtypes.bfloat16, keep_quantized=keep, xp=cupy):
                if name in formats and not isinstance(w, QuantizedWeight):
                    w = quantize(np.asarray(w, np.float32), formats[name])
                weights[name] = (QuantizedWeight(w.format, w.shape, cupy.asarray(w.data))
                                 if isinstance(w, QuantizedWeight) else as_device(cupy, w))
                bar.update(weights[name].nbytes)
        cupy.get_default_memory_pool().free_all_blocks()          # the repacking's temporaries
        cupy.get_default_pinned_memory_pool().free_all_blocks()   # and the uploads' pinned buffers
        return cls(graph, weights, ctx=ctx, fuse=fuse, kv=kv, cache_program=True)

    # ---- memory ----
    def _allocate(self, weights: Mapping[str, object], vocab: int) -> None:
        cp, G = self.cp, self.G
        self.weights = {node.name: as_device(cp, weights[node.name]) for node in self.graph.sources("weight")}
        self.constants = {k: cp.asarray(v, cp.float32) for k, v in G.graph["constants"].items()}
        # bf16 caches [ctx, width] values; fp8 ones [ctx, stride] bytes (codegen/kv_cache.py)
        self.cache_layouts = {n.name: layout_of(G, n.name) for n in self.graph.sources("state")}
        self.states = {name: cp.zeros((self.max_context, lay.stride), cp.uint8) if lay.fp8
                       else cp.zeros((self.max_context, lay.width), cp.uint16)
                       for name, lay in self.cache_layouts.items()}
        # fp8 cache writes: each GEMV block's staged values; the blocks counted per head and
        # per row-wise tail (the last to arrive writes the head or runs the tail)
        self.kv_stage = cp.empty(staging_sizes(G)[0], cp.float32)
        self.block_counts = cp.zeros(block_counts(G), cp.uint32)
        self.arena = cp.empty(max(G.graph["arena_bytes"], 256), cp.uint8)
        self.inputs = {n.name: cp.zeros([1 if d == "T" else d for d in n.shape],
                                        cp.int32 if n.dtype == "i32" else cp.float32)
                       for n in self.graph.sources("input")}            # one token per step
        # [2] the sampler's output: the id, which is also the next step's input, and a flag set
        # when the logits it came from held NaN or inf (one device-to-host copy reads both)
        self.sampled = cp.zeros(2, cp.int32)
        self.ids = self.sampled[:1]
        if "ids" in self.inputs:
            self.inputs["ids"] = self.ids
        self.pos = self.inputs.get("pos", cp.zeros(1, cp.int32))
        self.seen = cp.zeros(vocab, cp.uint8)
        self.sampling_args = cp.zeros(SAMPLING_ARGS.itemsize, cp.uint8)
        self.sampler_scratch = cp.zeros(scratch_words(self.program.tuning), cp.uint32)
        ws = max([k.workspace_floats for k in self.kernels] + [1])
        self.workspace = cp.empty(ws, cp.float32)

    def buffer(self, value: str):
        """The device array holding graph value `value` (arena slices for activations)."""
        cp, G = self.cp, self.G
        if value == "logits":
            value = self.logits_value
        if value in RUNTIME_BUFFERS:
            return getattr(self, value)
        store = storage_of(G, value)
        op = G.nodes[store]["op"]
        if op == "weight":
            return self.weights[store]
        if op == "constant":
            return self.constants[store]
        if op == "state":
            return self.states[store]
        if op == "input":
            return self.inputs[store]
        return arena_view(cp, self.arena, G, store)

    def _bind(self) -> None:
        """Resolve every launch's arguments once: a schedule is then a flat list of calls, each
        taking the stream (launched with PDL where the GPU has it, see runtime/launch.py). Kernels
        with variants (attention) make one schedule per range of positions."""
        calls = {}                      # id(launch) -> call: schedules share the launches they have in common

        def entries(start):
            for k in self.kernels:
                for launch in k.launches_at(start) if self.variant is None else k.launches_of(self.variant):
                    if id(launch) not in calls:
                        calls[id(launch)] = self._call(launch)
                    yield k, launch, calls[id(launch)]
        starts = {0} | ({v.until for k in self.kernels for v in k.variants} if self.variant is None else set())
        self._schedules = [(start, list(entries(start))) for start in sorted(starts)]   # by first position
        self._graph_execs: dict[int, object] = {}   # first position of a schedule -> its CUDA graph

    def _call(self, launch):
        return bind_launch(self.module, launch, self.buffer, self.pdl)

    def _schedule(self, position: int) -> tuple[int, list]:
        return next((start, calls) for start, calls in reversed(self._schedules) if position >= start)

    def schedule_at(self, position: int) -> list[tuple]:
        """(KernelSource, Launch, call(stream)) of every launch of a step at `position`, in order."""
        return self._schedule(position)[1]

    # ---- execution ----
    def capture_graphs(self) -> None:
        """Capture the CUDA graph of every schedule now (step() otherwise captures each on first
        use, which a timed run should not include)."""
        if not self.use_graph:
            return
        with self.stream:
            for start, calls in self._schedules:
                self._graph_of(start, calls)
        if self.batched_prefill:
            self.batched_prefill.capture()

    def _graph_of(self, start: int, calls):
        """The CUDA graph of the schedule starting at `start`, captured on first use."""
        if start not in self._graph_execs:
            self._graph_execs[start] = self.capture(calls)
        return self._graph_execs[start]

    def capture(self, calls):
        """A CUDA graph of `calls` ((kernel, launch, call) as in schedule_at) on the engine's stream."""
        self.stream.begin_capture()
        for _, _, call in calls:
            call(self.stream)
        return self.stream.end_capture()

    def step(self) -> None:
        """One decode step at the current position on the stream: its schedule, as a CUDA graph
        when enabled (one graph per schedule, captured on first use)."""
        start, calls = self._schedule(self.position)
        with self.stream:
            if not self.use_graph:
                for _, _, call in calls:
                    call(self.stream)
                return
            self._graph_of(start, calls).launch(self.stream)

    def _set_sampling(self, sampling: SamplingParams) -> None:
        if sampling == self._sampling:
            return
        sampling.validate()
        if sampling.penalizes_answer:
            name = "presence_penalty" if sampling.presence_penalty else "frequency_penalty"
            raise SamplingError(name, f"{name} is not supported by the GPU sampler yet (the CPU backend has it)")
        self._sampling = sampling
        self._seed = sampling.seed if sampling.seed is not None else np.random.randint(0, 2**31 - 1)
        self._upload_sampling()

    def _upload_sampling(self) -> None:
        """The sampler's arguments, its step counter at the current position (each sampler run
        moves it on by one, so it stays there step after step)."""
        s, a = self._sampling, np.zeros(1, SAMPLING_ARGS)
        a["temperature"], a["top_p"], a["min_p"] = s.temperature, s.top_p, s.min_p
        a["repetition_penalty"], a["top_k"] = s.repetition_penalty, s.top_k
        a["seed"], a["step"] = self._seed, self.position
        self.sampling_args.set(a.view(np.uint8), stream=self.stream)

    def reset(self) -> None:
        """Position back to 0, no tokens seen, the sampler's random stream restarted."""
        self.position = 0
        self._on_device = None
        with self.stream:   # on the engine's stream, so it cannot race the next prefill's marks
            self.seen.fill(0)
        self._sampling = None

    def feed(self, token: int) -> None:
        """Queue one step with `token` at the current position (no host synchronisation)."""
        if self.position >= self.max_context:
            raise FuselmError(f"the conversation reached the context of {self.max_context} tokens")
        if (token, self.position) != self._on_device:   # else the sampler left both there already
            with self.stream:
                self.ids.set(np.array([token], np.int32), stream=self.stream)
                self.pos.set(np.array([self.position], np.int32), stream=self.stream)
        self._on_device = None
        self.step()
        self.position += 1

    def next_token(self) -> int:
        """The id the last step's sampler picked (waits for the step); NonFiniteLogits when the
        sampler found NaN or inf among the logits it picked from."""
        out = np.empty(2, np.int32)
        self.sampled.get(stream=self.stream, out=out)
        self.stream.synchronize()
        if self.logits_value:             # the sampler also advanced `pos` to self.position
            if out[1]:
                raise NonFiniteLogits(self.position - 1)
            self._on_device = (int(out[0]), self.position)
        return int(out[0])

    def prefill(self, ids: Sequence[int], sampling: SamplingParams) -> int:
        if self.position + len(ids) > self.max_context:
            raise FuselmError(f"prompt of {len(ids)} token{'s' * (len(ids) != 1)} at position {self.position} does not fit the "
                              f"context of {self.max_context}")
        if not len(ids):
            raise FuselmError("empty prompt: nothing to feed")
        self._set_sampling(sampling)
        # Every step ends in the sampler, which marks its pick as seen (for the repetition
        # penalty); the picks after prompt tokens other than the last are thrown away, so the
        # marks are set again, to what was seen before plus the prompt, before the last step.
        seen = self.seen.get(stream=self.stream)
        self.stream.synchronize()
        seen[np.asarray(ids, np.int64)] = 1
        sizes = self.batched_prefill.plan_to_logits(len(ids), self.position) if self.batched_prefill else None
        if sizes:
            return self._prefill_to_logits(list(ids), sizes, seen)
        rest = list(ids[:-1])
        if self.batched_prefill and rest:
            # steps of the prefill graphs, the last one padded, as far as the context holds them
            n = min(len(rest), sum(self.batched_prefill.plan(len(rest), self.position)))
            self.batched_prefill.run(rest[:n], self.position)
            rest = rest[n:]
            self.position += n
            self._on_device = None
            self._upload_sampling()   # no sampler ran for those: its step counter to the position
        for t in rest:
            self.feed(int(t))
        self.seen.set(seen, stream=self.stream)
        self.feed(int(ids[-1]))
        return self.next_token()

    def _prefill_to_logits(self, ids: list[int], sizes: list[int], seen) -> int:
        """prefill() through steps `sizes`, the last of them giving logits, and the decode step's
        sampler on the last token's row, as if a decode step at that position had made it (its
        marks of what was seen, its step counter)."""
        row = self.batched_prefill.run_to_logits(ids, self.position, sizes)
        self.position += len(ids) - 1          # the position of the prompt's last token
        self._on_device = None
        self._upload_sampling()
        self.seen.set(seen, stream=self.stream)
        with self.stream:
            self.buffer("logits")[:row.size] = row
            self.pos.set(np.array([self.position], np.int32), stream=self.stream)
            for kernel, _, call in self.schedule_at(self.position):
                if kernel.family == "sample":
                    call(self.stream)
        self.position += 1
        return self.next_token()

    def decode(self, token: int, sampling: SamplingParams) -> int:
        self._set_sampling(sampling)
        self.feed(token)
        return self.next_token()

    def logits_of(self, ids: Sequence[int]) -> np.ndarray:
        """Feed `ids` from the current position; every position's logits [len, vocab]
        (perplexity). They go through the prefill's forms that end a prompt (the logits of
        every token of a step) where the plan's every step size has one, else one decode step
        each."""
        if self.position + len(ids) > self.max_context:
            raise FuselmError(f"{len(ids)} tokens at position {self.position} do not fit the context of {self.max_context}")
        self._set_sampling(SamplingParams())
        ids = [int(t) for t in ids]
        rows = self.batched_prefill.logits_of(ids, self.position) if self.batched_prefill and len(ids) > 1 else None
        if rows is not None:
            self.position += len(ids)
            self._on_device = None
            return rows
        out = []
        for t in ids:
            self.feed(t)
            out.append(self.logits())
        return np.stack(out)

    def logits(self) -> np.ndarray:
        """The last step's logits [vocab] (for tests and tools)."""
        return self.output("logits").reshape(-1)

    # ---- any graph: set inputs and state, run one step, read outputs (tests and tools) ----
    def set_input(self, name: str, value) -> None:
        """Upload one step's value of graph input `name` (shape [1, ...])."""
        buf = self.inputs[name]
        buf.set(np.asarray(value, buf.dtype).reshape(buf.shape), stream=self.stream)
        self._on_device = None

    def set_state(self, name: str, value) -> None:
        """Fill persistent buffer `name` (a KV cache, [ctx, width]) with `value`'s rows, as bf16
        or as fp8 rows (dsl/kv_dtype.py's rule); rows past `value` become zero."""
        rows = np.asarray(value, np.float32)
        lay = self.cache_layouts[name]
        data = fp8_rows(lay, rows) if lay.fp8 else to_bf16_bits(rows)
        with self.stream:
            self.states[name].fill(0)
            self.states[name][: rows.shape[0]] = self.cp.asarray(data)

    def state_rows(self, name: str, rows: int) -> np.ndarray:
        """The first `rows` rows of KV cache `name` as float32 [rows, width]: bf16 values, or
        fp8 codes times their scales."""
        self.stream.synchronize()
        return rows_as_float(self.cache_layouts[name], self.states[name][:rows].get())

    def output(self, name: str) -> np.ndarray:
        """The last step's value of graph output `name`."""
        self.stream.synchronize()
        value = self.G.graph["outputs"][name]
        shape = [1 if d == "T" else d for d in self.G.nodes[value]["shape"]]     # one token
        return self.cp.asnumpy(self.buffer(value)).reshape(shape)


def rows_as_float(lay, raw: np.ndarray) -> np.ndarray:
    """Cache rows of layout `lay` as they are on the device (bf16 bits [n, width] or fp8 rows
    [n, stride]) as float32 [n, width]: the values, or the codes times their scales."""
    if not lay.fp8:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    n = raw.shape[0]
    scales = raw[:, lay.scale_at: lay.scale_at + 4 * lay.kv_heads].copy().view(np.float32)
    values = e4m3_values(raw[:, : lay.width]).reshape(n, lay.kv_heads, lay.head_dim) * scales[..., None]
    return values.reshape(n, lay.width).astype(np.float32)


def fp8_rows(lay, rows: np.ndarray) -> np.ndarray:
    """float32 rows [n, width] as n fp8 cache rows (layout `lay`): uint8 [n, stride]."""
    codes, scales = quantize_heads(rows, lay.head_dim)
    out = np.zeros((rows.shape[0], lay.stride), np.uint8)
    out[:, : lay.width] = codes
    out[:, lay.scale_at: lay.scale_at + 4 * lay.kv_heads] = scales.view(np.uint8).reshape(rows.shape[0], -1)
    return out


def as_device(cp, w):
    """A weight on the device: a QuantizedWeight's bytes as they are (uint8), anything else (numpy
    float32 / bfloat16 / cupy array) as uint16 bf16 bits."""
    if isinstance(w, QuantizedWeight):
        return cp.asarray(w.data)
    if isinstance(w, cp.ndarray):
        return w if w.dtype == cp.uint16 else to_bf16_bits(w)
    w = np.asarray(w)
    if w.dtype.name == "bfloat16":
        return cp.asarray(w.view(np.uint16))
    return cp.asarray(to_bf16_bits(w.astype(np.float32)))

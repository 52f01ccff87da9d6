"""Where a decode step's time goes, measured on the GPU (for `fuselm bench --profile`).

Three views, each answering a different question:
- `kernel_profile`: each launch timed alone (repeated back to back): how fast a kernel family
  streams its bytes when nothing else runs;
- `step_ablation`: the step captured as a CUDA graph without the launches of one kernel at a
  time: what each kernel costs *inside* the step, boundaries and all (its marginal time);
- `read_bandwidth`: a plain streaming read of a large buffer: the ceiling for weight streams,
  which only read (the copy bandwidth also writes).
"""
from __future__ import annotations

from collections import defaultdict


def _elapsed_us(cp, stream, fn, reps: int) -> float:
    """Mean microseconds of fn(), run `reps` times on `stream` after two warm-up runs."""
    for _ in range(2):
        fn()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(stream)
    for _ in range(reps):
        fn()
    e1.record(stream)
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps


def kernel_profile(engine, reps: int = 20) -> dict[str, dict]:
    """Per kernel family: microseconds per token and GB/s, each launch of the schedule at the
    engine's position timed alone with events."""
    import cupy as cp
    per = defaultdict(lambda: {"us": 0.0, "bytes": 0, "launches": 0})
    counted = set()
    with engine.stream:     # the sampler, timed too, advances the position: put its state back after
        saved = [(buf, buf.copy()) for buf in (engine.ids, engine.pos, engine.seen, engine.sampler_scratch)]
    for k, _, call in engine.schedule_at(engine.position):
        per[k.family]["us"] += _elapsed_us(cp, engine.stream, lambda: call(engine.stream), reps)
        per[k.family]["launches"] += 1
        if id(k) not in counted:
            counted.add(id(k))
            per[k.family]["bytes"] += k.bytes_read + k.bytes_written
    with engine.stream:
        for buf, copy in saved:
            buf[...] = copy
    return {f: {**v, "GBps": v["bytes"] / v["us"] / 1e3 if v["us"] else 0.0} for f, v in per.items()}


def step_ablation(engine, reps: int = 30) -> dict:
    """The step at the engine's position (without its sampler, which advances the position)
    replayed as a CUDA graph, whole and then without all launches of one kernel function at a
    time. Returns the step's microseconds, a GEMVs-only step's, and per function its family,
    launches and the microseconds the step saves without it. Leaves the KV caches' row at the
    current position rewritten (harmless: the next step writes it again)."""
    import cupy as cp
    schedule = [(k.family, launch.function, call) for k, launch, call in engine.schedule_at(engine.position)
                if k.family != "sample"]

    def graph_us(keep) -> float:
        s = engine.stream
        s.begin_capture()
        for family, function, call in schedule:
            if keep(family, function):
                call(s)
        g = s.end_capture()
        return _elapsed_us(cp, s, lambda: g.launch(s), reps)

    whole = graph_us(lambda family, function: True)
    without = {}
    for f in dict.fromkeys(function for _, function, _ in schedule):       # in step order
        family = next(fam for fam, fn, _ in schedule if fn == f)
        without[f] = {"family": family, "launches": sum(fn == f for _, fn, _ in schedule),
                      "saved_us": round(whole - graph_us(lambda _, function: function != f), 1)}
    gemv_only = graph_us(lambda family, _: family == "gemv")
    return {"step_us": round(whole, 1), "gemv_only_us": round(gemv_only, 1), "without": without}


READ_PROBE = r"""
extern "C" __global__ void read_probe(const uint4* __restrict__ a, unsigned long long n, unsigned* sink) {
    unsigned x = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = i + u * stride < n ? __ldcs(a + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 4; u++) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (x == 0x9e3779b9u) sink[0] = x;   // keeps the loads; practically never true
}
"""


def read_bandwidth(gib: int = 4) -> float:
    """Bytes per second of a streaming read of `gib` GiB (16-byte loads, 4 in flight per thread,
    median of 10 runs): what a weight stream could reach."""
    import statistics

    import cupy as cp
    n = gib * 2**30 // 16
    a = cp.ones(n * 4, cp.uint32)
    sink = cp.zeros(1, cp.uint32)
    kernel = cp.RawKernel(READ_PROBE, "read_probe")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    times = []
    for _ in range(12):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        kernel((sms * 4,), (512,), (a, cp.uint64(n), sink))
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a
    cp.get_default_memory_pool().free_all_blocks()
    return n * 16 / statistics.median(times[2:])

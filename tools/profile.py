"""Where a decode step's time goes, measured on the GPU (for `fuselm bench --profile`).

Two views, each answering a different question:
- `kernel_profile`: each launch timed alone (repeated back to back): how fast a kernel family
  streams its bytes when nothing else runs;
- `step_ablation`: the step captured as a CUDA graph without the launches of one kernel at a
  time: what each kernel costs *inside* the step, boundaries and all (its marginal time).
"""
from __future__ import annotations

from collections import defaultdict


def elapsed_us(cp, stream, fn, reps: int) -> float:
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
        saved = [(buf, buf.copy()) for buf in (engine.sampled, engine.pos, engine.seen, engine.sampler_scratch)]
    for k, _, call in engine.schedule_at(engine.position):
        per[k.family]["us"] += elapsed_us(cp, engine.stream, lambda: call(engine.stream), reps)
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
    schedule = [e for e in engine.schedule_at(engine.position) if e[0].family != "sample"]

    def graph_us(keep) -> float:
        g = engine.capture([(k, launch, call) for k, launch, call in schedule if keep(k, launch)])
        return elapsed_us(cp, engine.stream, lambda: g.launch(engine.stream), reps)

    whole = graph_us(lambda k, launch: True)
    without = {}
    for f in dict.fromkeys(launch.function for _, launch, _ in schedule):   # in step order
        family = next(k.family for k, launch, _ in schedule if launch.function == f)
        without[f] = {"family": family, "launches": sum(launch.function == f for _, launch, _ in schedule),
                      "saved_us": round(whole - graph_us(lambda k, launch: launch.function != f), 1)}
    gemv_only = graph_us(lambda k, launch: k.family == "gemv")
    return {"step_us": round(whole, 1), "gemv_only_us": round(gemv_only, 1), "without": without}


def prefill_profile(engine, start: int = 0, reps: int = 10) -> dict:
    """The largest prefill step (tokens start, start + 1, ... of random ids) replayed as its CUDA
    graph, then each of its launches timed alone: the step's microseconds, and per kernel function
    its family, launches, microseconds per step and GB/s of the bytes codegen counted (a gemm's
    weights once, its activations for every token; None for the launches before a kernel's last,
    to which codegen counts none), and for the gemm kernels TFLOP/s (2 x rows x k x tokens per
    linear). Leaves those cache rows rewritten (a bench's prompts write them again)."""
    import cupy as cp
    import numpy as np
    prefill = engine.batched_prefill
    tokens = max(prefill.sizes)
    step = prefill.steps[tokens]
    ids = np.random.default_rng(0).integers(0, engine.G.nodes[engine.logits_value]["shape"][-1], tokens)
    step.run(ids.tolist(), start)            # ids and positions in place, graph captured
    return {"start": start, **step_profile(engine, step, tokens, reps)}


def step_profile(engine, step, tokens: int, reps: int = 10) -> dict:
    """A step of several tokens (a prefill or batch step: its calls, kernels, G and replay, its
    inputs in place) replayed whole, then each launch alone (see prefill_profile)."""
    import cupy as cp
    whole = elapsed_us(cp, engine.stream, step.replay, reps)
    per = {}
    calls = iter(step.calls)
    with engine.stream:
        for k in step.kernels:
            for launch in k.launches:
                call = next(calls)
                f = per.setdefault(launch.function, {"family": k.family, "launches": 0, "us": 0.0, "bytes": 0,
                                                     "flops": 0})
                f["launches"] += 1
                f["us"] += elapsed_us(cp, engine.stream, lambda: call(engine.stream), reps)
            last = per[k.launches[-1].function]
            last["bytes"] += k.bytes_read + k.bytes_written
            if k.family == "gemm":
                last["flops"] += gemm_flops(step.G, k.nodes, tokens)
    for f in per.values():
        f["GBps"] = round(f["bytes"] / f["us"] / 1e3, 1) if f["us"] and f["bytes"] else None
        f["TFLOPs"] = round(f.pop("flops") / f["us"] / 1e6, 1) if f["us"] and f["flops"] else None
        f["us"] = round(f["us"], 1)
    return {"tokens": tokens, "step_us": round(whole, 1), "functions": per}


def gemm_flops(G, nodes, tokens: int) -> int:
    """Multiply-adds x 2 of a gemm kernel's linears for a step of `tokens` tokens."""
    from ..dsl import Kind
    shapes = [G.nodes[G.nodes[n]["inputs"][1]]["shape"] for n in nodes if G.nodes[n]["kind"] is Kind.LINEAR]
    return sum(2 * tokens * rows * k for rows, k in shapes)

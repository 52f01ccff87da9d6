"""`fuselm trace PRESET`: when each kernel's blocks start, pass their wait for the previous kernel
and end, inside decode steps replayed as CUDA graphs. The block timeline is compiled into every
kernel only where the engine is built with trace=True (common.cuh, BlockTrace; `fuselm trace`
does); the kernels are otherwise the same, and the step about 6% slower than untraced.

The profile (tools/profile.py) says what each kernel costs; this says where a step's time goes
between kernels: how long after its predecessor's last block a kernel's blocks start, how long
they wait, and how far its last block trails the rest.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics

import numpy as np

from ..codegen.build import TRACE_EVENTS, trace_ids
from ..errors import FuselmError
from ..models.presets import PRESETS

TIMES = ("first_start", "median_start", "last_start", "median_waited", "median_end", "last_end")   # a row's, in us
_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(')


def record(engine, position: int, steps: int) -> np.ndarray:
    """Block events [n, 4] (id|smid|block, start, waited, end in ns) of the steps at positions
    `position` .. `position` + `steps` - 1."""
    if not getattr(engine, "traced", False):
        raise FuselmError("these kernels record no block timeline: build the engine with trace=True "
                          "(fuselm trace does)")
    cp = engine.cp
    count = engine.module.get_global("fuselm_trace_count")
    engine.capture_graphs()
    engine.reset()
    engine.position = position
    engine.feed(0)                                  # warm: the first replay of a graph is slower
    engine.stream.synchronize()
    engine.position = position                      # the traced steps start at `position` again
    cp.ndarray((1,), cp.uint32, count).fill(0)
    cp.cuda.Device().synchronize()
    for _ in range(steps):
        engine.feed(0)
    engine.stream.synchronize()
    n = int(cp.ndarray((1,), cp.uint32, count).get()[0])
    if n > TRACE_EVENTS:
        raise FuselmError(f"{n} block events do not fit the trace buffer of {TRACE_EVENTS}: trace fewer steps")
    return cp.ndarray((n, 4), cp.uint64, engine.module.get_global("fuselm_trace")).get()


def launches(engine, events: np.ndarray, position: int, steps: int) -> list[dict]:
    """One row per launch of each traced step (the step at `position` + step uses that position's
    schedule), in step order: thread 0's start, wait and end times of its blocks, in us from the
    step's first block start (the median wait over the blocks whose thread 0 waited)."""
    names = trace_ids(engine.kernels)
    schedules = [engine.schedule_at(position + step) for step in range(steps)]
    ids = (events[:, 0] >> 48).astype(int)
    by_function = {}
    for f in dict.fromkeys(launch.function for schedule in schedules for _, launch, _ in schedule):
        mine = events[ids == names.index(f)]
        by_function[f] = mine[np.argsort(mine[:, 1], kind="stable")]
    taken = dict.fromkeys(by_function, 0)
    rows = []
    for step, schedule in enumerate(schedules):
        t0 = None
        for kernel, launch, _ in schedule:
            f = launch.function
            blocks = int(np.prod([1 if g == "T" else g for g in launch.grid]))   # one token per step
            ev = by_function[f][taken[f]:taken[f] + blocks]
            taken[f] += blocks
            if len(ev) != blocks:
                raise FuselmError(f"{f}: {len(ev)} block events where {blocks} were launched")
            start, waited, end = (ev[:, 1].astype(np.int64), ev[:, 2].astype(np.int64), ev[:, 3].astype(np.int64))
            t0 = start.min() if t0 is None else t0
            waits = waited[waited > 0]

            def us(t):
                return round(float(t - t0) / 1e3, 3)
            rows.append({"step": step, "function": f, "family": kernel.family, "layer": kernel.layer,
                         "blocks": blocks, "sms": len(set((ev[:, 0] >> 32 & 0xFFFF).tolist())),
                         "first_start": us(start.min()), "median_start": us(np.median(start)),
                         "last_start": us(start.max()),
                         "median_waited": us(np.median(waits)) if len(waits) else None,
                         "median_end": us(np.median(end)), "last_end": us(end.max())})
    if sum(taken.values()) != len(events):
        raise FuselmError(f"{len(events) - sum(taken.values())} block events belong to no launch of the traced steps")
    return rows


def layer_pattern(rows: list[dict]) -> list[dict]:
    """The launches of one middle layer, each time taken from the previous launch's last block end
    and averaged over the middle layers of every step (the first and last layers are left out).
    Layers whose kernels differ (Gemma-2's alternating windows) keep a row per kernel."""
    layers = sorted({r["layer"] for r in rows if r["layer"] is not None})
    middle = set(layers[1:-1]) or set(layers)
    per_position: dict[tuple[int, str], list[dict]] = {}
    for step in {r["step"] for r in rows}:
        mine = [r for r in rows if r["step"] == step]
        for layer in middle:
            idx = [i for i, r in enumerate(mine) if r["layer"] == layer]
            for j, i in enumerate(idx):
                prev_end = mine[i - 1]["last_end"]
                r = mine[i]
                rel = {k: (r[k] - prev_end if r[k] is not None else None) for k in TIMES}
                per_position.setdefault((j, r["function"]), []).append({**r, **rel})
    out = []
    for key in sorted(per_position):
        rs = per_position[key]
        avg = {k: round(statistics.fmean(r[k] for r in rs if r[k] is not None), 3)
               if any(r[k] is not None for r in rs) else None
               for k in TIMES}
        out.append({"slot": key[0], "function": rs[0]["function"], "family": rs[0]["family"],
                    "blocks": rs[0]["blocks"], "launches": len(rs), "sms": round(statistics.fmean(r["sms"] for r in rs)),
                    **avg})
    return out


def by_schedule(rows: list[dict]) -> list[tuple[list[int], list[dict]]]:
    """The rows split by the sequence of launches their step ran: (steps, rows) per schedule, as
    steps that cross a variant's boundary (attention in one launch, then split) run two."""
    groups: dict[tuple, list[int]] = {}
    for step in dict.fromkeys(r["step"] for r in rows):
        groups.setdefault(tuple(r["function"] for r in rows if r["step"] == step), []).append(step)
    return [(steps, [r for r in rows if r["step"] in steps]) for steps in groups.values()]


def layer_us(pattern: list[dict]) -> float:
    """A middle layer's time: per slot, the launches' last ends averaged over the layers."""
    slots: dict[int, list[dict]] = {}
    for p in pattern:
        slots.setdefault(p["slot"], []).append(p)
    return sum(sum(p["last_end"] * p["launches"] for p in ps) / sum(p["launches"] for p in ps)
               for ps in slots.values())


def _print(pattern: list[dict], positions: str, step_us: float) -> None:
    print(f"position {positions}: step {step_us:.1f} us; per middle layer, us from the previous launch's last block end")
    print(f"{'kernel':44} {'blocks':>6} {'SMs':>4} {'start 1st/med/last':>20} {'waited':>7} {'end med/last':>13}")
    for p in pattern:
        waited = f"{p['median_waited']:7.2f}" if p["median_waited"] is not None else "      -"
        print(f"{p['function'][:44]:44} {p['blocks']:6d} {p['sms']:4d} {p['first_start']:6.2f} {p['median_start']:6.2f} "
              f"{p['last_start']:6.2f} {waited} {p['median_end']:6.2f} {p['last_end']:6.2f}")
    print(f"layer: {layer_us(pattern):.2f} us")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`fuselm trace`'s options."""
    p.add_argument("model", help=f"preset (random weights of real shapes): {', '.join(PRESETS)}")
    p.add_argument("--positions", type=int, nargs="+", default=[100, 4100], help="positions to trace at")
    p.add_argument("--steps", type=int, default=3, help="steps traced at each position")
    p.add_argument("--json", help="write every launch's row here")
    p.add_argument("--events", help="write the raw block events (.npz, per position) here")
    from .inspect import add_tune_argument
    add_tune_argument(p)


def main(args: argparse.Namespace) -> int:
    """Trace `args.model` at each of `args.positions` and print the middle layer's timeline."""
    if args.steps < 1:
        raise FuselmError(f"--steps {args.steps}: at least 1")
    if min(args.positions) < 0:
        raise FuselmError(f"--positions {min(args.positions)}: positions are not negative")
    from .inspect import tuning_of
    tuning = tuning_of(args)
    from ..models import build_graph
    from ..models.presets import preset
    from ..runtime.cuda_engine import CudaEngine
    from ..runtime.random_weights import random_gpu_weights
    graph = build_graph(preset(args.model))
    # The benchmark's context (4608 rows), or more: the attention kernels depend on it.
    engine = CudaEngine(graph, random_gpu_weights(graph), ctx=max(4608, max(args.positions) + args.steps + 1),
                        tuning=tuning, trace=True)
    out, raw = {}, {}
    for position in dict.fromkeys(args.positions):
        raw[f"events_{position}"] = record(engine, position, args.steps)
        rows = launches(engine, raw[f"events_{position}"], position, args.steps)
        for steps, mine in by_schedule(rows):
            where = f"{position + steps[0]}" + (f"-{position + steps[-1]}" if len(steps) > 1 else "")
            step_us = statistics.median(max(r["last_end"] for r in mine if r["step"] == s) for s in steps)
            _print(layer_pattern(mine), where, step_us)
        out[position] = rows
    if args.events:
        np.savez_compressed(args.events, kernels=np.array(trace_ids(engine.kernels)), **raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "launches": out}, f)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m fuselm.tools.trace", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))

"""Pass: the operands each GEMV may read before it waits for the kernel before it.

With programmatic dependent launch a kernel's blocks may start while the kernel before it still
runs, and they wait for it (common.cuh: grid_wait_then_release) only before reading its output.
Kernels start in launch order, each once the kernel before has let it go; a GEMV lets its
successor go only after its own wait has returned, that is, once the kernel before that GEMV has
finished (row-wise and attention kernels may let theirs go first thing, see
codegen/emit.py: EARLY_RELEASE; a GEMV never does, which tests/test_codegen_compile.py checks).
So when a kernel starts, every kernel before the last GEMV ahead
of it has finished and its writes are visible: the values they wrote, like weights, can be read
before the wait. A GEMV's epilogue operands such as the residual (written two to four launches
earlier) are then loaded while its weights stream, instead of in one more round trip to L2 after
its dot products.

Two properties of the kernels carry this, and codegen keeps both: every kernel waits, in at least
one block, before it finishes (so a finished kernel implies a finished predecessor, back to the
start of the step), and no kernel writes anything before its own wait (so no kernel still running
when a GEMV starts can overwrite, through buffer reuse, a value that GEMV reads early: it writes
only after the last GEMV ahead of it has let it go).

Graph inputs (the token, the position) are written before the step, by the host or the previous
step's sampler, so they are settled for every launch with a GEMV ahead of it in the step; weights
and constants always; the persistent state (KV caches) never, since the step writes it.

Before: `G.graph["schedule"]` (see schedule.py).
After: each gemv launch carries "early": the values among its reads that it may read before its
wait; other launches are unchanged.
"""
from __future__ import annotations

from dataclasses import replace

import networkx as nx

from ..dsl import Kind


def plan_early_reads(G: nx.DiGraph) -> nx.DiGraph:
    """Mark what each gemv launch may read before its wait (see the module docstring)."""
    G = G.copy()
    sources = {n: d["op"] for n, d in G.nodes(data=True) if d["kind"] is Kind.SOURCE}
    fixed = {n for n, op in sources.items() if op in ("weight", "constant")}
    inputs = {n for n, op in sources.items() if op == "input"}
    settled: set[str] = set()       # written by launches before the last GEMV so far (and the inputs)
    written: set[str] = set(inputs)  # written by all launches so far, and before the step
    launches = []
    for launch in G.graph["schedule"]:
        if launch.family == "gemv":
            launch = replace(launch, early=[r for r in launch.reads if r in fixed or r in settled])
            settled = set(written)
        written |= set(launch.nodes)
        launches.append(launch)
    G.graph["schedule"] = launches
    return G

"""A numpy executor of a *compiled* graph that moves data the way the GPU runtime does.

`run_graph` (reference.py) evaluates the DSL graph op by op and is blind to everything the compiler
decides. `run_schedule` instead runs the result of `compile_graph`, and trusts nothing but the
compiler's own launch list and buffer plan:

- one arena of `G.graph["arena_bytes"]` bytes holds every activation that crosses a kernel
  boundary; with `poison=True` it is filled with NaN (float32 bit pattern; as int32 it reads as a
  huge index) before the run, so a value that nobody wrote shows up;
- the launches of `G.graph["schedule"]` run in their order, each one by itself: a launch sees
  * sources (inputs from `feeds`, weights, constants of `G.graph["constants"]`, state),
  * values written in place into state (ops with `inplace_of`, such as kv_write), which *are*
    the state buffer,
  * every other value computed by another kernel ONLY through the arena, at
    `G.graph["buffers"][v] = (offset, nbytes)`, as a view: if a later write of the same launch
    overlaps it, the launch sees the clobbered bytes, as a GPU kernel would;
- inside a launch, nodes are evaluated in order with each op's numpy reference
  (`dsl.get(op).reference`); intermediates stay local to the launch (on chip), and only the values
  in `launch.writes` and `launch.scratch` are stored into the arena, right after they are
  computed; a gemv kernel's row-wise tail (compiler/fuse_tail.py) reads what the rest of its
  kernel computed from the arena too, as the block that runs it does;
- graph outputs are read back from the arena after the last launch.

So a buffer plan that lets two live buffers overlap, a value some kernel reads that no kernel
writes, or launches in the wrong order give wrong numbers or NaN here, where `run_graph` would
still be right. Comparing the two is the end-to-end test of the compiler's passes.

The token count is `G.graph["tokens"]` (set by plan_buffers from `compile_graph(tokens=T)`); the
feeds must have T rows. `state` (KV caches, as from reference.new_state) is updated in place, so
prompt-then-decode loops work as with run_graph (compile once per token count).
"""
from __future__ import annotations

from typing import Mapping

import networkx as nx
import numpy as np

from ..compiler.kernels import split_tail
from ..dsl import Kind, get
from .reference import bind_shape


class ScheduleError(AssertionError):
    """The compiled graph cannot run as scheduled (a read of a value no launch stored, a bad plan)."""


_DTYPES = {"f32": np.float32, "i32": np.int32}


def run_schedule(G: nx.DiGraph, weights: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray],
                 state: dict[str, np.ndarray], poison: bool = True) -> dict[str, np.ndarray]:
    """Run the launches of the compiled graph `G` through one arena; returns the graph's outputs."""
    tokens = G.graph["tokens"]
    buffers: dict[str, tuple[int, int]] = G.graph["buffers"]
    arena_bytes = int(G.graph["arena_bytes"])
    arena = np.zeros(arena_bytes, np.uint8)
    if poison:
        arena[: arena_bytes // 4 * 4].view(np.float32)[:] = np.nan
    sizes = {"T": tokens}
    constants = G.graph.get("constants", {})

    def source(name: str) -> np.ndarray:
        d = G.nodes[name]
        if d["op"] == "input":
            return np.asarray(feeds[name])
        if d["op"] == "weight":
            return weights[name]
        if d["op"] == "constant":
            return constants[name]
        if d["op"] == "state":
            return state[name]
        raise ScheduleError(f"{name}: unknown source op {d['op']}")

    def storage_of(name: str) -> str | None:
        """The state node a value is stored in (in-place ops, followed to their source), or None."""
        while G.nodes[name]["kind"] is not Kind.SOURCE:
            inplace = get(G.nodes[name]["op"]).inplace_of
            if inplace is None:
                return None
            name = G.nodes[name]["inputs"][inplace]
        return name if G.nodes[name]["op"] == "state" else None

    def arena_view(name: str) -> np.ndarray:
        if name not in buffers:
            raise ScheduleError(f"{name} is read from memory but has no buffer in the plan")
        offset, nbytes = buffers[name]
        d = G.nodes[name]
        shape = bind_shape(d["shape"], sizes)
        dtype = _DTYPES[d["dtype"]]
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if nbytes != need or offset < 0 or offset + nbytes > arena_bytes or offset % 4:
            raise ScheduleError(f"{name}: buffer (offset {offset}, {nbytes} bytes) does not hold "
                                f"{shape} {d['dtype']} inside an arena of {arena_bytes} bytes")
        return arena[offset:offset + nbytes].view(dtype).reshape(shape)

    def stored(name: str) -> np.ndarray:
        """A value as another kernel (or the host, for outputs) sees it: from memory."""
        if G.nodes[name]["kind"] is Kind.SOURCE:
            return source(name)
        st = storage_of(name)
        if st is not None:
            return state[st]
        return arena_view(name)

    for launch in G.graph["schedule"]:
        inside = set(launch.nodes)
        to_store = set(launch.writes) | set(launch.scratch)
        local: dict[str, np.ndarray] = {}
        body, tail = split_tail(G, launch.nodes)
        for n in launch.nodes:
            d = G.nodes[n]
            opdef = get(d["op"])
            # a gemv kernel's tail runs in the block that finishes last: it reads the GEMVs'
            # results from memory, where the other blocks stored them
            mine = set(tail) if n in tail else inside
            args = [local[i] if i in mine else stored(i) for i in d["inputs"]]
            out = opdef.reference(*args, **d["attrs"])
            st = storage_of(n)
            if st is not None:                    # in place into persistent state
                if out is not state[st]:
                    state[st][...] = out
                out = state[st]
            elif n in to_store:
                view = arena_view(n)
                view[...] = out
                out = np.array(out, dtype=view.dtype)   # the launch keeps its own (on-chip) copy
            local[n] = out
    return {k: np.array(stored(v)) for k, v in G.graph["outputs"].items()}

"""Pass: buffer planning, one arena for every activation that crosses a kernel boundary.

Before: `G.graph["schedule"]` (see schedule.py).
After: `G.graph["buffers"]` maps every value some launch writes for another launch (or as a graph
output, or as its own scratch) to `(offset, nbytes)` in one arena, such that two buffers whose lifetimes overlap never
share a byte. A buffer lives from the launch that writes it to the last launch that reads it;
graph outputs live to the end. Values written in place into persistent state (KV caches) take no
arena space. `G.graph["arena_bytes"]` is the arena size with reuse and
`G.graph["arena_bytes_no_reuse"]` what one buffer per value would need.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from ..dsl import get

ALIGN = 256  # bytes: keeps every buffer aligned for 16-byte vector loads, and then some


def plan_buffers(G: nx.DiGraph, tokens: int = 1) -> nx.DiGraph:
    """Give every stored value an arena offset for `tokens` tokens per step (see the module docstring)."""
    G = G.copy()
    launches = G.graph["schedule"]
    end = len(launches)
    life: dict[str, list[int]] = {}
    for step, launch in enumerate(launches):
        for v in launch.writes + launch.scratch:
            if get(G.nodes[v]["op"]).inplace_of is None:
                life[v] = [step, step]
        for v in launch.reads:
            if v in life:
                life[v][1] = step
    for v in G.graph["outputs"].values():
        if v in life:
            life[v][1] = end
    sizes = {v: _nbytes(G.nodes[v], tokens) for v in life}
    placed: list[tuple[int, int, int, int]] = []   # (offset, nbytes, first, last)
    buffers = {}
    for v in sorted(life, key=lambda v: (-sizes[v], life[v][0])):
        first, last = life[v]
        clashes = sorted((o, o + n) for o, n, f, l in placed if f <= last and first <= l)
        offset = 0
        for lo, hi in clashes:   # first fit in the gaps between buffers that are alive meanwhile
            if offset + sizes[v] <= lo:
                break
            offset = max(offset, _align(hi))
        placed.append((offset, sizes[v], first, last))
        buffers[v] = (offset, sizes[v])
    G.graph["buffers"] = buffers
    G.graph["buffer_life"] = {v: tuple(t) for v, t in life.items()}
    G.graph["arena_bytes"] = max((o + n for o, n in buffers.values()), default=0)
    G.graph["arena_bytes_no_reuse"] = sum(_align(n) for n in sizes.values())
    G.graph["tokens"] = tokens
    return G


def _nbytes(data: dict, tokens: int) -> int:
    shape = [tokens if d == "T" else d for d in data["shape"]]
    return int(np.prod(shape)) * 4  # f32 activations and i32 ids are both 4 bytes


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN

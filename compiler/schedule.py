"""Pass: scheduling, the final launch list.

Before: every compute node carries the id of the kernel it runs in.
After: `G.graph["schedule"]` is the list of kernels in launch order (a topological order of the
kernel graph, ties broken by graph order), each a ScheduledKernel: its family, nodes, the values
it reads from other kernels, the values it writes for other kernels or as outputs, and the decoder
layer it belongs to (or None).
"""
from __future__ import annotations

import re

import networkx as nx

from ..dsl import Kind
from .kernels import ScheduledKernel, family, kernel_graph, materialized, members

_LAYER = re.compile(r"(?:layers|cache)\.(\d+)\.")


def schedule(G: nx.DiGraph) -> nx.DiGraph:
    """Order the kernels into the launch list (see the module docstring)."""
    G = G.copy()
    groups = members(G)
    first = {k: G.nodes[nodes[0]]["order"] for k, nodes in groups.items()}
    order = nx.lexicographical_topological_sort(kernel_graph(G), key=lambda k: first[k])
    outputs = set(G.graph["outputs"].values())
    launches = []
    for k in order:
        nodes = groups[k]
        inside = set(nodes)
        reads = list(dict.fromkeys(i for n in nodes for i in G.nodes[n]["inputs"] if i not in inside))
        # Written: what other kernels read, the graph's outputs, and values nothing reads (a
        # kernel's last value must land somewhere; kv_write's lands in its cache).
        writes = [n for n in nodes if n in outputs or any(s not in inside for s in G.successors(n))
                  or not any(True for _ in G.successors(n))]
        scratch = [n for n in materialized(G, nodes) if n not in writes]
        launches.append(ScheduledKernel(k, family(G, nodes), nodes, reads, writes, scratch, _layer(G, nodes + reads)))
    G.graph["schedule"] = launches
    return G


def _layer(G: nx.DiGraph, names: list[str]) -> int | None:
    """The layer index in the name of a weight or cache the kernel touches (one level deep)."""
    for n in names + [i for n in names for i in G.nodes[n]["inputs"]]:
        if G.nodes[n]["kind"] is Kind.SOURCE:
            m = _LAYER.search(n)
            if m:
                return int(m.group(1))
    return None

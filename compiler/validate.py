"""The invariants every pass must keep; the pipeline checks them after each pass."""
from __future__ import annotations

import networkx as nx

from ..dsl import Kind
from .kernels import family, kernel_graph, members


class InvalidGraph(AssertionError):
    pass


def validate(G: nx.DiGraph) -> None:
    """Raise InvalidGraph naming the first broken invariant."""
    def fail(msg):
        raise InvalidGraph(f"{G.graph.get('name', 'graph')}: {msg}")

    if not nx.is_directed_acyclic_graph(G):
        fail("the graph has a cycle")
    for name, d in G.nodes(data=True):
        if set(d["inputs"]) != set(G.predecessors(name)):
            fail(f"{name}: edges {sorted(G.predecessors(name))} differ from inputs {d['inputs']}")
        if (d["kind"] is Kind.SOURCE) != (d["kernel"] is None):
            fail(f"{name}: sources have no kernel and every op has one")
    for v in G.graph["outputs"].values():
        if v not in G:
            fail(f"output {v} is not a node")
    if not nx.is_directed_acyclic_graph(kernel_graph(G)):
        fail("the kernel graph has a cycle")
    for k, nodes in members(G).items():
        try:
            family(G, nodes)
        except ValueError as e:
            fail(f"kernel {k}: {e}")
    if "schedule" in G.graph:
        ready = {n for n, d in G.nodes(data=True) if d["kind"] is Kind.SOURCE}
        for launch in G.graph["schedule"]:
            missing = [r for r in launch.reads if r not in ready]
            if missing:
                fail(f"launch {launch.kernel} reads {missing} before anything writes them")
            ready |= set(launch.nodes)

"""Lowering: a DSL Graph becomes the networkx graph that every compiler pass rewrites.

Each DSL node becomes a networkx node carrying `op`, `kind`, `inputs` (ordered operand names),
`attrs`, `shape`, `dtype` and `kernel`: the id of the kernel it will run in. Lowering puts every
compute op in a kernel of its own; fusion passes merge kernels by relabelling. An edge u -> v
means v reads u. Graph-level data (outputs, constants) lives in `G.graph`.
"""
from __future__ import annotations

import networkx as nx

from ..dsl import SOURCE_OPS, Graph, Kind, get


def to_networkx(graph: Graph) -> nx.DiGraph:
    """The unfused networkx form of `graph`: one kernel per compute op."""
    G = nx.DiGraph(name=graph.name, outputs=dict(graph.outputs), constants=dict(graph.constants))
    for node in graph.nodes.values():
        source = node.op in SOURCE_OPS
        G.add_node(node.name, op=node.op, kind=Kind.SOURCE if source else get(node.op).kind,
                   inputs=node.inputs, attrs=dict(node.attrs), shape=node.shape, dtype=node.dtype,
                   kernel=None if source else node.name, order=len(G))
        for src in node.inputs:
            G.add_edge(src, node.name)
    return G

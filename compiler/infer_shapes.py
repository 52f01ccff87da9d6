"""Pass: shape inference.

Before: every node has `op`, `inputs` and `attrs` (its `shape` may be missing or stale).
After: every compute node's `shape` and `dtype` are what its op's shape rule gives for its
operands' shapes, recomputed in topological order; a rule that rejects its operands raises
ShapeError naming the node.
"""
from __future__ import annotations

import networkx as nx

from ..dsl import Kind, ShapeError, get


def infer_shapes(G: nx.DiGraph) -> nx.DiGraph:
    """Recompute every op's shape and dtype from its operands (see the module docstring)."""
    G = G.copy()
    for name in nx.topological_sort(G):
        data = G.nodes[name]
        if data["kind"] is Kind.SOURCE:
            continue
        shapes = [G.nodes[i]["shape"] for i in data["inputs"]]
        try:
            data["shape"], data["dtype"] = get(data["op"]).shape_rule(shapes, data["attrs"])
        except ShapeError as e:
            raise ShapeError(f"{name}: {e}") from None
        data["shape"] = tuple(data["shape"])
    return G

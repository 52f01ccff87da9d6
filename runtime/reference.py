"""The numpy reference executor: runs any DSL graph op by op in float32 on the CPU.

It is the CPU backend and the oracle of every test. It binds the symbol "T" to the number of
tokens fed and "S" to the rows of the state buffers; `kv_write` updates state in place, so a
prompt of T tokens followed by single-token steps behaves like a real decode loop.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..dsl import Graph, get


def bind_shape(shape: tuple, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Replace the symbols of a shape ("T", "S") by their sizes."""
    return tuple(sizes[d] if isinstance(d, str) else d for d in shape)


def new_state(graph: Graph, rows: int) -> dict[str, np.ndarray]:
    """Zeroed persistent buffers (KV caches) with `rows` rows each."""
    return {n.name: np.zeros(bind_shape(n.shape, {"S": rows}), np.float32)
            for n in graph.sources("state")}


def run_graph(graph: Graph, weights: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray],
              state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate every node in order; returns the graph's outputs. `state` is updated in place."""
    values: dict[str, np.ndarray] = {}
    for node in graph.nodes.values():
        if node.op == "input":
            values[node.name] = np.asarray(feeds[node.name])
        elif node.op == "weight":
            values[node.name] = weights[node.name]
        elif node.op == "constant":
            values[node.name] = graph.constants[node.name]
        elif node.op == "state":
            values[node.name] = state[node.name]
        else:
            opdef = get(node.op)
            out = opdef.reference(*(values[i] for i in node.inputs), **node.attrs)
            if opdef.inplace_of is not None:  # write through to the persistent buffer
                target = values[node.inputs[opdef.inplace_of]]
                if out is not target:
                    target[...] = out
                out = target
            values[node.name] = out
    return {k: values[v] for k, v in graph.outputs.items()}

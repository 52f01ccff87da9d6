"""The numpy reference executor: runs any DSL graph op by op in float32 on the CPU.

It is the CPU backend and the oracle of every test. It binds the symbol "T" to the number of
tokens fed and "S" to the rows of the state buffers; `kv_write` updates state in place, so a
prompt of T tokens followed by single-token steps behaves like a real decode loop. run_ranks
evaluates the ranks of a tensor-parallel model in lockstep, summing at each all_reduce.
"""
from __future__ import annotations

from typing import Mapping, Sequence

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
              state: dict[str, np.ndarray], trace: dict | None = None) -> dict[str, np.ndarray]:
    """Evaluate every node in order; returns the graph's outputs. `state` is updated in place;
    `trace`, where given, receives every node's value by name."""
    values: dict[str, np.ndarray] = {} if trace is None else trace
    for node in graph.nodes.values():
        values[node.name] = _evaluate(graph, node, values, weights, feeds, state)
    return {k: values[v] for k, v in graph.outputs.items()}


def run_ranks(graphs: Sequence[Graph], weights: Sequence[Mapping[str, np.ndarray]], feeds: Mapping[str, np.ndarray],
              states: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The graphs of a tensor-parallel model's ranks (compiler/partition.py: the same nodes in
    the same order) evaluated in lockstep, each on its own weights and state, every all_reduce
    the sum of its value over the ranks; each rank's outputs."""
    values: list[dict[str, np.ndarray]] = [{} for _ in graphs]
    for name in graphs[0].nodes:
        for g, w, s, v in zip(graphs, weights, states, values):
            v[name] = _evaluate(g, g.nodes[name], v, w, feeds, s)
        if graphs[0].nodes[name].op == "all_reduce":
            total = sum(v[name] for v in values)
            for v in values:
                v[name] = total
    return [{k: v[n] for k, n in g.outputs.items()} for g, v in zip(graphs, values)]


def _evaluate(graph: Graph, node, values: dict, weights, feeds, state) -> np.ndarray:
    """One node's value from its operands' in `values` (sources from weights, feeds, state)."""
    if node.op == "input":
        return np.asarray(feeds[node.name])
    if node.op == "weight":
        return weights[node.name]
    if node.op == "constant":
        return graph.constants[node.name]
    if node.op == "state":
        return state[node.name]
    opdef = get(node.op)
    out = opdef.reference(*(values[i] for i in node.inputs), **node.attrs)
    if opdef.inplace_of is not None:  # write through to the persistent buffer
        target = values[node.inputs[opdef.inplace_of]]
        if out is not target:
            target[...] = out
        out = target
    return out

"""Tensor parallelism: a model graph split over N ranks, each holding 1/N of the weights.

    shards = partition(graph, ranks=2)     one Shard per rank: its graph and weight slices
    shards[r].weights(full_weights)        rank r's slices of a checkpoint's weights

Before: one DSL graph. After, for each rank r: a graph of the same nodes in which
- every attention keeps its rank's heads: H/N query heads and KV/N KV heads (whole heads, and
  the query heads of a KV head on the rank that holds it), its caches KV/N heads wide;
- the linears producing Q, K and V (through RoPE, per-head norms, biases and scales) are split
  by output rows ("column-parallel"), and so are the linears whose outputs meet in an
  elementwise product before another linear (an MLP's gate and up);
- the linears reading those split values (O, down) are split by input columns ("row-parallel")
  and followed by an `all_reduce` op: each rank holds a partial sum, the op adds them up;
- routed experts keep every expert on every rank, each with 1/N of its intermediate width (gate
  and up rows, down columns, their biases alike; the down bias on rank 0 alone), the router
  replicated, and an `all_reduce` after them;
- attention sinks (gpt-oss) go with their heads;
- everything else (embedding, norms, residual adds, LM head) is replicated.
The fusion passes then run on each rank's graph as on any graph. What cannot be split this way
(a norm over a whole Q/K projection, heads or expert widths not divisible by N) is refused by name.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from ..dsl import Graph, Kind, get
from ..dsl.graph import SOURCE_OPS, Node
from ..errors import FuselmError


@dataclass
class Shard:
    """Rank `rank` of `ranks`: its graph and, per weight, the axis it is split along (the rest
    whole)."""
    rank: int
    ranks: int
    graph: Graph
    split_axes: dict[str, int] = field(default_factory=dict)
    first_rank_only: set[str] = field(default_factory=set)   # added once to a sum: zero on the other ranks

    def weights(self, full: dict) -> dict:
        """This rank's weights: its slice of each split weight, the others as they are (zeros
        for those of first_rank_only past rank 0)."""
        def part(name, w):
            if name in self.first_rank_only and self.rank:
                return np.zeros_like(w)
            return np.split(np.asarray(w), self.ranks, axis=self.split_axes[name])[self.rank] if name in self.split_axes else w
        return {name: part(name, w) for name, w in full.items()}


class _Plan:
    """What partition() splits: values split along their last dimension, weights split along an
    axis, the linears that become row-parallel."""

    def __init__(self, graph: Graph, ranks: int):
        self.graph, self.ranks = graph, ranks
        self.split: set[str] = set()          # activations, states and constants split along their last axis
        self.weight_axes: dict[str, int] = {}
        self.row_parallel: list[str] = []     # nodes whose outputs are partial sums: an all_reduce follows
        self.first_rank_only: set[str] = set()
        self.consumers: dict[str, list[str]] = {n: [] for n in graph.nodes}
        for n in graph.nodes.values():
            for i in n.inputs:
                self.consumers[i].append(n.name)

    def divisible(self, n: int, what: str, where: str) -> None:
        if n % self.ranks:
            raise FuselmError(f"tensor parallelism: {where}: {n} {what} do not split over {self.ranks} ranks")

    def back(self, value: str, acc: dict) -> str | None:
        """Mark `value` split, with what produces it (into `acc`: value -> weight axis or None);
        None on success, else why it cannot be."""
        if value in acc or value in self.split:
            return None
        n = self.graph.nodes[value]
        if n.op in SOURCE_OPS:
            return f"{value} is a graph {n.op}"
        if n.op == "linear":                                    # column-parallel: its output rows
            self.divisible(n.shape[-1], "output rows", value)
            acc[value], acc[n.inputs[1]] = None, 0
            return None
        if n.op == "rope" or n.op == "rmsnorm" and n.attrs.get("group"):   # within a head
            acc[value] = None
            return self.back(n.inputs[0], acc)
        if n.op == "rmsnorm":
            return f"{value} normalizes the whole projection (its sum of squares spans the ranks)"
        if get(n.op).kind is not Kind.ELEMENTWISE:
            return f"{value} ({n.op}) is not elementwise"
        acc[value] = None
        for i in n.inputs:
            src = self.graph.nodes[i]
            if src.op in ("weight", "constant"):
                if src.shape and src.shape[-1] == n.shape[-1]:
                    acc[i] = len(src.shape) - 1
                elif src.shape not in ((), (1,)):
                    return f"{i} of shape {src.shape} does not split with {value}"
            elif (why := self.back(i, acc)) is not None:
                return why
        return None

    def commit(self, acc: dict) -> None:
        for v, axis in acc.items():
            if self.graph.nodes[v].op == "weight":
                self.weight_axes[v] = axis
            else:
                self.split.add(v)

    def forward(self, value: str) -> None:
        """The consumers of split `value`: elementwise ones split too, linears row-parallel."""
        for c in self.consumers[value]:
            node = self.graph.nodes[c]
            if c in self.split or c in self.row_parallel:
                continue
            if node.op == "linear" and node.inputs[0] == value:
                self.weight_axes[node.inputs[1]] = 1
                self.row_parallel.append(c)
            elif get(node.op).kind is Kind.ELEMENTWISE:
                acc = {}
                if (why := self.back(c, acc)) is not None:
                    raise FuselmError(f"tensor parallelism: {c} reads the split {value}: {why}")
                self.commit(acc)
                self.forward(c)
            else:
                raise FuselmError(f"tensor parallelism: {c} ({node.op}) reads the split {value}")


def partition(graph: Graph, ranks: int) -> list[Shard]:
    """`graph` split over `ranks` ranks (see the module docstring): one Shard per rank."""
    if ranks < 1:
        raise FuselmError(f"tensor parallelism needs at least one rank, got {ranks}")
    if ranks == 1:
        return [Shard(0, 1, graph)]
    plan = _Plan(graph, ranks)
    for n in graph.nodes.values():
        if n.op == "paged_attention":
            raise FuselmError(f"tensor parallelism: {n.name}: partition the graph before paging it")
        if n.op not in SOURCE_OPS and get(n.op).kind is Kind.MOE:
            _split_experts(plan, n)
    attentions = [n for n in graph.nodes.values() if n.op == "attention"]
    for a in attentions:                         # heads: Q, and the caches' K and V
        plan.divisible(a.attrs["n_heads"], "query heads", a.name)
        plan.divisible(a.attrs["n_kv_heads"], "KV heads", a.name)
        q, kc, vc = a.inputs[:3]
        acc = {a.name: None, **{sinks: 0 for sinks in a.inputs[4:]}}   # the sinks [H] go with their heads
        for cache in (kc, vc):
            write = graph.nodes[cache]                            # kv_write(state, k, pos)
            acc[cache], acc[write.inputs[0]] = None, None
            if (why := plan.back(write.inputs[1], acc)) is not None:
                raise FuselmError(f"tensor parallelism: {a.name}: its K / V cannot split by heads: {why}")
        if (why := plan.back(q, acc)) is not None:
            raise FuselmError(f"tensor parallelism: {a.name}: its Q cannot split by heads: {why}")
        plan.commit(acc)
    for a in attentions:
        plan.forward(a.name)
    for n in graph.nodes.values():             # MLPs: a linear reading an elementwise product of linears
        if n.op == "linear" and n.name not in plan.row_parallel and n.inputs[0] not in plan.split:
            src = graph.nodes[n.inputs[0]]
            acc = {}
            if src.op not in SOURCE_OPS and get(src.op).kind is Kind.ELEMENTWISE and plan.back(src.name, acc) is None:
                plan.commit(acc)
                plan.forward(src.name)
    return [_shard(graph, plan, r) for r in range(ranks)]


def _split_experts(plan: _Plan, node: Node) -> None:
    """Every expert of moe_ffn `node` on every rank with 1/N of its intermediate width: gate and
    up stacks [E, I, D] and their biases [E, I] along I, the down stack [E, D, I] along I, its
    bias [E, D] on rank 0 alone; the output a partial sum."""
    gate, up, down, *biases = node.inputs[2:]
    plan.divisible(plan.graph.nodes[gate].shape[1], "expert intermediate rows", node.name)
    plan.weight_axes.update({gate: 1, up: 1, down: 2})
    if biases:
        plan.weight_axes.update({biases[0]: 1, biases[1]: 1})
        plan.first_rank_only.add(biases[2])
    plan.row_parallel.append(node.name)


def _shard(graph: Graph, plan: _Plan, rank: int) -> Shard:
    """Rank `rank`'s graph: split shapes, attention attributes and constants, an all_reduce after
    each row-parallel linear and each split moe_ffn (their consumers read the sum)."""
    n_ranks = plan.ranks
    g = Graph(f"{graph.name} (rank {rank} of {n_ranks})", outputs=dict(graph.outputs),
              constants=dict(graph.constants), _counter=graph._counter)
    renamed: dict[str, str] = {}
    for node in graph.nodes.values():
        n = copy.deepcopy(node)
        n.inputs = tuple(renamed.get(i, i) for i in n.inputs)
        if n.name in plan.split:
            n.shape = (*n.shape[:-1], n.shape[-1] // n_ranks)
            if n.op == "constant":
                g.constants[n.name] = np.split(graph.constants[n.name], n_ranks, axis=-1)[rank]
        if n.name in plan.weight_axes:
            axis = plan.weight_axes[n.name]
            n.shape = tuple(d // n_ranks if i == axis else d for i, d in enumerate(n.shape))
        if n.op == "attention":
            n.attrs = {**n.attrs, "n_heads": n.attrs["n_heads"] // n_ranks,
                       "n_kv_heads": n.attrs["n_kv_heads"] // n_ranks}
        g.nodes[n.name] = n
        if n.name in plan.row_parallel:
            total = f"{n.name}.all_reduce"
            g.nodes[total] = Node(total, "all_reduce", (n.name,), {"ranks": n_ranks}, n.shape, n.dtype)
            renamed[n.name] = total
    g.outputs = {k: renamed.get(v, v) for k, v in graph.outputs.items()}
    return Shard(rank, n_ranks, g, dict(plan.weight_axes), set(plan.first_rank_only))

"""The graph builder: architectures are written as Python calls that append op nodes to a Graph.

    g = Graph("tiny")
    ids, pos = g.input("ids", ("T",), "i32"), g.input("pos", ("T",), "i32")
    x = g.op("embedding", g.weight("model.embed_tokens.weight", (V, D)), ids)
    y = g.op("silu", x) * x               # Values overload + and *
    g.output(logits=y)

Sources are inputs (per step: token ids, positions), weights (named by their Hugging Face tensor
names), constants (small arrays computed from the config, such as RoPE frequencies) and state
(persistent buffers such as the KV cache, whose rows the "S" symbol counts).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import ops as _ops

SOURCE_OPS = ("input", "weight", "constant", "state")


@dataclass
class Node:
    """One op (or source) of a graph: its operands by name, attributes, output shape and dtype."""
    name: str
    op: str                      # a registry op name, or one of SOURCE_OPS
    inputs: tuple[str, ...]
    attrs: dict
    shape: tuple                 # ints and symbols ("T", "S")
    dtype: str                   # "f32" for activations, "i32" for ids, "w" for weights


class Value:
    """A handle on one node's output, for writing graphs with plain Python expressions."""

    def __init__(self, graph: "Graph", name: str):
        self.graph, self.name = graph, name

    @property
    def shape(self) -> tuple:
        """The node's shape: ints, and the symbols "T" (tokens per step) and "S" (context)."""
        return self.graph.nodes[self.name].shape

    def __add__(self, other: "Value") -> "Value":
        return self.graph.op("add", self, other)

    def __mul__(self, other: "Value") -> "Value":
        return self.graph.op("mul", self, other)

    def __repr__(self) -> str:
        return f"Value({self.name}: {self.shape})"


@dataclass
class Graph:
    """A model step as ops in topological order, with its outputs and constants."""
    name: str
    nodes: dict[str, Node] = field(default_factory=dict)   # in insertion (= topological) order
    outputs: dict[str, str] = field(default_factory=dict)  # output name -> node name
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    _counter: int = 0

    # ---- sources ----
    def input(self, name: str, shape: tuple, dtype: str = "f32") -> Value:
        """A value the runtime sets before each step (token ids, position); "T" in `shape` is the
        step's token count."""
        return self._add(Node(name, "input", (), {}, tuple(shape), dtype))

    def weight(self, name: str, shape: tuple) -> Value:
        """A weight by its checkpoint name; asking twice (tied embeddings) gives the same node."""
        node = self.nodes.get(name)
        if node is not None and node.op == "weight" and node.shape == tuple(shape):
            return Value(self, name)
        return self._add(Node(name, "weight", (), {}, tuple(shape), "w"))

    def constant(self, name: str, array: np.ndarray) -> Value:
        """A float32 array baked into the model (e.g. RoPE's inverse frequencies), uploaded once."""
        values = np.asarray(array, np.float32)
        value = self._add(Node(name, "constant", (), {}, values.shape, "f32"))   # a taken name fails here
        self.constants[name] = values
        return value

    def state(self, name: str, shape: tuple) -> Value:
        """State kept across steps (a KV cache); "S" in `shape` is the context length."""
        return self._add(Node(name, "state", (), {}, tuple(shape), "f32"))

    # ---- ops ----
    def op(self, opname: str, *args: Value, name: str | None = None, **attrs) -> Value:
        """Append one op node; its shape is inferred now, so a mistake fails where it is made."""
        opdef = _ops.get(opname)
        if not opdef.arity <= len(args) <= opdef.arity + opdef.optional:
            count = f"{opdef.arity} to {opdef.arity + opdef.optional}" if opdef.optional else opdef.arity
            raise TypeError(f"{opname} takes {count} operands, got {len(args)}")
        attrs = {**opdef.attr_defaults, **attrs}
        shapes = [self.nodes[a.name].shape for a in args]
        where = name or f"{opname} #{self._counter + 1}"
        try:
            shape, dtype = opdef.shape_rule(shapes, attrs)
        except (_ops.ShapeError, ValueError, TypeError) as e:   # incl. operands of the wrong rank
            raise _ops.ShapeError(f"{where}: {e} (operand shapes {shapes})") from None
        except KeyError as e:                                    # a shape rule's attribute not given
            raise _ops.ShapeError(f"{where}: {opname} needs the attribute {e.args[0]!r}") from None
        if name is None:
            self._counter += 1
            name = f"{opname}_{self._counter}"
        return self._add(Node(name, opname, tuple(a.name for a in args), attrs, tuple(shape), dtype))

    def output(self, **values: Value) -> None:
        """Name the graph's results (a language model's: `logits`)."""
        self.outputs.update({k: v.name for k, v in values.items()})

    def _add(self, node: Node) -> Value:
        if node.name in self.nodes:
            raise ValueError(f"graph '{self.name}' already has a node named '{node.name}'")
        self.nodes[node.name] = node
        return Value(self, node.name)

    def sources(self, op: str) -> list[Node]:
        """The nodes of source kind `op` ("input", "weight", "constant", "state"), in order added."""
        return [n for n in self.nodes.values() if n.op == op]

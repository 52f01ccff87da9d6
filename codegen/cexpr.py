"""C expressions for elementwise ops, filled from each op's `c_expr` in the registry."""
from __future__ import annotations

import math
import string

import networkx as nx

from ..dsl import get


def float_literal(x: float) -> str:
    """A C float literal that survives any Python float (30 -> 30.0f, 1e-5 -> 1e-05f)."""
    x = float(x)
    if math.isnan(x):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(x):
        return "__int_as_float(0x7f800000)" if x > 0 else "__int_as_float(0xff800000)"
    r = repr(x)
    return (r if any(c in r for c in ".e") else r + ".0") + "f"


def elementwise(G: nx.DiGraph, node: str, operands: list[str]) -> str:
    """The C expression of elementwise `node` applied to the C expressions `operands`."""
    d = G.nodes[node]
    return elementwise_op(d["op"], operands, d["attrs"])


def elementwise_op(op: str, operands: list[str], attrs: dict | None = None) -> str:
    """The C expression of elementwise op `op` (attributes `attrs`) over `operands`."""
    opdef = get(op)
    fields = {f for _, f, _, _ in string.Formatter().parse(opdef.c_expr) if f}
    names = dict(zip("abcdefgh", (f"({o})" for o in operands)))
    values = {k: float_literal(v) for k, v in {**opdef.attr_defaults, **(attrs or {})}.items() if k in fields}
    return f"({opdef.c_expr.format(**names, **values)})"

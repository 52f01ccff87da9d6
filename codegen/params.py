"""Kernel parameters: each graph value a kernel touches becomes one typed pointer argument."""
from __future__ import annotations

import networkx as nx

from ..dsl import get


def storage_of(G: nx.DiGraph, value: str) -> str:
    """The value whose memory holds `value` (an in-place cache write lives in its cache)."""
    d = G.nodes[value]
    while d["op"] not in ("input", "weight", "constant", "state") and get(d["op"]).inplace_of is not None:
        value = d["inputs"][get(d["op"]).inplace_of]
        d = G.nodes[value]
    return value


def c_type(G: nx.DiGraph, value: str, written: bool) -> str:
    """The C pointer type of a kernel argument holding `value`."""
    d = G.nodes[storage_of(G, value)]
    if d["op"] == "weight":   # bf16, or the bytes of a quantized format (quant/formats.py)
        return "const weight_t*" if d.get("format", "bf16") == "bf16" else "const unsigned char*"
    if d["op"] == "state":   # a KV cache: bf16 values or fp8 rows (codegen/kv_cache.py)
        from .kv_cache import layout_of
        elem = "unsigned char" if layout_of(G, value).fp8 else "bf16_t"
        return f"{elem}*" if written else f"const {elem}*"
    base = "int" if d["dtype"] == "i32" else "float"
    return f"{base}*" if written else f"const {base}*"


class Params:
    """Collects a kernel's pointer arguments in order; `ref` gives the C name of a value."""

    def __init__(self, G: nx.DiGraph):
        self.G = G
        self.values: list[str] = []      # graph value names, in argument order
        self.decls: list[str] = []

    def ref(self, value: str, written: bool = False) -> str:
        store = storage_of(self.G, value)
        if store not in self.values:
            self.values.append(store)
            # __restrict__ (read-only, non-coherent loads) for weights alone: activations and caches
            # are written by the previous kernel, which may still run (programmatic dependent
            # launch), and loads the compiler thinks invariant could be hoisted above the wait.
            restrict = " __restrict__" if self.G.nodes[store]["op"] == "weight" else ""
            self.decls.append(f"{c_type(self.G, value, written)}{restrict} p{len(self.values) - 1}")
        return f"p{self.values.index(store)}"

    def extra(self, decl: str, key: str) -> str:
        """A pointer that is not a graph value (the workspace shared by attention and MoE kernels,
        which never need it at the same time): `key` names it for the runtime."""
        self.values.append(key)
        self.decls.append(f"{decl} p{len(self.values) - 1}")
        return f"p{len(self.values) - 1}"

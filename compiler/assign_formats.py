"""Pass: the format each weight is held in on the GPU (quant/formats.py), as node attribute "format".

The checkpoint decides it (a GGUF's block types, or --quant), the graph does not; the kernels
read it (codegen/gemv.py, rowwise.py, moe.py) and the fusion passes never look at it. Only weights
that GEMVs, embeddings and the experts of a MoE read may be quantized: their kernels have a reader
per format.

Before: a lowered graph. After: the same graph, weights named in `formats` carrying their format.
"""
from __future__ import annotations

from typing import Mapping

import networkx as nx

from ..dsl import Kind
from ..errors import FuselmError
from ..quant.formats import format_of

# The kinds of op that read a quantized weight, and at which of their inputs
QUANTIZABLE = {Kind.LINEAR: (1,), Kind.EMBEDDING: (0,), Kind.MOE: (2, 3, 4)}


def _reads_quantized(G: nx.DiGraph, reader: str, weight: str) -> bool:
    """Whether op `reader` has a quantized reader for its input `weight`."""
    d = G.nodes[reader]
    return d["inputs"].index(weight) in QUANTIZABLE.get(d["kind"], ())


def assign_formats(G: nx.DiGraph, formats: Mapping[str, str]) -> nx.DiGraph:
    """`G` with G.nodes[w]["format"] = formats[w] for each weight named (bf16 for the rest). A
    weight of an op that cannot read its format, or whose rows do not hold whole blocks, is an
    error naming it."""
    H = G.copy()
    for name, fmt in formats.items():
        if name not in H or H.nodes[name]["op"] != "weight":
            raise FuselmError(f"weight format for '{name}': the graph has no such weight")
        f = format_of(fmt)
        if f.name == "bf16":
            continue
        shape = H.nodes[name]["shape"]
        if need := f.misfit(shape):
            raise FuselmError(f"weight '{name}' of shape {shape} cannot be held as {f.name} ({need})")
        for reader in H.successors(name):
            if not _reads_quantized(H, reader, name):
                raise FuselmError(f"weight '{name}' is read by '{reader}' ({H.nodes[reader]['op']}), "
                                  f"which has no {f.name} reader")
        H.nodes[name]["format"] = f.name
    return H


def quantizable_weights(G: nx.DiGraph) -> set[str]:
    """The weights of a lowered graph that every reader could read quantized: the matrices of
    GEMVs (input 1 of a linear), embedding tables (input 0) and the expert stacks of a MoE."""
    out = set()
    for name, d in G.nodes(data=True):
        if d["op"] != "weight" or len(d["shape"]) not in (2, 3):
            continue
        readers = list(G.successors(name))
        if readers and all(_reads_quantized(G, r, name) for r in readers):
            out.add(name)
    return out


def quantizable_shapes(graph) -> dict[str, tuple[int, ...]]:
    """The weights of a DSL graph that kernels could read quantized, with their shapes."""
    from .lower import to_networkx
    G = to_networkx(graph)
    return {n: G.nodes[n]["shape"] for n in quantizable_weights(G)}

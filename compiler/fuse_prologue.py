"""Pass: prologue fusion of normalizations into the GEMVs and routed experts they feed.

Before: a NORM node whose every reader is a LINEAR node or reads it as a MOE node's input
vector (a MoE layer's norm feeds its router and its experts), in a kernel of its own.
After: the NORM runs inside the gemv or moe kernel of its readers: each block recomputes the
row's statistics (cheap: the vector comes from L2) and scales the vector as it streams the
weights, so the normalized vector never goes through memory. When the readers sit in several
kernels, the norm is cloned, one copy per kernel. Norms read by anything else, that are graph
outputs, or that normalise groups of a row separately, stay where they are.
"""
from __future__ import annotations

from collections import defaultdict

import networkx as nx

from ..dsl import Kind
from .kernels import members, merge


def fuse_prologue(G: nx.DiGraph) -> nx.DiGraph:
    """Move each norm that only GEMVs and experts read into their kernels (see the module docstring)."""
    G = G.copy()
    groups = members(G)
    for norm in [n for n, d in G.nodes(data=True) if d["kind"] is Kind.NORM]:
        readers = list(G.successors(norm))
        if not readers or not all(_takes_prologue(G, r, norm) for r in readers) \
                or norm in G.graph["outputs"].values() or not _whole_row(G, norm):
            continue   # an output must be written; per-group norms need a whole row first
        by_kernel: dict[str, list[str]] = defaultdict(list)
        for r in readers:
            by_kernel[G.nodes[r]["kernel"]].append(r)
        if any(G.nodes[n]["kind"] is Kind.NORM for k in by_kernel for n in groups[k]):
            continue   # a kernel has one prologue
        first, *others = sorted(by_kernel)
        for kernel in others:
            clone = _clone(G, norm, f"{norm}@{kernel}", by_kernel[kernel])
            G.nodes[clone]["kernel"] = kernel
            groups[kernel].append(clone)
        own = G.nodes[norm]["kernel"]
        if merge(G, [first, own], into=first):
            groups[first] += groups.pop(own)
    return G


def _takes_prologue(G: nx.DiGraph, reader: str, norm: str) -> bool:
    """Whether `reader` reads `norm` as the vector its kernel streams weights against: any
    linear, or a moe node's input (not its router logits)."""
    kind = G.nodes[reader]["kind"]
    return kind is Kind.LINEAR or (kind is Kind.MOE and G.nodes[reader]["inputs"][0] == norm
                                   and norm not in G.nodes[reader]["inputs"][1:])


def _whole_row(G: nx.DiGraph, norm: str) -> bool:
    """Whether the norm takes one statistic over the whole row (not one per group, say per head)."""
    group = G.nodes[norm]["attrs"].get("group")
    return group in (None, G.nodes[norm]["shape"][-1])


def _clone(G: nx.DiGraph, norm: str, name: str, readers: list[str]) -> str:
    """Copy `norm` as `name` and make `readers` read the copy."""
    G.add_node(name, **{**G.nodes[norm], "attrs": dict(G.nodes[norm]["attrs"])})
    for src in G.nodes[norm]["inputs"]:
        G.add_edge(src, name)
    for r in readers:
        G.remove_edge(norm, r)
        G.add_edge(name, r)
        G.nodes[r]["inputs"] = tuple(name if i == norm else i for i in G.nodes[r]["inputs"])
    return name

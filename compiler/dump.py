"""Writes the graph after a pass as text (kernels and their nodes) and as Graphviz DOT."""
from __future__ import annotations

from pathlib import Path

import networkx as nx

from .kernels import members


def as_text(G: nx.DiGraph) -> str:
    """The graph as text: every kernel with its nodes, then the arena sizes if planned."""
    lines = [f"# {G.graph.get('name')}: {len(G)} nodes, {len(members(G))} kernels"]
    for k, nodes in members(G).items():
        lines.append(f"kernel {k}")
        for n in nodes:
            d = G.nodes[n]
            lines.append(f"    {n} = {d['op']}({', '.join(d['inputs'])}) -> {list(d['shape'])}")
    for key in ("arena_bytes", "arena_bytes_no_reuse"):
        if key in G.graph:
            lines.append(f"{key} = {G.graph[key]}")
    return "\n".join(lines) + "\n"


def as_dot(G: nx.DiGraph) -> str:
    """Nodes clustered by kernel; sources drawn as boxes outside any cluster."""
    out = ["digraph G {", "  rankdir=TB; node [fontsize=10];"]
    for i, (k, nodes) in enumerate(members(G).items()):
        out.append(f'  subgraph cluster_{i} {{ label="{k}";')
        out += [f'    "{n}" [label="{n}\\n{G.nodes[n]["op"]}"];' for n in nodes]
        out.append("  }")
    for u, v in G.edges:
        if G.nodes[u]["kernel"] is None:
            out.append(f'  "{u}" [shape=box];')
        out.append(f'  "{u}" -> "{v}";')
    return "\n".join(out + ["}"]) + "\n"


def dump(G: nx.DiGraph, directory: str | Path, index: int, pass_name: str) -> None:
    """Write NN_<pass>.txt and NN_<pass>.dot into `directory`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{index:02d}_{pass_name}.txt").write_text(as_text(G))
    (d / f"{index:02d}_{pass_name}.dot").write_text(as_dot(G))

"""Pass: an attention kernel takes in its output projection and the residual add after it.

Before: attention kernels of one node; gemv kernels with their epilogues.
After: where an attention's only reader is a linear (the O projection) whose kernel is that linear
and an add of its output and one other value of the same shape (the residual), the three form one
"attention" kernel. Split attention then hands its chunks' softmax states straight to the
projection: blocks per KV head and tile of output rows merge that head's chunks and multiply them
into their rows, with no combine launch between (codegen/attention.py). The attention output
itself still gets a buffer, for the one-launch variant at short contexts and its GEMV.

Only where the head size is a multiple of 8 (the projection's 16-byte weight loads) and the graph
does not output the attention itself. FUSELM_ATTN_FUSE_O=0 leaves the graph as it is.
"""
from __future__ import annotations

import networkx as nx

from ..codegen.knobs import env_int
from ..dsl import Kind
from .kernels import attention_projection, members, merge

ENABLED = env_int("FUSELM_ATTN_FUSE_O", 1, 0, 1)


def fuse_attention_output(G: nx.DiGraph) -> nx.DiGraph:
    """Merge each attention with its output projection and residual add (see the module docstring)."""
    G = G.copy()
    if not ENABLED:
        return G
    groups = members(G)
    outputs = set(G.graph["outputs"].values())
    for kernel, nodes in list(groups.items()):
        if len(nodes) != 1 or G.nodes[nodes[0]]["kind"] is not Kind.ATTENTION:
            continue
        a = nodes[0]
        readers = list(G.successors(a))
        if len(readers) != 1 or a in outputs or G.nodes[a]["attrs"]["head_dim"] % 8:
            continue
        projection = groups.get(G.nodes[readers[0]]["kernel"], [])
        if attention_projection(G, [a, *projection]):
            merge(G, [kernel, G.nodes[readers[0]]["kernel"]])
    return G

"""Paged KV caches: many sequences' rows in one pool of fixed-size pages.

    paged(graph, page=16)      a copy of `graph` for steps that mix sequences (table=: its width fixed)
    table_width(ctx, page)     the pages of one sequence's table

A model graph writes and reads one sequence's cache, row p for position p. Its paged copy takes
one more input, `pages` [T, P] (int32): token t's sequence's page table, whose entry j is the
pool page holding that sequence's positions [j * page, (j + 1) * page). Each `kv_write` becomes
`paged_kv_write` (row pages[t, p // page] * page + p % page) and each `attention` becomes
`paged_attention` over the rows of the token's own sequence. So one step can hold a prompt chunk
of one sequence beside the next tokens of others (continuous batching), and sequences that share
a prompt prefix can share its pages (runtime/kv_pages.py). The state's "S" rows are then the
pool's pages times `page`; "P" is the page table's width.
"""
from __future__ import annotations

import copy

from ..errors import FuselmError
from .graph import Graph, Node
from .ops import get

PAGED_OPS = {"kv_write": "paged_kv_write", "attention": "paged_attention"}


def paged(graph: Graph, page: int, table: int | None = None) -> Graph:
    """A copy of `graph` whose caches are addressed through the input `pages` [T, P] (see the
    module docstring); `page` is the rows per page, `table` fixes P (the GPU kernels need it
    fixed: table_width of the longest sequence)."""
    if page < 1:
        raise FuselmError(f"a KV page must hold at least one row, got {page}")
    if "pages" in graph.nodes:
        raise FuselmError(f"graph '{graph.name}' already has a node named 'pages'")
    g = copy.deepcopy(graph)
    nodes = {"pages": Node("pages", "input", (), {}, ("T", table or "P"), "i32")}
    for n in g.nodes.values():
        if n.op in PAGED_OPS:
            base = get(n.op).arity     # the table goes after the op's own operands, before optional ones
            n.op, n.inputs = PAGED_OPS[n.op], (*n.inputs[:base], "pages", *n.inputs[base:])
            n.attrs = {**n.attrs, "page": page}
        nodes[n.name] = n
    g.nodes = nodes     # `pages` first: the order stays topological
    return g


def table_width(ctx: int, page: int) -> int:
    """Pages in the table of a sequence of at most `ctx` tokens."""
    return -(-ctx // page)


def is_paged(graph: Graph) -> bool:
    """Whether `graph` addresses its caches through page tables."""
    return any(n.op in PAGED_OPS.values() for n in graph.nodes.values())

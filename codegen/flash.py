"""Causal flash attention for prefill steps (templates/flash.cuh): the attention family's prefill
kernel where the head layout allows (head size 64 or 128). A block takes one KV head and as many
consecutive tokens as their query heads fill its rows (16 an mma warp, tuning flash_warps warps),
and walks the cache once for all of them
in tiles of 64 rows through shared memory, where the decode-style passes re-read it for every
few tokens (codegen/attention.py: prefill_rows). Q and P reach the tensor cores in bf16, as
in a bf16 transformers run."""
from __future__ import annotations

import networkx as nx

from . import cexpr
from .attention import sinks_arg
from .kernel import KernelSource, KernelSpec, Launch
from .kv_cache import attention_cache
from .params import Params
from .render import render

ROWS = 64                   # query rows ((token, head) pairs) of the smallest block: 4 warps
TILE_ROWS = 64              # cache rows a tile (flash.cuh FLASH_BN)


def fits(G: nx.DiGraph, node: str, tokens: int) -> bool:
    """Whether this attention node's prefill steps of `tokens` tokens run as flash attention:
    head size 64 or 128 (rows of whole groups of 8 chunks: the swizzle stays inside them), at
    most 64 query heads per KV head; bf16 or fp8 caches (fp8 tiles made bf16 once each)."""
    if G.nodes[node]["op"] != "attention":   # paged attention: tokens of many sequences
        return False
    a = G.nodes[node]["attrs"]
    hd, group = a["head_dim"], a["n_heads"] // a["n_kv_heads"]
    return tokens > 1 and hd in (64, 128) and group <= ROWS


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of a block: two tiles of K and V rows in flight (fp8 caches: the
    same bytes, one bf16 tile pair and two of codes)."""
    return 2 * 2 * TILE_ROWS * head_dim * 2


def generate(spec: KernelSpec) -> KernelSource:
    """The flash prefill kernel of one ATTENTION node for steps of spec.tokens tokens."""
    G, launch, tokens = spec.G, spec.launch, spec.tokens
    params = Params(G)
    (n,) = launch.nodes
    q, kc, vc, pos = G.nodes[n]["inputs"][:4]
    a = G.nodes[n]["attrs"]
    H, KV, hd = a["n_heads"], a["n_kv_heads"], a["head_dim"]
    warps = spec.tuning.flash_warps
    tok = 16 * warps // (H // KV)
    cache = attention_cache(G, n, spec.target)
    name, source = render(
        "flash.cu.j2", "attention", f"h{H}_kv{KV}_d{hd}{'_fp8' if cache.fp8 else ''}_flash", params=params.decls,
        H=H, KV=KV, HD=hd, tok=tok, tokens=tokens, cache=cache.c_type, threads=32 * warps, warps=warps, window=int(a.get("window") or 0),
        scale=cexpr.float_literal(a["scale"]), softcap=cexpr.float_literal(a.get("softcap") or 0.0),
        q=params.ref(q), kc=params.ref(kc), vc=params.ref(vc), pos=params.ref(pos), out=params.ref(n, written=True),
        sinks=sinks_arg(G, n, params))
    grid = (KV, -(-tokens // tok))
    return KernelSource(name, "attention", source, launch.nodes,
                        [Launch(f"{name}_prefill", grid, 32 * warps, params.values, smem=smem_bytes(hd))], launch.layer)

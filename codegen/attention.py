"""The attention family: flash-decoding over the KV cache, a split launch and a combine launch."""
from __future__ import annotations

import networkx as nx

from ..errors import FuselmError
from . import cexpr
from .params import Params

CHUNK = 64       # cache positions per block: small, so that long contexts give many blocks
THREADS = 128


def context(G: nx.DiGraph, launch: dict, params: Params, rows: int) -> dict:
    """Template variables of one attention launch over a cache of `rows` positions."""
    (n,) = launch["nodes"]
    d = G.nodes[n]
    q, kc, vc, pos = d["inputs"]
    a = d["attrs"]
    nchunk = -(-rows // CHUNK)
    group, hd = a["n_heads"] // a["n_kv_heads"], a["head_dim"]
    smem = 4 * (group * hd + group * CHUNK + 4 * group * hd)          # qs, score, partial (attention.cuh)
    if smem > 48 * 1024:
        raise FuselmError(f"{n}: {group} query heads per KV head of {hd} need {smem} bytes of shared "
                          f"memory in the attention kernel; at most {48 * 1024} are supported")
    return {"H": a["n_heads"], "KV": a["n_kv_heads"], "HD": a["head_dim"], "chunk": CHUNK,
            "nchunk": nchunk, "window": int(a.get("window") or 0), "scale": cexpr.float_literal(a["scale"]),
            "softcap": cexpr.float_literal(a.get("softcap") or 0.0), "threads": THREADS,
            "q": params.ref(q), "kc": params.ref(kc), "vc": params.ref(vc), "pos": params.ref(pos),
            "out": params.ref(n, written=True),
            "ws": params.extra("float*", "workspace"),
            "workspace_floats": a["n_heads"] * nchunk * (a["head_dim"] + 2)}

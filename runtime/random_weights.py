"""Random weights of a model's real shapes, made directly on the GPU (nothing to download or carry)."""
from __future__ import annotations

from ..dsl import Graph


def random_gpu_weights(graph: Graph, seed: int = 0, std: float = 0.02, formats=None) -> dict:
    """Every weight of `graph` made on the GPU: bf16 bits (cupy uint16), N(0, std) matrices and
    norms near 1; the weights `formats` names in their quantized format instead, with random
    codes and scales of about the same spread (quant/layout.random_weight)."""
    import cupy as cp

    from ..quant.layout import random_weight
    from .cuda_engine import to_bf16_bits
    rng = cp.random.default_rng(seed)
    out = {}
    for i, node in enumerate(graph.sources("weight")):
        if formats and node.name in formats:
            out[node.name] = random_weight(formats[node.name], node.shape, std, xp=cp, seed=seed + i)
            continue
        if len(node.shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(node.shape, dtype=cp.float32)
        else:
            w = std * rng.standard_normal(node.shape, dtype=cp.float32)
        out[node.name] = to_bf16_bits(w)
        del w
    return out

"""Random weights of a model's real shapes, made directly on the GPU (nothing to download or carry)."""
from __future__ import annotations

from ..dsl import Graph


def random_gpu_weights(graph: Graph, seed: int = 0, std: float = 0.02) -> dict:
    """bf16 bits (cupy uint16) for every weight of `graph`: N(0, std) matrices, norms near 1."""
    import cupy as cp

    from .cuda_engine import to_bf16_bits
    rng = cp.random.default_rng(seed)
    out = {}
    for node in graph.sources("weight"):
        if len(node.shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(node.shape, dtype=cp.float32)
        else:
            w = std * rng.standard_normal(node.shape, dtype=cp.float32)
        out[node.name] = to_bf16_bits(w)
        del w
    return out

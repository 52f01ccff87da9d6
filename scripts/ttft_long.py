"""Time to first token of one long prompt on the GPU (random weights of a preset's real shapes):
the prompt runs through the batched prefill in its largest steps, each attending to the cache
rows the steps before it wrote. Prints the TTFT, prompt tokens/s and the GPU memory held.

    python3 scripts/ttft_long.py llama-3.1-8b 32768 [--kv fp8]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    import cupy as cp

    from fuselm.models import build_graph
    from fuselm.models.presets import preset
    from fuselm.runtime.cuda_engine import CudaEngine
    from fuselm.runtime.engine import SamplingParams
    from fuselm.runtime.random_weights import random_gpu_weights
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset")
    p.add_argument("tokens", type=int)
    p.add_argument("--kv", choices=("bf16", "fp8"), default="bf16", help="the KV cache's dtype")
    a = p.parse_args()
    cfg = preset(a.preset)
    graph = build_graph(cfg)
    engine = CudaEngine(graph, random_gpu_weights(graph), ctx=a.tokens + 64, kv=a.kv)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, a.tokens).tolist()
    greedy = SamplingParams()
    for run in range(2):                       # the first run also captures the steps' graphs
        engine.reset()
        t0 = time.perf_counter()
        engine.prefill(prompt, greedy)
        ttft = time.perf_counter() - t0
        print(f"{a.preset} {a.tokens}-token prompt, {a.kv} KV, run {run}: TTFT {ttft * 1e3:.1f} ms "
              f"({a.tokens / ttft:,.0f} tok/s), GPU memory pool {cp.get_default_memory_pool().total_bytes() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()

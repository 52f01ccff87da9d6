"""The prefill step's generated gemm kernels side by side with cuBLAS on the same shapes (GPU).

Each gemm kernel of a preset's largest prefill step (random weights) is timed alone, as
`fuselm bench --profile` does, and cuBLAS (cublasGemmEx: bf16 operands, float32 accumulation,
the weights [rows][k] and the step's vectors [tokens][k], both K-major) multiplies the same
shape: all the kernel's weight rows (a fused Q/K/V or gate/up counts as one gemm) by the step's
tokens. cuBLAS computes the product alone; the generated kernel also runs its epilogue (norm
scale, RoPE, cache writes, SiLU, residual), and its stage launch is listed apart.

    python3 scripts/gemm_vs_cublas.py llama-3.1-8b llama-3.2-1b [--tune prefill_tokens=512/256/64/32]
    python3 scripts/gemm_vs_cublas.py --cublas 28672x4096,4096x14336 --tokens 256   # cuBLAS alone
"""
from __future__ import annotations

import argparse


def cublas_us(cp, rows: int, k: int, tokens: int, reps: int = 20) -> float:
    """Microseconds of one bf16 cublasGemmEx of `rows` x `k` weights by `tokens` vectors."""
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    from fuselm.tools.profile import elapsed_us
    bf16, compute_32f, op_n, op_t = 14, 68, 0, 1    # CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUBLAS_OP_N / _T
    w = cp.random.randint(0x3C00, 0x3C80, (rows, k)).astype(cp.uint16)    # bf16 bits near 0.01
    x = cp.random.randint(0x3C00, 0x3C80, (tokens, k)).astype(cp.uint16)
    y = cp.empty((tokens, rows), cp.uint16)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, 0)            # CUBLAS_POINTER_MODE_HOST: alpha, beta on the host

    def run():   # column-major: C (rows x tokens) = W^T' (rows x k) . X' (k x tokens)
        cublas.gemmEx(handle, op_t, op_n, rows, tokens, k,
                      one.ctypes.data, w.data.ptr, bf16, k, x.data.ptr, bf16, k,
                      zero.ctypes.data, y.data.ptr, bf16, rows, compute_32f, -1)   # CUBLAS_GEMM_DEFAULT
    return elapsed_us(cp, cp.cuda.get_current_stream(), run, reps)


def main() -> None:
    import cupy as cp

    from fuselm.codegen.tuning import Tuning
    from fuselm.dsl import Kind
    from fuselm.models import build_graph
    from fuselm.models.presets import preset
    from fuselm.runtime.cuda_engine import CudaEngine
    from fuselm.runtime.random_weights import random_gpu_weights
    from fuselm.tools.profile import prefill_profile
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("presets", nargs="*")
    p.add_argument("--tune", default="", help="tuning changes, as FUSELM_TUNE")
    p.add_argument("--cublas", default="", help="ROWSxK,...: only cuBLAS, on these shapes (for a profiler)")
    p.add_argument("--tokens", type=int, default=256, help="the step's tokens of --cublas")
    a = p.parse_args()
    for shape in filter(None, a.cublas.split(",")):
        rows, K = map(int, shape.split("x"))
        us = cublas_us(cp, rows, K, a.tokens)
        print(f"cuBLAS {rows} x {K} x {a.tokens} tokens: {us:.1f} us, {2 * rows * K * a.tokens / us / 1e6:.1f} TFLOP/s")
    tuning = Tuning.parse(a.tune, Tuning.from_env())
    for name in a.presets:
        graph = build_graph(preset(name))
        engine = CudaEngine(graph, random_gpu_weights(graph), ctx=4608, tuning=tuning)
        prof = prefill_profile(engine)
        tokens = prof["tokens"]
        step = engine.batched_prefill.steps[tokens]
        print(f"{name}: prefill step of {tokens} tokens, {prof['step_us']} us as a graph")
        print(f"    {'kernel':52s} {'rows':>6s} {'k':>6s} {'fuselm us':>10s} {'TFLOP/s':>8s} {'cuBLAS us':>10s} {'TFLOP/s':>8s}")
        seen = set()
        for k in step.kernels:
            if k.family != "gemm" or k.name in seen:
                continue
            seen.add(k.name)
            shapes = [step.G.nodes[step.G.nodes[n]["inputs"][1]]["shape"] for n in k.nodes
                      if step.G.nodes[n]["kind"] is Kind.LINEAR]
            rows, K = sum(s[0] for s in shapes), shapes[0][1]
            f = prof["functions"][k.launches[-1].function]
            ours = f["us"] / f["launches"]
            theirs = cublas_us(cp, rows, K, tokens)
            flop = 2 * rows * K * tokens
            print(f"    {k.launches[-1].function:52s} {rows:6d} {K:6d} {ours:10.1f} {flop / ours / 1e6:8.1f} "
                  f"{theirs:10.1f} {flop / theirs / 1e6:8.1f}")
            if "stage" in k.launches[0].function:
                s = prof["functions"][k.launches[0].function]
                print(f"    {'  its stage launch':52s} {'':6s} {'':6s} {s['us'] / s['launches']:10.1f}")
        del engine
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()

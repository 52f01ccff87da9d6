"""Launch one decode step's kernels directly (no CUDA graph), for Nsight Compute to time each one.

Usage (GPU machine): ncu --clock-control none -k regex:attention python3 scripts/ncu_step.py PRESET POSITION
PRESET may be PRESET@SCHEME (its weights quantized, quant/schemes.py). Random weights; the step
runs twice (the first warms up), its sampler left out.
"""
import sys

import cupy as cp
import numpy as np

from fuselm.models import build_graph
from fuselm.models.presets import preset
from fuselm.runtime.cuda_engine import CudaEngine
from fuselm.runtime.random_weights import random_gpu_weights
from fuselm.tools.bench import quant_formats

name, position = sys.argv[1], int(sys.argv[2])
name, _, scheme = name.partition("@")
graph = build_graph(preset(name))
weights = random_gpu_weights(graph, formats=quant_formats(graph, scheme) if scheme else None)
engine = CudaEngine(graph, weights, ctx=max(4608, position + 1))
engine.pos.set(np.array([position], np.int32))
engine.ids.set(np.array([1], np.int32))
cp.cuda.Device().synchronize()
for _ in range(2):
    for kernel, _, call in engine.schedule_at(position):
        if kernel.family != "sample":
            call(engine.stream)
engine.stream.synchronize()
print(name, scheme, position, "launches per step:", len(engine.schedule_at(position)))
for kernel, _, _ in engine.schedule_at(position)[:8]:
    print(kernel.name)

"""Code generation: Jinja templates per kernel family, NVRTC compilation with an on-disk cache."""
from __future__ import annotations

import itertools
import re

from .emit import generate, headers, sampler
from .knobs import env_int
from .kernel import KernelSource, Launch


TRACE_EVENTS = 1 << 20   # block events the timeline buffer holds (fuselm_trace in common.cuh)


def trace_enabled() -> bool:
    """FUSELM_TRACE=1: kernels record the block timeline (runtime/trace.py). Read at each call,
    unlike the import-time knobs, so that `fuselm trace` can set it for its own run."""
    return env_int("FUSELM_TRACE", 0, 0, 1) == 1


def module_source(kernels: list[KernelSource]) -> str:
    """One translation unit holding every distinct kernel (layers with one structure share one);
    with FUSELM_TRACE=1 the block timeline is compiled in (see runtime/trace.py)."""
    trace = trace_enabled()
    seen, parts = set(), [f"#define FUSELM_TRACE 1\n#define FUSELM_TRACE_EVENTS {TRACE_EVENTS}"] if trace else []
    for k in kernels:
        if k.name not in seen:
            seen.add(k.name)
            parts.append(k.source)
    source = "\n".join(parts)
    if trace:   # the i-th kernel of the module records id i
        ids = itertools.count()
        source = re.sub(r"TRACE_BLOCK\(\);", lambda _: f"TRACE_BLOCK_AS({next(ids)});", source)
    return source


__all__ = ["generate", "headers", "sampler", "module_source", "trace_enabled", "TRACE_EVENTS", "KernelSource",
           "Launch"]

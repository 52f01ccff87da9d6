"""Code generation: Jinja templates per kernel family, NVRTC compilation with an on-disk cache."""
from __future__ import annotations

import itertools
import re

from .emit import generate, headers, sampler
from .knobs import env_int
from .kernel import KernelSource, Launch

TRACE = env_int("FUSELM_TRACE", 0, 0, 1)


def module_source(kernels: list[KernelSource]) -> str:
    """One translation unit holding every distinct kernel (layers with one structure share one);
    FUSELM_TRACE=1 compiles the block timeline in (see runtime/trace.py)."""
    seen, parts = set(), ["#define FUSELM_TRACE 1"] if TRACE else []
    for k in kernels:
        if k.name not in seen:
            seen.add(k.name)
            parts.append(k.source)
    source = "\n".join(parts)
    if TRACE:   # the i-th kernel of the module records id i
        ids = itertools.count()
        source = re.sub(r"TRACE_BLOCK\(\);", lambda _: f"TRACE_BLOCK_AS({next(ids)});", source)
    return source


__all__ = ["generate", "headers", "sampler", "module_source", "KernelSource", "Launch"]

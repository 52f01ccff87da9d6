"""Code generation: Jinja templates per kernel family, NVRTC compilation with an on-disk cache."""
from __future__ import annotations

from .emit import generate, headers, sampler
from .kernel import KernelSource, Launch


def module_source(kernels: list[KernelSource]) -> str:
    """One translation unit holding every distinct kernel (layers with one structure share one)."""
    seen, parts = set(), []
    for k in kernels:
        if k.name not in seen:
            seen.add(k.name)
            parts.append(k.source)
    return "\n".join(parts)


__all__ = ["generate", "headers", "sampler", "module_source", "KernelSource", "Launch"]

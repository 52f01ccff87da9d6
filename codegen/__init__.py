"""Code generation: a kernel family per module (gemv, gemm, attention, moe, rowwise, sample), each
rendering its Jinja template; build.py assembles a model's whole GPU program; NVRTC compiles it
with an on-disk cache."""
from __future__ import annotations

from .build import DecodeStep, PrefillStep, Program, build_program, module_source
from .emit import generate
from .kernel import KernelSource, Launch
from .render import headers
from .tuning import Target, Tuning

__all__ = ["build_program", "Program", "DecodeStep", "PrefillStep", "module_source", "generate", "headers",
           "KernelSource", "Launch", "Target", "Tuning"]

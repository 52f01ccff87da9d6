"""The CUDA helpers' layering: PTX is written only in the primitive headers (one documented
helper per instruction), and every #include names a header that codegen hands to NVRTC."""
from __future__ import annotations

import re
from pathlib import Path

from fuselm.codegen import headers

TEMPLATES = Path(__file__).resolve().parent.parent / "codegen" / "templates"
PRIMITIVES = {"arch.cuh", "bf16.cuh", "idp.cuh", "mma.cuh", "cp_async.cuh", "bulk_copy.cuh", "pdl.cuh", "sreg.cuh",
              "wgmma.cuh", "barrier.cuh"}
ASM = re.compile(r"\basm\s*(volatile\s*)?\(")
INCLUDE = re.compile(r'^#include\s+"([^"]+)"', re.M)


def _templates() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(TEMPLATES.glob("*.cu*"))}


def test_primitive_headers_exist():
    assert PRIMITIVES <= set(headers())


def test_inline_ptx_only_in_primitive_headers():
    inline = {n for n, text in _templates().items() if ASM.search(text)}
    assert inline <= PRIMITIVES, f"inline PTX outside the primitive headers: {sorted(inline - PRIMITIVES)}"


def test_each_primitive_helper_documented():
    """Every function of a primitive header has a comment line right above it (or above its
    template line)."""
    for name in PRIMITIVES:
        lines = (TEMPLATES / name).read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("__device__"):
                above = i - 1 if i > 0 and not lines[i - 1].startswith("template") else i - 2
                assert above >= 0 and lines[above].startswith("//"), f"{name}:{i + 1}: undocumented helper"


def test_includes_resolve_and_primitives_stand_alone():
    known = set(headers())
    for name, text in _templates().items():
        for inc in INCLUDE.findall(text):
            assert inc in known, f"{name} includes {inc}, which is not a header"
            if name in PRIMITIVES:
                assert inc in PRIMITIVES, f"primitive header {name} includes {inc}"

"""Rendering a family's template and naming the kernel it makes (shared by every family)."""
from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).parent / "templates"


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja environment over codegen/templates (strict: an undefined variable is an error)."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), trim_blocks=True,
                              lstrip_blocks=True, undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def headers() -> dict[str, str]:
    """The .cuh helpers the kernels include, by file name (handed to NVRTC in memory)."""
    return {p.name: p.read_text() for p in sorted(TEMPLATES.glob("*.cuh"))}


def render(template: str, family: str, shape: str, hashed: bool = True, **variables) -> tuple[str, str]:
    """(kernel name, source) of `template` rendered with `variables`. The name is the family, its
    main shape constants and (where `hashed`) a hash of the body: kernels of the same structure
    share it."""
    body = environment().get_template(template).render(name="KERNEL", **variables)
    digest = hashlib.sha1(body.encode()).hexdigest()[:8]
    name = re.sub(r"\W", "_", f"{family}_{shape}" + (f"_{digest}" if hashed else ""))
    return name, body.replace("KERNEL", name)

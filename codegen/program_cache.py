"""Built programs kept on disk, so a warm load skips the compiler passes and code generation
(about a second of Python for the 8B with its prefill and batch steps) when nothing they read
changed.

The key is the SHA-256 of fuselm's own source (every module, template and header of the package)
and of the pickled arguments of the build; the value is the pickled result, before NVRTC (whose
cubins have their own cache, nvrtc.py). Arguments that do not pickle the same way twice only
miss the cache; a changed source file changes every key.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import time
from pathlib import Path
from typing import Callable, TypeVar

from .nvrtc import cache_dir

T = TypeVar("T")
PACKAGE = Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".py", ".j2", ".cuh", ".cu", ".json"}


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over the package's source files, names and contents: its top-level modules and
    every file of its subpackages (folders with an __init__.py: not tests, scripts or a venv)."""
    files = list(PACKAGE.glob("*.py"))
    for sub in PACKAGE.iterdir():
        if (sub / "__init__.py").exists():
            files += [p for p in sub.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cached(kind: str, args: tuple, build: Callable[[], T]) -> T:
    """build(), or what an earlier build() with equal `args` under the same source returned."""
    try:
        key = hashlib.sha256(source_digest().encode() + kind.encode() + pickle.dumps(args, protocol=5)).hexdigest()
    except (pickle.PicklingError, TypeError, AttributeError):
        return build()                      # arguments that do not pickle: no caching
    path = cache_dir().parent / "programs" / f"{kind}-{key}.pickle"
    try:
        return pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        pass                                # absent, or half-written by a process that died
    value = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{time.time_ns()}")
    tmp.write_bytes(pickle.dumps(value, protocol=5))
    tmp.replace(path)                       # atomic: concurrent loads never read half a file
    return value

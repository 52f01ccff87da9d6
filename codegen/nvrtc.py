"""NVRTC through CuPy: CUDA source to a cubin, cached on disk by source, options and NVRTC version.

Uses only `cupy.cuda.nvrtc`, which needs no GPU and no driver, so CI compiles every kernel too.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

from ..errors import FuselmError


def cache_dir() -> Path:
    """Where compiled cubins are kept: $FUSELM_CACHE/kernels, else ~/.cache/fuselm/kernels."""
    return Path(os.environ.get("FUSELM_CACHE", Path.home() / ".cache" / "fuselm")) / "kernels"


def options(arch: str, weight_dtype: str = "bf16", verbose: bool = False) -> list[str]:
    """NVRTC options for `arch` (sm_90 compiles as sm_90a, whose wgmma the prefill gemms use; the
    cubin runs on sm_90 only, as every cubin of an exact arch does); verbose adds ptxas's
    resource report to the log."""
    arch = "sm_90a" if arch == "sm_90" else arch
    opts = [f"--gpu-architecture={arch}", "--std=c++17", f"-DFUSELM_WEIGHT_F16={int(weight_dtype == 'f16')}"]
    return opts + (["--ptxas-options=-v"] if verbose else [])


def compile_cubin(source: str, headers: dict[str, str], opts: list[str], use_cache: bool = True
                  ) -> tuple[bytes, str, bool]:
    """Compile `source`; returns (cubin, NVRTC log, whether it came from the cache)."""
    from cupy.cuda import nvrtc

    version = ".".join(map(str, nvrtc.getVersion()))
    parts = [source, *(f"{k}\0{v}" for k, v in sorted(headers.items())), *opts, version]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    path = cache_dir() / f"{key}.cubin"
    if use_cache and path.exists():
        return path.read_bytes(), "", True
    prog = nvrtc.createProgram(source, "fuselm.cu", [h.encode() for h in headers.values()],
                               [n.encode() for n in headers])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            log = log.decode(errors="replace") if isinstance(log, bytes) else log
            raise FuselmError(f"NVRTC failed to compile generated CUDA ({e}): {_first_error(log)}") from None
        log, cubin = nvrtc.getProgramLog(prog), nvrtc.getCUBIN(prog)
        log = log.decode(errors="replace") if isinstance(log, bytes) else log
    finally:
        nvrtc.destroyProgram(prog)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{time.time_ns()}")
        tmp.write_bytes(cubin)
        tmp.replace(path)        # atomic: concurrent processes never see half a file
    return cubin, log, False


def compile_cubins(sources: list[str], headers: dict[str, str], opts: list[str], use_cache: bool = True
                   ) -> list[tuple[bytes, str, bool]]:
    """compile_cubin of each source, in threads: NVRTC releases the GIL, so a model's decode and
    prefill modules compile side by side (cold start is the longest module, not the sum)."""
    from concurrent.futures import ThreadPoolExecutor

    if len(sources) == 1:
        return [compile_cubin(sources[0], headers, opts, use_cache)]
    with ThreadPoolExecutor(max_workers=min(len(sources), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda s: compile_cubin(s, headers, opts, use_cache), sources))


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()
    return log.strip().splitlines()[0] if log.strip() else "no log"


SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
SMEM = re.compile(r"(\d+) bytes smem")


def _per_function(log: str, rx: re.Pattern) -> dict[str, int]:
    """Per function of ptxas' resource report (needs options(verbose=True)), the sum of the
    numbers `rx` captures on its lines."""
    out, fn = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(r"Function properties for (\w+)", line)
        if m:
            fn = m.group(1)
        s = rx.search(line)
        if s and fn:
            out[fn] = sum(int(g) for g in s.groups())
    return out


def static_smem(log: str) -> dict[str, int]:
    """Per function, the static shared memory in bytes ptxas reported."""
    return _per_function(log, SMEM)


def spills(log: str) -> dict[str, int]:
    """Per function, the spill bytes (stored + loaded) ptxas reported."""
    return _per_function(log, SPILL)

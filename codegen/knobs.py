"""Experiment knobs: FUSELM_* environment variables the code generator reads at import, each
checked at once so that a bad value is a one-line error naming it (docs/perf-notes.md lists them)."""
from __future__ import annotations

import os


def env_int(name: str, default: int, low: int, high: int) -> int:
    """The integer `name`, `default` where unset, within [low, high]."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw}: must be an integer from {low} to {high}") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value}: must be {low} to {high}")
    return value


def env_set(name: str, default: str, known: set[str], what: str) -> set[str]:
    """The comma-separated items of `name` ("0" or empty: none), each one of `known` (`what` they are)."""
    raw = os.environ.get(name, default)
    items = set() if raw.strip() in ("", "0") else {k.strip() for k in raw.split(",") if k.strip()}
    if items - known:
        raise ValueError(f"{name}={raw}: unknown {what} {sorted(items - known)}; "
                         f"known: {', '.join(sorted(known))} (or 0 for none)")
    return items


def env_ints(name: str, default: str, low: int, high: int, multiple: int = 1) -> tuple[int, ...]:
    """The comma-separated integers of `name` (`default` where unset), each within [low, high] and
    a multiple of `multiple`, distinct, largest first."""
    raw = os.environ.get(name, default)
    try:
        values = sorted({int(v) for v in raw.split(",") if v.strip()}, reverse=True)
    except ValueError:
        raise ValueError(f"{name}={raw}: must be comma-separated integers") from None
    bad = [v for v in values if not low <= v <= high or v % multiple]
    if not values or bad:
        raise ValueError(f"{name}={raw}: each must be a multiple of {multiple} from {low} to {high}")
    return tuple(values)


# SMs of the GPU the kernels' grids are sized for (the H200's 132): split-K's target in the GEMVs,
# one wave of attention split blocks.
SMS = env_int("FUSELM_SMS", 132, 1, 4096)

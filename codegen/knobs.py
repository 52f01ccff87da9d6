"""Experiment knobs: FUSELM_* environment variables the code generator reads at import, each
checked at once so that a bad value is a one-line error naming it (docs/perf-notes.md lists them)."""
from __future__ import annotations

import os


def env_int(name: str, default: int, low: int, high: int) -> int:
    """The integer `name`, `default` where unset, within [low, high]."""
    value = int(os.environ.get(name, default))
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

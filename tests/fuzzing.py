"""A small harness for fuzzing what fuselm reads from outside: every outcome must be a clean
result or a one-line FuselmError, never another exception, never a hang.

A `Target` pairs a valid input (the seed) with what consumes it; tests draw corruptions of the
seed with hypothesis (`mutate_json`, `mutate_bytes`) and hand them to `assert_clean`. Model files
are today's targets; a server request is the same shape (a JSON body and the handler that
answers it), so it plugs in as one more Target.
"""
from __future__ import annotations

import contextlib
import math
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from hypothesis import strategies as st

from fuselm.errors import FuselmError

# values that break careless code: boundaries of integer types, non-finite floats, wrong types
EDGE_NUMBERS = [-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63, -2**63, 2**64, 10**30,
                0.5, -0.0, 1e-300, 1e308, math.inf, -math.inf, math.nan, True, False]
json_leaves = st.one_of(st.none(), st.sampled_from(EDGE_NUMBERS), st.integers(-2**70, 2**70),
                        st.floats(), st.text(max_size=12))
json_values = st.recursive(json_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=8)


@dataclass
class Target:
    """Something fuselm consumes from outside: `seed` is a valid input, `consume(input)` feeds it
    to fuselm the way a user would (writing files first where needed)."""
    name: str
    seed: Any
    consume: Callable[[Any], Any]


class Hang(Exception):
    """Raised by assert_clean's alarm when a consumer runs past its time."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise Hang in the main thread after `seconds` (a no-op where SIGALRM does not exist)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def ring(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_clean(target: Target, value, seconds: float = 10.0) -> str | None:
    """Run target.consume(value): it must return, or raise FuselmError whose message is one line.
    Returns that message (None on success); anything else fails the test with the traceback."""
    try:
        with time_limit(seconds):
            target.consume(value)
    except FuselmError as e:
        message = str(e)
        assert message and "\n" not in message, f"{target.name}: error message is not one line: {message!r}"
        return message
    except Hang as e:
        raise AssertionError(f"{target.name}: hangs on this input ({e})") from None
    except Exception as e:  # noqa: BLE001  (the point: no other exception may escape)
        frames = traceback.extract_tb(e.__traceback__)[-8:]
        detail = "".join(traceback.format_list(frames)) + f"{type(e).__name__}: {e}"
        raise AssertionError(f"{target.name}: {type(e).__name__} escaped instead of FuselmError:\n{detail}") from None
    return None


def _containers(doc, path=()):
    """(path, container) of every dict and list inside `doc`, itself included."""
    if isinstance(doc, (dict, list)):
        yield path, doc
        items = doc.items() if isinstance(doc, dict) else enumerate(doc)
        for key, value in items:
            yield from _containers(value, path + (key,))


def mutate_json(data, doc, max_edits: int = 3):
    """A copy of the JSON document `doc` with 1..max_edits edits drawn from `data` (hypothesis'
    st.data()): a value replaced by an edge or random value, a key deleted, a key added."""
    import copy
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, max_edits), label="edits")):
        spots = list(_containers(doc))
        if not spots:
            return data.draw(json_values, label="whole document")
        _, box = data.draw(st.sampled_from(spots), label="where")
        keys = list(box) if isinstance(box, dict) else list(range(len(box)))
        kind = data.draw(st.sampled_from(["replace", "delete", "add"]), label="edit")
        if kind == "add" or not keys:
            new = data.draw(json_values, label="value")
            if isinstance(box, dict):
                box[data.draw(st.text(max_size=8), label="key")] = new
            else:
                box.append(new)
            continue
        key = data.draw(st.sampled_from(keys), label="key")
        if kind == "delete":
            del box[key]
        else:
            box[key] = data.draw(json_values, label="value")
    return doc


def mutate_bytes(data, raw: bytes, end: int, max_edits: int = 6) -> bytes:
    """`raw` with 1..max_edits edits in its first `end` bytes: a byte overwritten, an 8-byte
    little-endian edge integer written, or the file cut short."""
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, max_edits), label="edits")):
        if not min(end, len(out)):
            break
        at = data.draw(st.integers(0, min(end, len(out)) - 1), label="offset")
        kind = data.draw(st.sampled_from(["byte", "int", "cut"]), label="edit")
        if kind == "byte":
            out[at] = data.draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80]) | st.integers(0, 255), label="byte")
        elif kind == "int":
            n = data.draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]), label="int")
            out[at:at + 8] = n.to_bytes(8, "little")
        else:
            del out[at:]
    return bytes(out)

"""Keeping special-token text that users typed out of the token stream of a chat.

`mark` swaps every special token's text inside the messages for a placeholder (two private-use
characters around its index), absent from the template and from every message, so the rendered
chat holds special-token text only where the template wrote it; `split` cuts the rendered text
back into template text and placeholders.
"""
from __future__ import annotations

import re
from typing import Iterator

_PRIVATE = range(0xE000, 0xF900)   # Unicode's private use area: no tokenizer gives it meaning


def mark(messages: list[dict], specials: tuple[str, ...], template: str) -> tuple[list[dict], str]:
    """Copies of `messages` with each special text in their string values (nested lists and dicts
    too) replaced by a placeholder of its index in `specials`; returns them and the sentinel."""
    if not specials:
        return messages, ""
    found = re.compile("|".join(map(re.escape, specials)))
    seen = set(template)
    _collect_chars(messages, seen)
    sentinel = next(chr(c) for c in _PRIVATE if chr(c) not in seen)
    index = {text: i for i, text in enumerate(specials)}

    def swap(value):
        if isinstance(value, str):
            return found.sub(lambda m: f"{sentinel}{index[m[0]]}{sentinel}", value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [swap(v) for v in value]
        return value

    return [swap(m) for m in messages], sentinel


def split(rendered: str, sentinel: str, specials: tuple[str, ...]) -> Iterator[tuple[str, bool]]:
    """The rendered chat in order as (text, typed): typed is False for the template's text and True
    for a special token's text that a message held (a placeholder of mark, put back)."""
    last = 0
    if sentinel:
        s = re.escape(sentinel)
        for m in re.finditer(f"{s}(\\d+){s}", rendered):
            if int(m[1]) >= len(specials):
                continue
            if m.start() > last:
                yield rendered[last:m.start()], False
            yield specials[int(m[1])], True
            last = m.end()
    if last < len(rendered):
        yield rendered[last:], False


def _collect_chars(value, seen: set) -> None:
    if isinstance(value, str):
        seen.update(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_chars(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_chars(v, seen)

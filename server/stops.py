"""Stop strings: the text is cut before the first one, even when it arrives split over pieces."""
from __future__ import annotations

from typing import Sequence


class StopStrings:
    """Filters streamed text pieces. `push` returns the text that is safe to send and whether a stop
    string was reached; a tail that could be the start of a stop string is held back until the next
    piece decides it, and `flush` gives it up at the end."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """The text ready to send after `piece`, and whether a stop string ends the answer there."""
        text = self._held + piece
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self._held = ""
            return text[:min(found)], True
        keep = self._partial_stop_length(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """What is held back; the answer ended without reaching a stop string."""
        text, self._held = self._held, ""
        return text

    def _partial_stop_length(self, text: str) -> int:
        """The length of the longest tail of `text` that begins some stop string."""
        return max((n for stop in self.stops for n in range(min(len(stop) - 1, len(text)), 0, -1)
                    if text.endswith(stop[:n])), default=0)

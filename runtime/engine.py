"""What every backend offers the generation loop: feed tokens, get the next sampled token id.

The CPU backend (the numpy reference executor) and the CUDA backend both implement `Engine`, so
generation, the command line and the Python API never know which one runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked; validate() checks the ranges."""
    temperature: float = 0.0        # 0 means greedy
    top_k: int = 0                  # 0 means no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """Raise ValueError with a one-line message naming the bad parameter."""
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        return self

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to the argmax (temperature 0 or top-k 1)."""
        return self.temperature == 0 or self.top_k == 1


class Engine(Protocol):
    """A compiled model with its KV cache; positions advance with every token fed."""
    device: str          # "cpu" or "cuda"
    max_context: int     # rows of the KV cache
    position: int        # tokens in the cache so far

    def reset(self) -> None:
        """Forget the conversation: position back to 0."""

    def prefill(self, ids: Sequence[int], sampling: SamplingParams) -> int:
        """Feed prompt tokens at the current position; return the sampled next token id."""

    def decode(self, token: int, sampling: SamplingParams) -> int:
        """Feed one token; return the sampled next token id."""

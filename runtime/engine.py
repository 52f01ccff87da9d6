"""What every backend offers the generation loop: feed tokens, get the next sampled token id.

The CPU backend (the numpy reference executor) and the CUDA backend both implement `Engine`, so
generation, the command line and the Python API never know which one runs.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from ..errors import FuselmError


class SamplingError(FuselmError, ValueError):
    """A sampling parameter out of range; `param` names it (the CLI maps it to its option)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked; validate() checks the ranges."""
    temperature: float = 0.0        # 0 means greedy
    top_k: int = 0                  # 0 means no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0   # OpenAI's: minus this on every id the answer holds already
    frequency_penalty: float = 0.0  # minus this times the times the answer holds it
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """Raise SamplingError (a ValueError) with a one-line message naming the bad parameter:
        every number finite, each in its range, the seed a non-negative integer below 2**64."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise SamplingError(name, f"{name} must be a finite number, got {value!r}")
        seed_ok = self.seed is None or (isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool)
                                        and 0 <= self.seed < 2**64)
        checks = [
            ("temperature", self.temperature >= 0, f"must be >= 0, got {self.temperature}"),
            ("top_k", isinstance(self.top_k, numbers.Integral) and self.top_k >= 0,
             f"must be an integer >= 0, got {self.top_k}"),
            ("top_p", 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"),
            ("min_p", 0 <= self.min_p < 1, f"must be in [0, 1), got {self.min_p}"),
            ("repetition_penalty", self.repetition_penalty > 0, f"must be > 0, got {self.repetition_penalty}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, f"must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"must be in [-2, 2], got {self.frequency_penalty}"),
            ("seed", seed_ok, f"must be an integer in [0, 2**64), got {self.seed}"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise SamplingError(name, f"{name} {why}")
        return self

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to the argmax (temperature 0 or top-k 1)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalizes_answer(self) -> bool:
        """Whether presence or frequency penalties apply (the GPU sampler has neither yet)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def value_counts(graph, ctx: int) -> tuple[int, int]:
    """Numbers of values in `graph`'s weights and in its state (KV caches of `ctx` rows): what an
    engine's memory check multiplies by its bytes per value, before any weight is read."""
    from .reference import bind_shape
    weights = sum(math.prod(n.shape) for n in graph.sources("weight"))
    state = sum(math.prod(bind_shape(n.shape, {"S": ctx})) for n in graph.sources("state"))
    return weights, state


def size_text(n: int) -> str:
    """Bytes in GiB, MiB or KiB, whichever is the largest at least 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


class NonFiniteLogits(FuselmError):
    """The logits a token was to be sampled from hold NaN or inf (corrupt weights or config, or an
    overflow): `position` is the 0-based position of the token whose output they are."""

    def __init__(self, position: int, detail: str = ""):
        super().__init__(f"the model's logits at position {position} are not finite{detail}; "
                         "generation stopped (corrupt weights, or a config the model was not made for)")
        self.position = position


def check_logits(logits, position: int) -> None:
    """Raise NonFiniteLogits when the logits row [vocab] of `position` holds NaN or inf."""
    finite = np.isfinite(logits)
    if not finite.all():
        bad = int(np.size(finite) - np.count_nonzero(finite))
        raise NonFiniteLogits(position, f" ({bad} of {np.size(finite)} are NaN or inf)")


class Engine(Protocol):
    """A compiled model with its KV cache; positions advance with every token fed.

    Non-finite logits: prefill and decode never return an id sampled from a logits row that holds
    NaN or inf. They raise NonFiniteLogits naming the position of that row (the last token fed);
    the tokens fed stay in the cache (`position` has advanced), so the caller resets before reuse.
    A CUDA engine has the sampler kernel set a flag beside the sampled id when any logit of the row
    is not finite, reads both in the same device-to-host copy, and raises when the flag is set."""
    device: str          # "cpu" or "cuda"
    max_context: int     # rows of the KV cache
    position: int        # tokens in the cache so far

    def reset(self) -> None:
        """Forget the conversation: position back to 0."""

    def prefill(self, ids: Sequence[int], sampling: SamplingParams) -> int:
        """Feed prompt tokens at the current position; return the sampled next token id (or raise
        NonFiniteLogits, above)."""

    def decode(self, token: int, sampling: SamplingParams) -> int:
        """Feed one token; return the sampled next token id (or raise NonFiniteLogits, above)."""

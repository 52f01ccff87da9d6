"""Log probabilities of the sampled tokens, as OpenAI's `logprobs` report them.

Each is the model's own: log-softmax of the raw logits row (before penalties, temperature or a
grammar's mask, as vLLM reports them), for the token the sampler picked and, where asked, the
`top` most likely ids of that row (ties in id order); the batch engine computes them where the
logits are (runtime/picks.row_logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_CHAT = 20         # OpenAI's bounds on top_logprobs (chat) and logprobs (completions)
MAX_TOP_COMPLETION = 5


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text, its log probability, and the top alternatives (text, logprob)."""
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def from_engine(token: int, logprob: float, ids: np.ndarray, values: np.ndarray, top: int, text_of) -> TokenLogprob:
    """The TokenLogprob of `token` from what a batch engine computed where the logits are
    (runtime/picks.row_logprobs: its log probability, its row's best ids and theirs), the first
    `top` alternatives kept."""
    return TokenLogprob(text_of(token), logprob, tuple((text_of(int(i)), float(v)) for i, v in zip(ids[:top], values[:top])))

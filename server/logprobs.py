"""Log probabilities of the sampled tokens, as OpenAI's `logprobs` report them.

Each is the model's own: log-softmax of the raw logits row (before penalties, temperature or a
grammar's mask, as vLLM reports them), for the token the sampler picked and, where asked, the
`top` most likely ids of that row.
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


def token_logprob(row: np.ndarray, token: int, top: int, text_of) -> TokenLogprob:
    """The TokenLogprob of `token` under logits `row` [vocab], with its `top` most likely ids;
    `text_of(id)` gives a token's text."""
    x = np.asarray(row, np.float64)
    peak = x.max()
    log_total = peak + np.log(np.exp(x - peak).sum())
    best = np.argsort(-x, kind="stable")[:top] if top else ()
    return TokenLogprob(text_of(token), float(x[token] - log_total),
                        tuple((text_of(int(i)), float(x[i] - log_total)) for i in best))

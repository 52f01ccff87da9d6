"""Choosing the next token from a logits vector on the CPU.

The filters run in Hugging Face's order: repetition penalty, temperature, top-k, top-p, min-p;
then one draw from the seeded generator. OpenAI's presence and frequency penalties come first and
count only the ids this sampler has produced (the answer, not the prompt), as vLLM counts them.
An `allowed` mask (structured output) leaves only its ids. Greedy decoding (temperature 0 or top_k 1) still applies
the repetition penalty, as `transformers` does.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from .engine import SamplingParams


class Sampler:
    """Samples token ids under fixed `SamplingParams`; one seeded generator per sampler, so the same
    seed and the same logits give the same sequence of ids.

        sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=1))
        next_id = sampler(logits, history=ids_so_far)
    """

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}      # ids sampled so far -> times

    def __call__(self, logits: np.ndarray, history: Iterable[int] = (), allowed: np.ndarray | None = None) -> int:
        """The next token id for a logits vector [vocab]; `history` holds the ids seen so far
        (prompt and generated), which the repetition penalty discourages; `allowed` [vocab] bool,
        where given, the only ids that may come."""
        p = self.params
        x = np.asarray(logits, np.float64)
        if p.penalizes_answer and self.counts:
            x = penalize_answer(x, self.counts, p.presence_penalty, p.frequency_penalty)
        x = penalize_repetition(x, history, p.repetition_penalty)
        if allowed is not None:
            x = np.where(allowed[:x.size], x, -np.inf)
        token = self._pick(x)
        self.counts[token] = self.counts.get(token, 0) + 1
        return token

    @property
    def argmax_only(self) -> bool:
        """Whether the next id is the logits' argmax whatever came before (greedy, no penalty):
        a batch engine may then pick it where the logits are, without copying them."""
        p = self.params
        return p.greedy and p.repetition_penalty == 1.0 and not p.penalizes_answer

    def _pick(self, x: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(x))
        probs = filtered_probs(x / p.temperature, p.top_k, p.top_p, p.min_p)
        # Inverse-CDF draw: one uniform number per token keeps seeded runs reproducible.
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def penalize_answer(logits: np.ndarray, counts: dict[int, int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's penalties: logit - presence - frequency * count for each id the answer holds.
    Returns a new array."""
    out = np.array(logits, np.float64)
    ids = np.fromiter(counts.keys(), np.int64, len(counts))
    out[ids] -= presence + frequency * np.fromiter(counts.values(), np.float64, len(counts))
    return out


def penalize_repetition(logits: np.ndarray, history: Iterable[int], penalty: float) -> np.ndarray:
    """HF semantics: for each distinct id seen, logit / penalty if logit > 0 else logit * penalty.
    Returns a new array; `logits` is left as it was."""
    out = np.array(logits, np.float64)
    if penalty == 1.0:
        return out
    seen = np.unique(np.fromiter(history, np.int64))
    if seen.size:
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def filtered_probs(logits: np.ndarray, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> np.ndarray:
    """Softmax of `logits` with everything outside the top-k, the top-p nucleus and the min-p
    threshold set to probability 0; renormalised to sum 1."""
    x = np.asarray(logits, np.float64)
    keep = np.ones(x.shape, bool)
    order = None
    if 0 < top_k < x.size:
        order = np.argsort(-x, kind="stable")
        keep[:] = False
        keep[order[:top_k]] = True          # exactly k ids, even when logits tie
    probs = _softmax(np.where(keep, x, -np.inf))
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable") if order is None else order
        cum = np.cumsum(probs[order])
        # Smallest prefix whose mass reaches top_p; always at least one token.
        n = min(int(np.searchsorted(cum, top_p, side="left")) + 1, x.size)
        keep[order[n:]] = False
        probs = np.where(keep, probs, 0.0)
    if min_p > 0.0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()

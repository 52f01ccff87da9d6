"""Choosing the next token from logits: one vector on the host (Sampler), or many rows where the
engine left them (sample_rows, numpy or cupy, for batch steps).

The filters run in Hugging Face's order: repetition penalty, temperature, top-k, top-p, min-p;
then one draw from the seeded generator. OpenAI's presence and frequency penalties come first and
count only the ids this sampler has produced (the answer, not the prompt), as vLLM counts them.
An `allowed` mask (structured output) leaves only its ids. Greedy decoding (temperature 0 or top_k 1) still applies
the repetition penalty, as `transformers` does.

sample_rows does the same arithmetic row by row, in float64, with the uniform number each row's
Sampler drew (Sampler.draw), so a batch step's picks are the ones Sampler would make from the
same logits, without copying the rows to the host.
"""
from __future__ import annotations

from dataclasses import dataclass
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

    def draw(self, history: Iterable[int] = (), allowed: np.ndarray | None = None,
             logprobs: int | None = None) -> "Draw":
        """What its next pick needs where the logits are (sample_rows): the uniform number that
        __call__ would draw now, the ids its penalties see, the `allowed` mask __call__ would be
        given; `logprobs`: report the pick's log probability and that many alternatives. record()
        the pick after."""
        p = self.params
        u = 0.0 if p.greedy else float(self.rng.random())
        seen = np.unique(np.fromiter(history, np.int64)) if p.repetition_penalty != 1.0 else np.zeros(0, np.int64)
        return Draw(p, u, seen, dict(self.counts) if p.penalizes_answer else {}, allowed, logprobs)

    def record(self, token: int) -> None:
        """A pick made from a draw() (the answer's counts, as __call__ keeps them)."""
        self.counts[token] = self.counts.get(token, 0) + 1

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


@dataclass(frozen=True)
class Draw:
    """One row's pick for sample_rows: its sampler's params, the uniform number in [0, 1) of its
    draw, the distinct ids the repetition penalty sees, the answer's counts (presence and
    frequency penalties), the ids a grammar allows ([vocab] bool, or None: all), and how many
    alternatives to report with the pick's log probability (None: no logprobs)."""
    params: SamplingParams
    u: float
    seen: np.ndarray
    counts: dict
    allowed: np.ndarray | None = None
    logprobs: int | None = None


ROW_PARAMS = ("temperature", "top_k", "top_p", "min_p", "u", "greedy")


def row_params(draws: list[Draw]) -> np.ndarray:
    """float64 [len(ROW_PARAMS), rows]: each row's numbers for sample_rows (temperature 1 where
    greedy), which an engine may move to where the logits are ahead of them."""
    out = np.zeros((len(ROW_PARAMS), len(draws)))
    for r, d in enumerate(draws):
        p = d.params
        out[:, r] = 1.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p, d.u, p.greedy
    return out


def sample_rows(logits, draws: list[Draw], params=None):
    """The picks [rows] (int64, where `logits` [rows, vocab] is: numpy or cupy) that Sampler
    would make from each row with its draw, every filter applied to all rows at once in float64.
    `params`: row_params(draws) already where the logits are (else they are copied there)."""
    xp = np if isinstance(logits, np.ndarray) else __import__("cupy")
    m, V = logits.shape
    temperature, top_k, top_p, min_p, u, greedy = xp.asarray(row_params(draws) if params is None else params)
    x = logits.astype(xp.float64)
    answer = [(r, t, c) for r, d in enumerate(draws) if d.params.penalizes_answer for t, c in d.counts.items()]
    if answer:   # (these copies may wait for a queued step: a sequence with penalties, or a grammar
        # below, is never planned ahead of its pick; only its prompt's last chunk may be)
        r, t, c = (np.asarray(v) for v in zip(*answer))
        pres = np.array([d.params.presence_penalty for d in draws])[r]
        freq = np.array([d.params.frequency_penalty for d in draws])[r]
        x[xp.asarray(r), xp.asarray(t)] -= xp.asarray(pres + freq * c)
    seen = [(r, t) for r, d in enumerate(draws) if d.params.repetition_penalty != 1.0 for t in d.seen]
    if seen:
        r, t = (np.asarray(v) for v in zip(*seen))
        rp = xp.asarray(np.array([d.params.repetition_penalty for d in draws])[r])
        r, t = xp.asarray(r), xp.asarray(t)
        v = x[r, t]
        x[r, t] = xp.where(v > 0, v / rp, v * rp)
    masked = [r for r, d in enumerate(draws) if d.allowed is not None]
    if masked:   # a grammar's mask
        allowed = xp.ones((m, V), bool)
        allowed[xp.asarray(np.asarray(masked))] = xp.asarray(np.stack([draws[r].allowed[:V] for r in masked]))
        x = xp.where(allowed, x, -xp.inf)
    best = xp.argmax(x, axis=1)
    sampled = [d.params for d in draws if not d.params.greedy]
    if not sampled:
        return best
    x = x / temperature[:, None]
    if any(0 < p.top_k < V or p.top_p < 1.0 for p in sampled):
        # each row's ids by falling logit, ties in id order (cupy's sort is stable); the raw
        # float32 logits sort as x does where nothing changed them, in half the bytes
        keys = logits if not (answer or seen or masked) else x
        order = xp.argsort(-keys, axis=1, kind="stable") if xp is np else xp.argsort(-keys, axis=1)
        rank = xp.empty_like(order)
        rank[xp.arange(m)[:, None], order] = xp.arange(V)[None, :]      # each id's place in its row's order
        k = xp.where((top_k > 0) & (top_k < V), top_k, V)
        x = xp.where(rank < k[:, None], x, -xp.inf)
    probs = _row_softmax(xp, x)
    if any(p.top_p < 1.0 for p in sampled):   # the smallest prefix of the order reaching top_p, at least one id
        cum = xp.cumsum(xp.take_along_axis(probs, order, axis=1), axis=1)
        n = xp.minimum((cum < top_p[:, None]).sum(axis=1) + 1, V)
        probs = xp.where((rank < n[:, None]) | (top_p[:, None] >= 1.0), probs, 0.0)
    if any(d.params.min_p > 0.0 for d in draws):
        probs = xp.where(probs >= min_p[:, None] * probs.max(axis=1, keepdims=True), probs, 0.0)
    probs = probs / probs.sum(axis=1, keepdims=True)
    cdf = xp.cumsum(probs, axis=1)
    # searchsorted(cdf, target, "right"): the first id whose cdf passes the target, which has a
    # probability where cdf rises step by step (numpy); a parallel sum (cupy) may dip by an ulp
    # at an id of none, which must never be picked; none passes: the last id, as numpy's
    above = (cdf > u[:, None] * cdf[:, -1:]) & (probs > 0)
    picked = xp.where(above.any(axis=1), xp.argmax(above, axis=1), V - 1)
    return xp.where(greedy > 0, best, picked)


def _row_softmax(xp, x):
    e = xp.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

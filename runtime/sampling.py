"""Choosing the next token from logits: one vector on the host (Sampler), or many rows where the
engine left them (sample_rows, numpy or cupy, for batch steps).

The filters run in Hugging Face's order: repetition penalty, temperature, top-k, top-p, min-p;
then one draw from the seeded generator. OpenAI's presence and frequency penalties come first and
count only the ids this sampler has produced (the answer, not the prompt), as vLLM counts them.
An `allowed` mask (structured output) leaves only its ids. Greedy decoding (temperature 0 or top_k 1) still applies
the repetition penalty, as `transformers` does.

sample_rows does the same arithmetic row by row, in float64, with the uniform number each row's
Sampler drew (Sampler.draw), so a batch step's picks are the ones Sampler would make from the
same logits, without copying the rows to the host. On CuPy rows a kernel draws them, a block a
row (codegen/templates/row_picks.cuh): radix selects instead of a sort, and probabilities summed
as integers of 2^-60, so its picks are Sampler's but where float64 sums in another order move a
draw across a boundary, and are the same on every run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..codegen.nvrtc import compile_cubin, options
from ..codegen.render import headers
from ..codegen.sample import PICK_THREADS, generate_row_picks
from .engine import SamplingParams
from .launch import load_cubin


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
             logprobs: int | None = None, pending: bool = False) -> "Draw":
        """What its next pick needs where the logits are (sample_rows): the uniform number that
        __call__ would draw now, the ids its penalties see, the `allowed` mask __call__ would be
        given; `logprobs`: report the pick's log probability and that many alternatives;
        `pending`: the last pick is neither in `history` nor record()ed yet (the engine knows
        it). record() the pick after."""
        p = self.params
        u = 0.0 if p.greedy else float(self.rng.random())
        seen = np.unique(np.fromiter(history, np.int64)) if p.repetition_penalty != 1.0 else np.zeros(0, np.int64)
        return Draw(p, u, seen, dict(self.counts) if p.penalizes_answer else {}, allowed, logprobs, pending)

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
    frequency penalties), the ids a grammar allows ([vocab] bool, or None: all), how many
    alternatives to report with the pick's log probability (None: no logprobs), and whether the
    row's latest fed id is a pick its penalties must count that they do not hold yet."""
    params: SamplingParams
    u: float
    seen: np.ndarray
    counts: dict
    allowed: np.ndarray | None = None
    logprobs: int | None = None
    pending: bool = False    # the row's latest fed id is a pick not in `seen` and `counts` yet


ROW_PARAMS = ("temperature", "top_k", "top_p", "min_p", "u", "greedy")


def row_params(draws: list[Draw]) -> np.ndarray:
    """float64 [len(ROW_PARAMS), rows]: each row's numbers for sample_rows (temperature 1 where
    greedy), which an engine may move to where the logits are ahead of them."""
    out = np.zeros((len(ROW_PARAMS), len(draws)))
    for r, d in enumerate(draws):
        p = d.params
        out[:, r] = 1.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p, d.u, p.greedy
    return out


def sample_rows(logits, draws: list[Draw], params=None, latest=None):
    """The picks [rows] (int64, where `logits` [rows, vocab] is: numpy or cupy) that Sampler
    would make from each row with its draw, every filter applied to all rows at once in float64.
    `params`: row_params(draws) already where the logits are (else they are copied there);
    `latest` [rows]: each row's last fed id there, which the penalties of a `pending` draw count
    (a pick of the step before, not yet seen by the host)."""
    xp = np if isinstance(logits, np.ndarray) else __import__("cupy")
    m, V = logits.shape
    temperature, top_k, top_p, min_p, u, greedy = xp.asarray(row_params(draws) if params is None else params)
    x = logits.astype(xp.float64)
    # (the penalties' and masks' copies may wait for a queued step: a sequence with a grammar is
    # never planned ahead of its pick, and the penalties' lists are short)
    _penalize_answer(xp, x, draws, latest)
    _penalize_repetition(xp, x, draws, latest)
    masked = [r for r, d in enumerate(draws) if d.allowed is not None]
    if masked:   # a grammar's mask
        allowed = xp.ones((m, V), bool)
        allowed[xp.asarray(np.asarray(masked))] = xp.asarray(np.stack([draws[r].allowed[:V] for r in masked]))
        x = xp.where(allowed, x, -xp.inf)
    best = xp.argmax(x, axis=1)
    sampled = [d.params for d in draws if not d.params.greedy]
    if not sampled:
        return best
    if xp is not np:     # the same filters and draw on the GPU, a block a row, without a sort
        picks = xp.empty(m, xp.int64)
        row_picks_kernel(xp)((m,), (PICK_THREADS,), (xp.ascontiguousarray(x), xp.stack([temperature, top_k, top_p, min_p, u]),
                                                      np.int32(m), np.int32(V), picks))
        return xp.where(greedy > 0, best, picks)
    x = x / temperature[:, None]
    if any(0 < p.top_k < V or p.top_p < 1.0 for p in sampled):
        # each row's ids by falling value, ties by id; the raw float32 logits sort as x does where
        # nothing changed them, in half the bytes
        changed = masked or any(d.params.penalizes_answer or d.params.repetition_penalty != 1.0 for d in draws)
        order = np.argsort(-(x if changed else logits), axis=1, kind="stable")
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


_ROW_PICKS: dict = {}      # CUDA device id -> the compiled row-picks kernel


def row_picks_kernel(cp):
    """The kernel that draws sampled rows on the current CUDA device (codegen/sample.py:
    generate_row_picks), compiled and loaded once per device."""
    device = cp.cuda.Device()
    if device.id not in _ROW_PICKS:
        name, source = generate_row_picks()
        cubin, _, _ = compile_cubin(source, headers(), options(f"sm_{device.compute_capability}"))
        _ROW_PICKS[device.id] = load_cubin(cp, cubin).get_function(name)
    return _ROW_PICKS[device.id]


def _pending(xp, draws: list[Draw], latest, wanted):
    """The rows whose draw is pending and `wanted(params)`, and their latest ids (xp arrays)."""
    rows = [r for r, d in enumerate(draws) if d.pending and wanted(d.params)]
    if not rows:
        return None, None
    rows = xp.asarray(np.asarray(rows))
    return rows, latest[rows]


def _same(xp, rows, ids, pairs):
    """[len(rows), len(pairs)] bool: which of the (row, id) `pairs` are each row's `ids`."""
    r, t = pairs
    return (r[None, :] == rows[:, None]) & (t[None, :] == ids[:, None])


def _penalize_answer(xp, x, draws: list[Draw], latest) -> None:
    """penalize_answer on every row of `x` in place, the latest id of a pending draw counted once more."""
    pres = np.array([d.params.presence_penalty for d in draws])
    freq = np.array([d.params.frequency_penalty for d in draws])
    known = [(r, t, c) for r, d in enumerate(draws) if d.params.penalizes_answer for t, c in d.counts.items()]
    rows, ids = _pending(xp, draws, latest, lambda p: p.penalizes_answer)
    if known:
        r, t, c = (np.asarray(v) for v in zip(*known))
        amount = xp.asarray(pres[r] + freq[r] * c)
        r, t, c = xp.asarray(r), xp.asarray(t), xp.asarray(c.astype(np.float64))
        before = xp.zeros(0)
        if rows is not None:   # a known id that is also the pending one: its amount goes below, once
            same = _same(xp, rows, ids, (r, t))
            amount = xp.where(same.any(axis=0), 0.0, amount)
            before = (same * c[None, :]).sum(axis=1)
        x[r, t] -= amount
    if rows is not None:
        count = (before if known else 0.0) + 1.0
        x[rows, ids] -= xp.asarray(pres)[rows] + xp.asarray(freq)[rows] * count


def _penalize_repetition(xp, x, draws: list[Draw], latest) -> None:
    """penalize_repetition on every row of `x` in place, the latest id of a pending draw seen too."""
    rp = np.array([d.params.repetition_penalty for d in draws])
    known = [(r, t) for r, d in enumerate(draws) if d.params.repetition_penalty != 1.0 for t in d.seen]
    rows, ids = _pending(xp, draws, latest, lambda p: p.repetition_penalty != 1.0)
    if known:
        r, t = (xp.asarray(np.asarray(v)) for v in zip(*known))
        v = x[r, t]
        x[r, t] = xp.where(v > 0, v / xp.asarray(rp)[r], v * xp.asarray(rp)[r])
    if rows is not None:   # once: not where the pending id was seen already
        seen = _same(xp, rows, ids, (r, t)).any(axis=1) if known else xp.zeros(len(rows), bool)
        v, p = x[rows, ids], xp.asarray(rp)[rows]
        x[rows, ids] = xp.where(seen, v, xp.where(v > 0, v / p, v * p))


def _row_softmax(xp, x):
    e = xp.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

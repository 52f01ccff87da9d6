"""Picking each row of a batch step where the engine left its logits (numpy or CuPy): its
argmax, or a draw of its sequence's sampler (runtime/sampling.sample_rows), and the logprobs a
request asks for, so that only ids and those few numbers come back to the host."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling import Draw, sample_rows


def sampled_rows(draws: Sequence[Draw | None] | None) -> tuple[list[int], list[Draw]]:
    """The rows that `draws` samples, and their draws."""
    rows = [i for i, d in enumerate(draws or ()) if d is not None]
    return rows, [draws[i] for i in rows]


# Sampled rows drawn at a time: on the host sample_rows holds ~8 float64 or int64 copies of them,
# 1 GiB at 64 rows of a 262k vocabulary, 16 bound that to a quarter; on the GPU two float64
# copies (134 MB at 64 such rows), a block a row, so more rows at once fill more SMs.
DRAWN_AT_ONCE = {"numpy": 16, "cupy": 64}


def row_picks(rows, draws: Sequence[Draw | None] | None, params=None, index=None, latest=None):
    """Each row's pick [chunks] (where `rows` [chunks, vocab] is): its argmax, or its draw's pick
    (runtime/sampling.sample_rows, DRAWN_AT_ONCE rows at a time) where `draws` has one; `params`
    [ROW_PARAMS, draws] and `index` [draws] (the sampled rows) where the rows are already, else
    copied there; `latest` [chunks] there: each chunk's last fed id (for pending draws)."""
    xp = np if isinstance(rows, np.ndarray) else __import__("cupy")
    best = xp.argmax(rows, axis=1)
    sampled, chosen = sampled_rows(draws)
    if sampled:
        index = xp.asarray(np.asarray(sampled)) if index is None else index
        at_once = DRAWN_AT_ONCE[xp.__name__]
        for a in range(0, len(sampled), at_once):
            b = a + at_once
            best[index[a:b]] = sample_rows(rows[index[a:b]], chosen[a:b], None if params is None else params[:, a:b],
                                           None if latest is None else latest[index[a:b]])
    return best


def logprob_rows(draws: Sequence[Draw | None] | None) -> list[int]:
    """The rows whose draw asks for logprobs."""
    return [i for i, d in enumerate(draws or ()) if d is not None and d.logprobs is not None]


def row_logprobs(rows, best, draws: Sequence[Draw | None] | None, index=None):
    """OpenAI's logprobs of the rows whose draw asks for them, where `rows` [chunks, vocab] are:
    (their rows, the log-softmax of each one's pick `best` [n], and its row's `top` most likely
    ids [n, top] with theirs [n, top], top the most any asks for), or None. The raw logits'
    log-softmax in float64, ties in id order (server/logprobs.py). `index`: those rows where
    the logits are, else copied there."""
    asked = logprob_rows(draws)
    if not asked:
        return None
    xp = np if isinstance(rows, np.ndarray) else __import__("cupy")
    index = xp.asarray(np.asarray(asked)) if index is None else index
    x = rows[index].astype(xp.float64)
    peak = x.max(axis=1, keepdims=True)
    log_total = peak + xp.log(xp.exp(x - peak).sum(axis=1, keepdims=True))
    top = max(draws[i].logprobs for i in asked)
    order = (xp.argsort(-x, axis=1, kind="stable") if xp is np else xp.argsort(-x, axis=1))[:, :top]
    picked = xp.take_along_axis(x, best[index][:, None], axis=1)[:, 0] - log_total[:, 0]
    return asked, picked, order, xp.take_along_axis(x, order, axis=1) - log_total


class StepLogits:
    """The logits rows [chunks, vocab] of one batch step where the engine left them (a numpy or a
    CuPy array): every row's finiteness and pick at once, a whole row copied only on demand.
    `best`: the rows' picks where the engine made them already (the picks it feeds on);
    `logprobs`: row_logprobs' of the rows that asked."""

    def __init__(self, rows, best=None, logprobs=None):
        self.rows, self.best, self._logprobs = rows, best, logprobs
        if isinstance(rows, np.ndarray):
            self._xp = np
        else:
            import cupy
            self._xp = cupy

    def finite(self) -> np.ndarray:
        """[chunks] bool: whether each row holds no NaN or inf."""
        return self._host(self._xp.isfinite(self.rows).all(axis=1))

    def picks(self) -> np.ndarray:
        """[chunks] int: each row's pick (its argmax where the step was given no draw for it)."""
        return self._host(self._xp.argmax(self.rows, axis=1) if self.best is None else self.best)

    def logprobs(self, i: int) -> tuple[float, np.ndarray, np.ndarray]:
        """Row i's pick's log probability and its row's most likely ids and theirs (as many as
        its draw asked for: the caller takes its own), from row_logprobs."""
        asked, picked, ids, values = self._logprobs
        if not isinstance(picked, np.ndarray):     # one copy of each, for all rows
            self._logprobs = asked, picked, ids, values = asked, *(self._host(a) for a in (picked, ids, values))
        k = asked.index(i)
        return float(picked[k]), ids[k], values[k]

    def row(self, i: int) -> np.ndarray:
        """Row i on the host, float32."""
        return self._host(self.rows[i])

    @staticmethod
    def _host(x) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.get()

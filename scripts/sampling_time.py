"""Where a sampled batch step's picks spend their time on the GPU: sample_rows over random logits
[rows, vocab] with a temperature and top-p, beside the orders it may sort by: CuPy's row-wise
argsort (a comparison sort of (row, key) pairs) and flat_falling_order (flat radix sorts).

    python scripts/sampling_time.py [--rows 32,64] [--vocab 128256]

Prints the median of 20 timed runs of each (CUDA events, after 3 warm-up runs) and checks that the
two orders agree.
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.sampling import Sampler, flat_falling_order, row_params, sample_rows


def median_ms(fn, runs: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,64")
    p.add_argument("--vocab", type=int, default=128256)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    for rows in (int(r) for r in a.rows.split(",")):
        logits = cp.asarray(rng.standard_normal((rows, a.vocab), dtype=np.float32) * 3)
        draws = [Sampler(SamplingParams(temperature=0.8, top_p=0.95, seed=r)).draw() for r in range(rows)]
        params = cp.asarray(row_params(draws))
        rowwise = cp.argsort(-logits, axis=1)
        assert bool((rowwise == flat_falling_order(cp, logits)).all()), "the two orders differ"
        print(f"{rows} rows x {a.vocab}: argsort(axis=1) {median_ms(lambda: cp.argsort(-logits, axis=1)):.2f} ms, "
              f"flat_falling_order {median_ms(lambda: flat_falling_order(cp, logits)):.2f} ms, "
              f"sample_rows (temperature 0.8, top-p 0.95) {median_ms(lambda: sample_rows(logits, draws, params)):.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()

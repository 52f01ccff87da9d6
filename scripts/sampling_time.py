"""Where a sampled batch step's picks spend their time on the GPU: sample_rows (the row-picks
kernel) over random logits [rows, vocab] with a temperature and top-p, beside what one CuPy sort
of the rows costs (argsort along the rows, which the kernel does without).

    python scripts/sampling_time.py [--rows 32,64] [--vocab 128256]

Prints the median of 20 timed runs of each (CUDA events, after 3 warm-up runs).
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.sampling import Sampler, row_params, sample_rows


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
        for name, params in (("temperature 0.8, top-p 0.95", dict(temperature=0.8, top_p=0.95)),
                             ("temperature 0.8, top-k 40", dict(temperature=0.8, top_k=40)),
                             ("temperature 1.0", dict(temperature=1.0))):
            draws = [Sampler(SamplingParams(seed=r, **params)).draw() for r in range(rows)]
            table = cp.asarray(row_params(draws))
            print(f"{rows} rows x {a.vocab}: sample_rows ({name}) "
                  f"{median_ms(lambda: sample_rows(logits, draws, table)):.2f} ms", flush=True)
        print(f"{rows} rows x {a.vocab}: argsort(axis=1) {median_ms(lambda: cp.argsort(-logits, axis=1)):.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()

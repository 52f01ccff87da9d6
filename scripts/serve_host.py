"""What the server's host side allows: `fuselm serve`'s app over a batch engine that computes
nothing, each step taking `--step-ms` as a GPU step would (queued at once, its picks ready that
long after), so that `fuselm bench-serve` against it measures the HTTP, scheduling and
detokenizing work a step costs the host, and the output tok/s the host alone would cap.

    python scripts/serve_host.py --tokenizer-from model.gguf [--step-ms 7] [--port 8766] &
    fuselm bench-serve http://127.0.0.1:8766/v1 --clients 32,64

The picks are random ids of ordinary text (never an end-of-sequence token), so every request
runs to its max_tokens; the engine's clock is the only thing it shares with a real engine.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import fuselm
from fuselm.runtime.picks import StepLogits
from fuselm.server import batcher, create_app
from fuselm.server.cli import listen, serve


class HostOnlyEngine:
    """A batch engine with the CUDA engine's interface (launch, warm_up, page) whose steps take
    `step_s` and pick uniform ids in [low, high)."""
    page = 32
    current: "HostOnlyEngine | None" = None    # the one the server takes (beside)

    def __init__(self, step_s: float, low: int, high: int, max_context: int):
        self.step_s, self.low, self.high, self.max_context = step_s, low, high, max_context
        self.rng = np.random.default_rng(0)
        self.free_at = time.perf_counter()     # when the queued steps end, as a stream's would

    @classmethod
    def beside(cls, engine, pages: int) -> "HostOnlyEngine":
        return cls.current

    @classmethod
    def page_rows(cls, engine) -> int:
        return cls.page

    @staticmethod
    def row_bytes(graph, kv: str = "bf16") -> int:
        return 1

    def warm_up(self) -> None:
        pass

    def launch(self, chunks, picks=None, draws=None) -> "_Due":
        self.free_at = max(self.free_at, time.perf_counter()) + self.step_s
        best = self.rng.integers(self.low, self.high, len(chunks))
        return _Due(self.free_at, StepLogits(np.zeros((len(chunks), 1), np.float32), best))


class _Due:
    def __init__(self, at: float, logits: StepLogits):
        self.at, self.logits = at, logits

    def result(self) -> StepLogits:
        while (wait := self.at - time.perf_counter()) > 0:
            time.sleep(min(wait, 5e-5))         # as the worker polls a step's event
        return self.logits


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer-from", required=True, help="a GGUF or HF folder (loaded on the CPU for its tokenizer)")
    p.add_argument("--step-ms", type=float, default=7.0, help="time of one engine step")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--ctx", type=int, default=2048)
    args = p.parse_args()
    model = fuselm.load(args.tokenizer_from, device="cpu", ctx=args.ctx, progress=False)
    vocab = model.config.vocab_size
    HostOnlyEngine.current = HostOnlyEngine(args.step_ms / 1e3, min(1000, vocab // 4), vocab // 2,
                                            model.engine.max_context)
    batcher._engine_class = lambda model: HostOnlyEngine      # the batch engine beside any engine
    sock = listen("127.0.0.1", args.port)
    serve(create_app(model, max_seqs=args.max_seqs), sock, f"a host-only engine ({args.step_ms} ms a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

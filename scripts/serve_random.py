"""Serve a preset's shapes with random weights behind `fuselm serve`'s app, for load tests of the
server at real model sizes where no checkpoint can be carried (the GPU machine has none). The
tokenizer, chat template and vocabulary come from a real checkpoint (a GGUF or HF folder): the
preset's vocabulary is replaced by that tokenizer's, so every sampled id decodes.

    python scripts/serve_random.py llama-3.1-8b --tokenizer-from model.gguf [--port 8765] [--max-seqs 64]

Answers are noise; what it measures is throughput and latency (`fuselm bench-serve`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fuselm.api import Model
from fuselm.loading.checkpoint import open_checkpoint
from fuselm.models import DecoderConfig, build_graph
from fuselm.models.presets import PRESETS
from fuselm.runtime.cuda_engine import CudaEngine
from fuselm.runtime.random_weights import random_gpu_weights
from fuselm.server import create_app
from fuselm.server.cli import listen, serve


class _Borrowed:
    """A checkpoint's face (config, tokenizer, generation defaults) on a preset's shapes."""

    def __init__(self, config, source):
        self.config, self.tokenizer = config, source.tokenizer
        self.generation = getattr(source, "generation", None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--tokenizer-from", required=True, help="a GGUF or HF folder whose tokenizer to use")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--max-seqs", type=int)
    args = p.parse_args()
    source = open_checkpoint(args.tokenizer_from)
    cfg = DecoderConfig.from_hf({**PRESETS[args.preset], "vocab_size": source.config.vocab_size},
                                source=f"preset {args.preset}, vocabulary of {args.tokenizer_from}")
    graph = build_graph(cfg)
    engine = CudaEngine(graph, random_gpu_weights(graph), ctx=args.ctx)
    model = Model(_Borrowed(cfg, source), engine, path=Path(f"{args.preset}-random"))
    sock = listen("127.0.0.1", args.port)
    serve(create_app(model, max_seqs=args.max_seqs), sock, f"{args.preset} (random weights)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`fuselm bench-serve`: a load generator for an OpenAI-compatible server (fuselm's, llama-server,
vLLM): N concurrent clients stream `/v1/completions` until R requests are done.

    fuselm bench-serve http://127.0.0.1:8000/v1 --clients 32 --requests 128 \
        --prompt-words 400 --output-tokens 256 --json bench/results/serve.json

Each request streams (`stream_options.include_usage`) with `ignore_eos`, so every answer runs to
`--output-tokens` (llama-server and vLLM take the same field). Per request: TTFT is the time to
the first chunk with text, TPOT the time after it over the remaining tokens. The record gives
output tok/s over the whole run (all completion tokens over the wall time) and p50/p95 of TTFT
and TPOT, as `{"model", "dtype", "concurrency", "output_tok_s", "ttft_p50_ms", ...}`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

import numpy as np

from ..errors import FuselmError

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing "
         "matches in the old town square near the river").split()


def prompt_of(words: int, index: int) -> str:
    """A prompt of `words` common words, different for each request (prefix caches do not help)."""
    start = index % len(WORDS)
    return f"Request {index}: " + " ".join(WORDS[(start + i) % len(WORDS)] for i in range(words))


@dataclass
class Timing:
    """One request: prompt and completion tokens (the server's usage), TTFT and TPOT in seconds."""
    prompt_tokens: int
    completion_tokens: int
    ttft: float
    tpot: float


async def one_request(client, url: str, model: str, prompt: str, tokens: int, sampling: dict) -> Timing:
    """Stream one completion (`sampling`: its temperature and top_p); its timing. A 4xx/5xx or a
    stream without usage is a FuselmError."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, **sampling, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    usage = None
    async with client.stream("POST", url + "/completions", json=body) as response:
        if response.status_code != 200:
            raise FuselmError(f"the server answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise FuselmError(f"the server failed a request: {event['error'].get('message')}")
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter()
            usage = event.get("usage") or usage
    end = time.perf_counter()
    if usage is None:
        raise FuselmError("the stream ended without a usage chunk (stream_options.include_usage)")
    n = usage["completion_tokens"]
    first = first or end
    return Timing(usage["prompt_tokens"], n, first - start, (end - first) / (n - 1) if n > 1 else 0.0)


async def run_load(url: str, model: str, clients: int, requests: int, prompt_words: int,
                   output_tokens: int, sampling: dict | None = None,
                   timeout: float = 600.0) -> tuple[list[Timing], float]:
    """`clients` workers sending `requests` requests in all (`sampling`: their temperature and
    top_p, default greedy); their timings and the wall time."""
    sampling = sampling or {"temperature": 0}
    import httpx
    queue = iter(range(requests))
    timings: list[Timing] = []

    async def worker(client):
        for index in queue:
            timings.append(await one_request(client, url, model, prompt_of(prompt_words, index), output_tokens,
                                             sampling))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return timings, time.perf_counter() - start


def summary(timings: list[Timing], wall: float, model: str, dtype: str, clients: int) -> dict:
    """The record of one run (module docstring)."""
    ttft = np.array([t.ttft for t in timings]) * 1000
    tpot = np.array([t.tpot for t in timings if t.completion_tokens > 1]) * 1000
    out = sum(t.completion_tokens for t in timings)

    def pct(a, q):
        return round(float(np.percentile(a, q)), 2) if a.size else None
    return {"model": model, "dtype": dtype, "concurrency": clients, "requests": len(timings),
            "prompt_tokens_mean": round(float(np.mean([t.prompt_tokens for t in timings])), 1),
            "output_tokens": out, "wall_s": round(wall, 3), "output_tok_s": round(out / wall, 1),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p95_ms": pct(ttft, 95),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p95_ms": pct(tpot, 95)}


def served_model(url: str) -> str:
    """The id of the one model the server at `url` lists."""
    import httpx
    try:
        data = httpx.get(url + "/models", timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise FuselmError(f"cannot list the models of {url} ({e})") from None
    if not data:
        raise FuselmError(f"{url} serves no model")
    return data[0]["id"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`fuselm bench-serve`'s options."""
    p.add_argument("url", help="the server's API base, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model id to request (default: the first of GET /models)")
    p.add_argument("--clients", type=str, default="1", metavar="N[,N...]",
                   help="concurrent clients; a comma list runs one load per value (default 1)")
    p.add_argument("--requests", type=int, default=0, metavar="R",
                   help="requests per load (default: 4 per client)")
    p.add_argument("--prompt-words", type=int, default=400, metavar="W", help="words per prompt (default 400)")
    p.add_argument("--output-tokens", type=int, default=256, metavar="T", help="tokens per answer (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's top_p (default 1)")
    p.add_argument("--dtype", default="bf16", help="the weight format to record (default bf16)")
    p.add_argument("--json", dest="out", help="write the records here")


def main(args: argparse.Namespace) -> int:
    """Run one load per --clients value; print a line per load and write the JSON record."""
    try:
        loads = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise FuselmError(f"--clients must be integers separated by commas, got '{args.clients}'") from None
    for name, value in (("--clients", min(loads)), ("--prompt-words", args.prompt_words),
                        ("--output-tokens", args.output_tokens)):
        if value < 1:
            raise FuselmError(f"{name} must be at least 1, got {value}")
    if args.requests < 0:
        raise FuselmError(f"--requests must be at least 0, got {args.requests}")
    if not args.temperature >= 0:
        raise FuselmError(f"--temperature must be at least 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise FuselmError(f"--top-p must be in (0, 1], got {args.top_p}")
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    url = args.url.rstrip("/")
    model = args.model or served_model(url)
    results = []
    for clients in loads:
        timings, wall = asyncio.run(run_load(url, model, clients, args.requests or 4 * clients,
                                             args.prompt_words, args.output_tokens, sampling))
        r = {**summary(timings, wall, model, args.dtype, clients), **sampling}
        results.append(r)
        print(f"{clients:>4} clients: {r['output_tok_s']:>9.1f} output tok/s | TTFT p50 {r['ttft_p50_ms']} ms "
              f"p95 {r['ttft_p95_ms']} ms | TPOT p50 {r['tpot_p50_ms']} ms p95 {r['tpot_p95_ms']} ms "
              f"| {r['requests']} requests, {r['prompt_tokens_mean']} prompt tokens")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"url": url, "results": results}, f, indent=1)
    return 0

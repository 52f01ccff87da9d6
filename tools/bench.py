"""`fuselm bench`: decode speed against the GPU's measured copy bandwidth, in one run.

For each model (a preset name with random weights made on the GPU, or a checkpoint path) it
prints and returns: copy bandwidth, decode tok/s (median of runs of 128 tokens) and ms/token,
bytes per token and the fraction of the bandwidth achieved, time to first token for 32- and
512-token prompts (through the batched prefill where the model has one), decode tok/s at 4k
context (and from any start positions asked for, `--positions`), compile time cold and warm,
warm start to the first token, load time, peak GPU memory, optionally per-kernel-family time,
each kernel's marginal time inside the step and the prefill step's time per kernel function
(`--profile`), continuous batching's output tok/s at several numbers of sequences (`--batch`),
and Hugging Face transformers on the same shapes (`--peers hf`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import numpy as np

from ..dsl.kv_dtype import resolve_kv
from ..errors import FuselmError
from ..models import build_graph
from ..models.presets import PRESETS, preset
from ..quant.formats import QuantizedWeight
from ..quant.schemes import SCHEMES
from ..runtime.engine import SamplingParams
from .profile import kernel_profile, prefill_profile, step_ablation, step_profile

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)   # bench --batch's sampled steps (a chat client's settings)


def copy_bandwidth(gib: int = 4) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    import cupy as cp
    n = gib * 2**30 // 4
    a = cp.ones(n, cp.float32)
    b = cp.empty_like(a)
    times = []
    for _ in range(12):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cp.copyto(b, a)
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    cp.get_default_memory_pool().free_all_blocks()
    return 2 * n * 4 / statistics.median(times[2:])


def start_times(graph, weights, vocab: int, ctx: int, fuse: bool = True, tuning=None,
                kv: str = "bf16") -> tuple[float, float, float]:
    """Seconds of start-up, weights already on the GPU, in a kernel cache of its own: (graph to
    cubins with the cache empty, the same with it warm, warm start to the first token). Each is an
    engine built as `fuselm.load` builds it after loading weights; the warm start is the second
    one's whole start, timed to the first sampled id of a 32-token prompt: compile (cache warm),
    GPU buffers, modules, CUDA graph captures, prefill."""
    import cupy as cp

    from ..runtime.cuda_engine import CudaEngine
    prompt = np.random.default_rng(1).integers(0, vocab, 32).tolist()
    compile_s, first_token_s = [], []
    with tempfile.TemporaryDirectory() as d:
        old = os.environ.get("FUSELM_CACHE")
        os.environ["FUSELM_CACHE"] = d
        try:
            for warm in (False, True):               # the kernel cache empty, then warm
                t0 = time.perf_counter()
                engine = CudaEngine(graph, weights, ctx=ctx, fuse=fuse, tuning=tuning, kv=kv)
                engine.prefill(prompt, GREEDY)
                first_token_s.append(time.perf_counter() - t0)
                compile_s.append(engine.compile_seconds)
                if engine.compile_cached != warm:       # else the figures would be mislabelled
                    raise FuselmError(f"bench: the kernel cache in {d} {'missed' if warm else 'hit'} "
                                      f"on the {'warm' if warm else 'cold'} compile")
                del engine
                cp.get_default_memory_pool().free_all_blocks()
        finally:
            if old is None:
                os.environ.pop("FUSELM_CACHE")
            else:
                os.environ["FUSELM_CACHE"] = old
    return compile_s[0], compile_s[1], first_token_s[1]


def _decode_rate(engine, prompt, n: int, start: int = 0) -> tuple[float, float]:
    """(time to first token, decode tok/s over n tokens) from a fresh conversation whose prompt
    starts at position `start` (the cache rows before it are whatever they hold)."""
    engine.reset()
    engine.position = start
    t0 = time.perf_counter()
    tok = engine.prefill(prompt, GREEDY)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(n):
        tok = engine.decode(tok, GREEDY)
    return ttft, n / (time.perf_counter() - t1)


def batch_rates(engine, batches: tuple[int, ...], tokens: int, vocab: int, prompt: int = 32,
                profile: bool = False) -> dict:
    """Decode throughput of continuous batching (runtime/cuda_batch.py) beside `engine`: for each
    B of `batches`, B sequences of `prompt` random tokens prefilled together, then `tokens` steps
    of one token of each, timed as the server runs steps: each queued before the step before it
    is done, fed that step's picks on the GPU, whose ids come back meanwhile; greedy, then every
    row drawn at SAMPLED's settings (runtime/sampling.sample_rows on the GPU).
    {"B": {"tok_s", "step_ms", "sampled_tok_s", "sampled_step_ms"}}, and the page rows, under
    "pages"; with `profile`, each B's step timed per kernel function too ("profile", as
    prefill_profile)."""
    from ..runtime.batch import Chunk
    from ..runtime.cuda_batch import CudaBatchEngine
    from ..runtime.sampling import Sampler
    rows = prompt + tokens
    batch = None
    rng = np.random.default_rng(1)
    out = {}
    for b in batches:
        if batch is None:
            from ..codegen.build import batch_page
            page = batch_page(engine.graph, engine.program.target, engine.program.tuning)
            per_seq = -(-rows // page)
            batch = CudaBatchEngine(engine, pages=max(max(batches) * per_seq, -(-engine.max_context // page)))
        if b > batch.step_tokens:
            out[str(b)] = {"skipped": f"more sequences than the largest batch step, {batch.step_tokens} tokens"}
            continue
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        chunks = [Chunk(rng.integers(0, vocab, prompt).tolist(), 0, t) for t in tables]
        per_step = max(1, batch.step_tokens // prompt)
        for i in range(0, b, per_step):
            batch.step(chunks[i:i + per_step])
        first = rng.integers(0, vocab, b)

        def steps(start, count, samplers=None):   # each fed the picks of the one before (server/batcher.py, 4)
            before = None
            for k in range(start, start + count):
                picks = (before, [(i, i) for i in range(b)]) if before else None
                draws = [s.draw() for s in samplers] if samplers else None
                queued = batch.launch([Chunk([int(first[i])], prompt + k, tables[i]) for i in range(b)], picks, draws)
                if before:
                    before.result().picks()    # the host takes the picks while the next step runs
                before = queued
            return before
        out[str(b)] = {}
        for label, samplers in (("", None), ("sampled_", [Sampler(replace(SAMPLED, seed=i)) for i in range(b)])):
            steps(0, 1, samplers).result().picks()       # warm-up (the step's graph capture, CuPy's kernels)
            t0 = time.perf_counter()
            steps(1, tokens, samplers).result().picks()
            elapsed = time.perf_counter() - t0
            out[str(b)].update({f"{label}tok_s": round(b * tokens / elapsed, 1),
                                f"{label}step_ms": round(elapsed / tokens * 1e3, 3)})
        if profile:   # the last step's inputs are in place
            size = min(s for s in batch.sizes if s >= b)
            out[str(b)]["profile"] = step_profile(engine, batch._steps[size], size)
    return {"pages": batch.page, **out} if batch else {}


def step_bytes(kernels, states, context: float) -> float:
    """Bytes one decode step moves: every kernel's weights and activations as codegen counted them
    (an embedding reads one row, a MoE only its chosen experts), plus the KV cache at `context`."""
    fixed = sum(k.bytes_read + k.bytes_written for k in kernels if k.family != "attention")
    # K and V rows of every layer: bf16 [ctx, width] or fp8 [ctx, stride bytes] (default: bf16)
    kv_row = sum(s.shape[1] * getattr(s, "itemsize", 2) for s in states.values())
    return fixed + kv_row * context


def bench_model(name: str, ctx: int = 4608, runs: int = 3, tokens: int = 128, do_profile: bool = False,
                peers: tuple[str, ...] = (), copy_Bps: float | None = None, fuse: bool = True,
                decode_only: bool = False, positions: tuple[int, ...] = (), tuning=None,
                quant: str | None = None, kv: str = "bf16", batches: tuple[int, ...] = (),
                prompts: tuple[int, ...] = ()) -> dict:
    """Measure one preset or checkpoint (see the module docstring); `decode_only` skips the compile
    and long-prompt measurements and the profile at 4k (for quick A/B runs); `positions`: decode
    tok/s also from each of these start positions (the cache grows to hold the last one's run);
    `quant`: a preset's weights made in that scheme's formats (quant/schemes.py); `kv`: the KV
    cache's dtype (bf16, fp8 or auto: by the context, resolve_kv); `batches`: continuous-batching throughput at these numbers of
    sequences (batch_rates); `prompts`: the time to the first token of prompts of these lengths
    (long ones go in chunks; the cache grows to hold them)."""
    import cupy as cp

    from ..runtime.cuda_engine import CudaEngine
    from ..runtime.random_weights import random_gpu_weights
    ckpt = None
    if "@" in name and not Path(name).exists():     # "preset@scheme": the preset quantized
        name, _, quant = name.partition("@")
    if Path(name).exists():              # a checkpoint: its own weights
        from ..loading.checkpoint import open_checkpoint
        ckpt = open_checkpoint(name)
        cfg = ckpt.config
    else:
        cfg = preset(name)
    ctx = context_for(cfg, name, ctx, positions, tokens, prompts)
    kv = resolve_kv(kv, ctx)
    graph = build_graph(cfg)
    t0 = time.perf_counter()
    if ckpt is not None:
        import ml_dtypes

        from ..loading.checkpoint import load_weights
        from ..runtime.cuda_engine import as_device
        # on the GPU once: the start-up engines below then share them, as presets' do; a GGUF's
        # quantized matrices stay in their formats, as fuselm.load keeps them
        loaded = load_weights(ckpt, graph, dtype=ml_dtypes.bfloat16, keep_quantized=True)
        weights = {k: QuantizedWeight(w.format, w.shape, cp.asarray(w.data)) if isinstance(w, QuantizedWeight)
                   else as_device(cp, w) for k, w in loaded.items()}
        dtype = "+".join(sorted({w.format for w in weights.values() if isinstance(w, QuantizedWeight)})) or "bf16"
    else:
        formats = quant_formats(graph, quant) if quant else None
        weights = random_gpu_weights(graph, formats=formats)
        dtype = quant or "bf16"
    cp.cuda.Device().synchronize()
    load = time.perf_counter() - t0
    cold, warm, warm_start = (start_times(graph, weights, cfg.vocab_size, ctx, fuse, tuning, kv) if not decode_only
                              else (None,) * 3)
    engine = CudaEngine(graph, weights, ctx=ctx, fuse=fuse, tuning=tuning, kv=kv)
    del weights
    rng = np.random.default_rng(0)
    prompt32 = rng.integers(0, cfg.vocab_size, 32).tolist()
    prompt512 = rng.integers(0, cfg.vocab_size, 512).tolist()
    engine.capture_graphs()                                        # every schedule's, untimed
    _decode_rate(engine, prompt32, 8)                              # warm-up
    results = [_decode_rate(engine, prompt32, tokens) for _ in range(runs)]
    ttft32 = statistics.median(r[0] for r in results)
    tok_s = statistics.median(r[1] for r in results)
    ablation = step_ablation(engine) if do_profile else None      # at this short context
    ttft512 = ttft4096 = ablation_4k = None
    if not decode_only:
        ttft512, _ = _decode_rate(engine, prompt512, 1)
        if ctx > 4096:
            ttft4096, _ = _decode_rate(engine, rng.integers(0, cfg.vocab_size, 4096).tolist(), 1)
    def rate_from(start: int) -> float:   # median decode tok/s of a conversation from `start`
        return statistics.median(_decode_rate(engine, prompt32[:1], tokens, start=start)[1] for _ in range(runs))
    # 4k context, from position 4096 (its graphs were captured above; no further warm-up)
    tok_s_4k = rate_from(4096)
    tok_s_at = {str(p): round(rate_from(p), 1) for p in positions}
    ttft_at = {str(n): _decode_rate(engine, rng.integers(0, cfg.vocab_size, n).tolist(), 1)[0] for n in prompts}
    if do_profile and not decode_only:
        ablation_4k = step_ablation(engine)
    batched = batch_rates(engine, batches, tokens, cfg.vocab_size, profile=do_profile) if batches else None
    bytes_per_token = step_bytes(engine.kernels, engine.states, context=32 + tokens / 2)
    res = {"model": name, "dtype": dtype, "kv_dtype": kv, "weights": "checkpoint" if ckpt is not None else "random", "fused": fuse, "decode_tok_s": round(tok_s, 1),
           "ms_per_token": round(1e3 / tok_s, 3), "bytes_per_token": int(bytes_per_token),
           "achieved_GBps": round(bytes_per_token * tok_s / 1e9, 1),
           "ttft_32_ms": round(ttft32 * 1e3, 1), "ttft_512_ms": _round(ttft512, 1e3, 1),
           "ttft_4096_ms": _round(ttft4096, 1e3, 1),
           # prompt tokens over the time to the first token (which also takes a decode step)
           "prefill_tok_s_512": _round(ttft512 and 512 / ttft512, 1, 0),
           "prefill_tok_s_4096": _round(ttft4096 and 4096 / ttft4096, 1, 0),
           "decode_tok_s_at_4k": _round(tok_s_4k, 1, 1), "ratio_4k": _round(tok_s_4k, 1 / tok_s, 3),
           # start position -> decode tok/s of a run from there (--positions)
           **({"decode_tok_s_at": tok_s_at} if tok_s_at else {}),
           # prompt length -> its time to the first token, and prompt tokens a second (--prompts)
           **({"ttft_at_ms": {n: round(t * 1e3, 1) for n, t in ttft_at.items()},
               "prefill_tok_s_at": {n: round(int(n) / t) for n, t in ttft_at.items()}} if ttft_at else {}),
           # sequences in one continuous batch -> output tok/s of them all, ms per step (--batch)
           **({"batch_decode": batched} if batched else {}),
           "compile_cold_s": _round(cold, 1, 2), "compile_warm_s": _round(warm, 1, 2),
           "warm_start_s": _round(warm_start, 1, 2),
           "load_s": round(load, 2), "peak_gpu_GiB": round(cp.get_default_memory_pool().total_bytes() / 2**30, 2),
           "launches_per_token": len(engine.schedule_at(32 + tokens // 2)),
           "launches_per_token_at_4k": len(engine.schedule_at(4096)), "pdl": engine.pdl,
           "prefill_tokens_per_step": list(engine.batched_prefill.sizes) if engine.batched_prefill else [1],
           "prefill_refused": engine.prefill_refused}
    if copy_Bps:
        res["bandwidth_fraction"] = round(bytes_per_token * tok_s / copy_Bps, 3)
        res["bandwidth_limit_tok_s"] = round(copy_Bps / bytes_per_token, 1)
    if do_profile:
        res["ablation"], res["ablation_4k"] = ablation, ablation_4k
        res["profile"] = kernel_profile(engine)
        if engine.batched_prefill and not decode_only:
            # the last step of the 512-token prompt: its attention walks the most rows
            res["prefill_profile"] = prefill_profile(engine, start=512 - max(engine.batched_prefill.sizes))
    del engine
    cp.get_default_memory_pool().free_all_blocks()
    if "hf" in peers:
        res["hf_eager_tok_s"] = hf_decode_rate(cfg, tokens)
        res["vs_hf"] = round(tok_s / res["hf_eager_tok_s"], 2)
    return res


def quant_formats(graph, scheme: str) -> dict[str, str]:
    """The formats of `graph`'s quantizable weights under `scheme` (quant/schemes.py)."""
    from ..quant.schemes import graph_formats
    try:
        return graph_formats(graph, scheme)
    except ValueError as e:
        raise FuselmError(f"--quant: {e}") from None


def context_for(cfg, name: str, ctx: int, positions: tuple[int, ...], tokens: int,
                prompts: tuple[int, ...] = ()) -> int:
    """KV cache rows for a bench of `name`: `ctx`, or more where a run from one of `positions`
    or a prompt of one of `prompts` tokens (and its first token) needs them; a one-line error
    where that passes the model's maximum."""
    bad = [p for p in positions if p < 0]
    if bad:
        raise FuselmError(f"--positions: start positions must be 0 or more, got {bad[0]}")
    if any(n < 1 for n in prompts):
        raise FuselmError(f"--prompts: prompts must be at least 1 token long, got {min(prompts)}")
    need = max((p + tokens + 1 for p in positions), default=0)
    if need > cfg.max_position_embeddings:
        raise FuselmError(f"--positions: a run of {tokens} tokens from {max(positions)} needs {need} positions; "
                          f"{name} holds {cfg.max_position_embeddings}")
    if prompts and max(prompts) + 1 > cfg.max_position_embeddings:
        raise FuselmError(f"--prompts: a prompt of {max(prompts)} tokens and its answer need {max(prompts) + 1} "
                          f"positions; {name} holds {cfg.max_position_embeddings}")
    return max(ctx, need, max(prompts, default=0) + 1)


def _round(x: float | None, scale: float, digits: int) -> float | None:
    return None if x is None else round(x * scale, digits)


def hf_decode_rate(cfg, tokens: int) -> float:
    """Hugging Face transformers, eager bf16, greedy, same shapes with random weights."""
    import torch
    import transformers
    conf = transformers.AutoConfig.for_model("mistral" if cfg.architecture.startswith("Mistral") else "llama",
                                            **{k: v for k, v in cfg.extra.items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(conf, torch_dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        rates = []
        for n in (1, tokens + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            rates.append(time.perf_counter() - t)
    del model
    torch.cuda.empty_cache()
    return round(tokens / (rates[1] - rates[0]), 1)


def run(models: list[str], out: str | None = None, tuning=None, **kw) -> dict:
    """Benchmark `models` with `tuning` (default: the defaults with $FUSELM_TUNE), print a table,
    write JSON to `out` if given, return the record; its "tuning" lists the values that differ
    from the defaults, so that an A/B record says which side it is."""
    import cupy as cp

    from ..codegen import Tuning
    from ..runtime.cuda_engine import gpu_name
    tuning = tuning or Tuning.from_env()
    copy = copy_bandwidth()
    record = {"gpu": gpu_name(), "date": date.today().isoformat(), "copy_GBps": round(copy / 1e9, 1),
              "tuning": tuning.changed(), "results": []}
    print(f"{record['gpu']}: device copy {copy / 1e9:.0f} GB/s (read + write)")
    for m in models:
        r = bench_model(m, copy_Bps=copy, tuning=tuning, **kw)
        record["results"].append(r)
        print(_row(r), flush=True)
        if r.get("profile"):
            for fam, p in r["profile"].items():
                print(f"    {fam:10s} {p['launches']:4d} launches {p['us']:9.1f} us/token {p['GBps']:8.1f} GB/s")
        for key, where in (("ablation", "short context"), ("ablation_4k", "4k context")):
            if r.get(key):
                a = r[key]
                print(f"    {where}: step without sampler {a['step_us']} us, GEMVs alone {a['gemv_only_us']} us; "
                      "saved without:")
                for fn, w in a["without"].items():
                    print(f"      {w['saved_us']:8.1f} us  {w['launches']:3d} x {fn}")
        steps = [("prefill step of", r.get("prefill_profile"))] + [
            (f"batch step of {b} sequences in", v.get("profile")) for b, v in (r.get("batch_decode") or {}).items()
            if b != "pages"]
        for what, pp in steps:
            if not pp:
                continue
            print(f"    {what} {pp['tokens']} tokens: {pp['step_us']} us as a graph; launches alone:")
            for fn, f in sorted(pp["functions"].items(), key=lambda kv: -kv[1]["us"]):
                rate = f"{f['GBps']:8.1f} GB/s" if f["GBps"] is not None else f"{'-':>8s}     "
                flops = f"{f['TFLOPs']:6.1f} TFLOP/s" if f.get("TFLOPs") else f"{'':14s}"
                print(f"      {f['us']:8.1f} us {rate} {flops}  {f['launches']:3d} x {fn}")
        if out:   # after every model, so a run cut short keeps what it measured
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(record, indent=1) + "\n")
    del cp
    return record


def _row(r: dict) -> str:
    """One model's line of the printed table; what a run did not measure (--decode-only) is left out."""
    s = (f"{r['model']:14s} {r['dtype']:7s} {r['decode_tok_s']:8.1f} tok/s {r['ms_per_token']:7.3f} ms/tok "
         f"{r.get('bandwidth_fraction', 0) * 100:5.1f}% of copy bw | ttft32 {r['ttft_32_ms']} ms")
    for n in (512, 4096):   # (records written before these fields have no prefill rates)
        if r.get(f"ttft_{n}_ms") is not None:
            rate = r.get(f"prefill_tok_s_{n}")
            s += f" ttft{n} {r[f'ttft_{n}_ms']} ms" + (f" ({rate:.0f} tok/s)" if rate else "")
    for n, ms in r.get("ttft_at_ms", {}).items():
        s += f" ttft{n} {ms} ms ({r['prefill_tok_s_at'][n]:.0f} tok/s)"
    if r["decode_tok_s_at_4k"] is not None:
        s += f" | 4k ctx {r['decode_tok_s_at_4k']} tok/s ({r['ratio_4k'] * 100:.1f}%)"
    at = r.get("decode_tok_s_at") or r.get("decode_tok_s_from")   # (older records: "_from")
    if at:
        s += f" | from{' (' + r['kv_dtype'] + ' KV)' if r.get('kv_dtype', 'bf16') != 'bf16' else ''} " + \
            ", ".join(f"{p}: {v}" for p, v in at.items()) + " tok/s"
    if r.get("batch_decode"):
        s += " | batched " + ", ".join(f"{b}: {v['tok_s']}" + (f" ({v['sampled_tok_s']} sampled)" if "sampled_tok_s" in v else "")
                                       for b, v in r["batch_decode"].items() if b != "pages" and "tok_s" in v) + " tok/s"
    if r["compile_cold_s"] is not None:
        s += (f" | compile {r['compile_cold_s']}s cold {r['compile_warm_s']}s warm"
              f" | warm start {r['warm_start_s']}s")
    s += f" | {r['peak_gpu_GiB']} GiB"
    if "hf_eager_tok_s" in r:
        s += f" | HF eager {r['hf_eager_tok_s']} tok/s (x{r['vs_hf']})"
    return s


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`fuselm bench`'s options."""
    p.add_argument("models", nargs="*", default=["llama-3.2-1b", "llama-3.1-8b"],
                   help=f"presets (random weights of real shapes): {', '.join(PRESETS)}, each also as "
                        f"PRESET@SCHEME with its weights in a quantization scheme ({', '.join(SCHEMES)}); "
                        "or checkpoint paths (HF folder or .gguf)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--profile", action="store_true",
                   help="time per kernel family, and each kernel's marginal time inside the step")
    p.add_argument("--peers", default="", help="comma list; 'hf' = Hugging Face transformers eager")
    p.add_argument("--no-fuse", action="store_true")
    p.add_argument("--decode-only", action="store_true",
                   help="only decode speed, short and at 4k (no compile or 512-token prompt runs)")
    p.add_argument("--positions", type=_positions, default=(), metavar="P[,P...]",
                   help="decode tok/s also from these start positions (context lengths), e.g. 1024,2048,8000")
    p.add_argument("--prompts", type=_positions, default=(), metavar="N[,N...]",
                   help="time to the first token of prompts of N tokens too, e.g. 32768 (chunked)")
    p.add_argument("--batch", dest="batches", type=_positions, default=(), metavar="B[,B...]",
                   help="continuous-batching decode throughput of B sequences at once, e.g. 1,8,32,64")
    p.add_argument("--json", dest="out", help="write the JSON record here")
    p.add_argument("--quant", choices=SCHEMES, default=None,
                   help="presets: weights made in this quantization scheme's formats (q4_k_m as llama.cpp's)")
    from ..cli import add_kv_argument
    add_kv_argument(p)
    from .inspect import add_tune_argument
    add_tune_argument(p)


def _positions(text: str) -> tuple[int, ...]:
    """--positions' value: comma-separated start positions."""
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got '{text}'") from None


def main(args: argparse.Namespace) -> int:
    """`fuselm bench`: run() over the parsed arguments; 0 on success."""
    from .inspect import tuning_of
    run(args.models, out=args.out, tuning=tuning_of(args), runs=args.runs, tokens=args.tokens, do_profile=args.profile,
        peers=tuple(p for p in args.peers.split(",") if p), fuse=not args.no_fuse,
        decode_only=args.decode_only, positions=args.positions, quant=args.quant, kv=args.kv,
        batches=args.batches, prompts=args.prompts)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="fuselm bench")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))

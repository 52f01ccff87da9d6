"""GPU checks of the fp8 KV cache: decode (every attention variant) and batched prefill against
the numpy reference that models the fp8 cache exactly (dsl/kv_dtype.py), on fresh random inputs
with every runtime buffer and the caches poisoned first (NaN activations, NaN e4m3 codes), and the
fp8-KV logits against the bf16-KV ones.

The two sides compute the values written to the cache in a different float32 order (and the
wgmma prefill takes its vectors in bf16), so a value within rounding of a boundary between two
e4m3 codes may take the other code: a step of 1/16 of the value, rare. The bounds below allow
for that and nothing more; bf16-vs-fp8 logits differ by the quantization itself.
"""
from __future__ import annotations

import numpy as np
import pytest

from fuselm.dsl.kv_dtype import with_kv_dtype
from fuselm.models import DecoderConfig, build_graph
from fuselm.models.presets import PRESETS
from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.reference import new_state, run_graph

from test_gpu import TINY, engine_for, pytestmark, random_weights, rel  # noqa: F401  (pytestmark: gpu, skip)

# Errors are bimodal: ~1e-6 where every code matches the reference's, ~1e-2 where a value on a
# rounding boundary took the next code (the GPU and numpy sum in other orders), and each layer's
# flipped codes move the next layer's inputs, so flips grow with depth. Measured (random weights)
# at SmolLM2's shapes, 8 layers: logits 7e-3 / caches 1.2e-2 (H200), 1.4e-2 / 1.7e-2 (H100); tiny
# models up to 1.1e-2 (H100). A wrong scale or row is off by O(1).
FP8_DECODE_TOL = 3e-2     # logits, GPU fp8 cache vs the reference's fp8 cache
FP8_CACHE_TOL = 3e-2      # cache values, likewise (a code flip moves one value by 1/16)
# The batched prefill's bf16 vectors (test_gpu.PREFILL_TOL) flip more codes: layer 0's caches
# (inputs moved by the bf16 vectors alone) measured 1.0e-2-1.1e-2 from the reference and from
# one-token steps; the flips compound through the layers (the last layer's caches 4e-2-9e-2), and
# the logits of random-weight models move by up to 9e-2 (reference) and 2.2e-1 (one-token steps,
# SmolLM2 shapes, 4 layers). A wrong row, scale or position moves them by O(1).
FP8_PREFILL_FIRST_CACHE_TOL = 3e-2
FP8_PREFILL_CACHE_TOL = 1.5e-1
FP8_PREFILL_LOGIT_TOL = 3e-1
# logits of an fp8-KV run against a bf16-KV run (4 layers, 700 + 16 tokens): measured at most
# 8e-2 for Llama-3.2-1B's shapes and 1.3e-1 for Llama-3.1-8B's.
FP8_VS_BF16_TOL = 2e-1

E4M3_NAN = 0x7F


def poison(eng) -> None:
    """NaN into every activation and scratch buffer the next step writes before it reads."""
    import cupy as cp
    with eng.stream:
        eng.arena.view(cp.float32).fill(cp.nan)
        eng.workspace.fill(cp.nan)
        eng.kv_stage.fill(cp.nan)


def fp8_engine(graph, weights, ctx, **kw):
    """A CUDA engine with an fp8 KV cache whose every byte starts as a NaN code."""
    eng = engine_for(graph, weights, ctx=ctx, kv="fp8", **kw)
    with eng.stream:
        for c in eng.states.values():
            c.fill(E4M3_NAN)
    return eng


def decode_against_reference(graph, weights, tokens, ctx, variant=None) -> tuple[float, float]:
    """Feed `tokens` one per step to the fp8 GPU engine and the fp8 reference: (worst relative
    logit error, relative error of the caches after the last step)."""
    eng = fp8_engine(graph, weights, ctx, variant=variant)
    ref_graph = with_kv_dtype(graph, "fp8")
    state = new_state(graph, ctx)
    out = next(iter(graph.outputs))
    worst = 0.0
    for p, t in enumerate(tokens):
        poison(eng)
        eng.feed(int(t))
        got = eng.output(out)[0]
        ref = run_graph(ref_graph, weights, {"ids": np.array([t], np.int32), "pos": np.array([p], np.int32)}, state)[out][0]
        assert np.isfinite(got).all(), f"step {p}: unwritten or non-finite logits"
        worst = max(worst, rel(got, ref))
    n = len(tokens)
    cache = max(rel(eng.state_rows(name, n), state[name][:n]) for name in eng.states)
    return worst, cache


TINY_LAYOUTS = {"mma-hd32x8": {},                                              # LanePass (head size 32)
                "mma-hd64": {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2},   # MmaPass
                "lane-hd40": {"hidden_size": 200, "num_attention_heads": 5, "num_key_value_heads": 1},
                "mma-hd128-window": {"architectures": ["MistralForCausalLM"], "head_dim": 128,
                                     "num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 20}}


@pytest.mark.parametrize("variant", [None, "single", "general"], ids=["by-position", "single", "split"])
@pytest.mark.parametrize("layout", sorted(TINY_LAYOUTS))
def test_fp8_decode_matches_the_fp8_reference(layout, variant):
    """40 steps (several split chunks), each attention variant forced or picked by position."""
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**TINY, **TINY_LAYOUTS[layout]})
    graph = build_graph(cfg)
    worst, cache = decode_against_reference(graph, random_weights(graph, rng), rng.integers(0, cfg.vocab_size, 40),
                                            ctx=64, variant=variant)
    print(f"fp8 decode {layout} {variant}: logits {worst:.2e}, caches {cache:.2e}")
    assert worst < FP8_DECODE_TOL and cache < FP8_CACHE_TOL, (worst, cache)


def test_fp8_decode_of_real_smollm2_shapes_matches_the_fp8_reference():
    """SmolLM2's 30 layers of 9 heads / 3 KV heads of 64, unfused rowwise writes excluded."""
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**PRESETS["smollm2-135m"], "num_hidden_layers": 8})
    graph = build_graph(cfg)
    worst, cache = decode_against_reference(graph, random_weights(graph, rng), rng.integers(0, cfg.vocab_size, 12),
                                            ctx=1024)
    print(f"fp8 decode smollm2 shapes: logits {worst:.2e}, caches {cache:.2e}")
    assert worst < FP8_DECODE_TOL and cache < FP8_CACHE_TOL, (worst, cache)


def test_unfused_fp8_cache_writes_match_the_fp8_reference():
    """fuse=False: the cache writes run in row-wise kernels (a warp per KV head)."""
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**TINY, **TINY_LAYOUTS["mma-hd64"]})
    graph = build_graph(cfg)
    eng = fp8_engine(graph, random_weights(graph, rng), 64, fuse=False)
    assert any(k.family == "rowwise" and "kv_fp8_head" in k.source for k in eng.kernels)
    del eng
    worst, cache = decode_against_reference(graph, random_weights(graph, rng), rng.integers(0, cfg.vocab_size, 20), 64)
    assert worst < FP8_DECODE_TOL and cache < FP8_CACHE_TOL, (worst, cache)


@pytest.mark.parametrize("layout", ["mma-hd64", "lane-hd40", "smollm2"])
def test_fp8_batched_prefill_matches_the_fp8_reference_and_one_token_steps(layout):
    """A 289-token prompt (steps of 256 and 32, the last padded; arena, scratch and caches
    poisoned) leaves the caches that the fp8 reference and one-token fp8 steps leave; the last
    token's logits and the decode steps after it agree."""
    import cupy as cp
    rng = np.random.default_rng()
    overrides = ({**PRESETS["smollm2-135m"], "num_hidden_layers": 4} if layout == "smollm2"
                 else {**TINY, **TINY_LAYOUTS[layout]})
    cfg = DecoderConfig.from_hf(overrides)
    graph = build_graph(cfg)
    weights = random_weights(graph, rng)
    n = 289
    prompt = rng.integers(0, cfg.vocab_size, n).tolist()
    batched = fp8_engine(graph, weights, 512)
    stepped = fp8_engine(graph, weights, 512, batched_prefill=False)
    assert batched.batched_prefill is not None
    pre = batched.batched_prefill
    with batched.stream:
        pre.arena.view(cp.float32).fill(cp.nan)
        for name in ("workspace", "gemm_slabs", "gemm_x", "kv_stage"):
            pre.buffers[name].fill(cp.nan)
    batched.prefill(prompt, SamplingParams())
    stepped.prefill(prompt, SamplingParams())
    state = new_state(graph, 512)
    out = next(iter(graph.outputs))
    ref = run_graph(with_kv_dtype(graph, "fp8"), weights,
                    {"ids": np.array(prompt, np.int32), "pos": np.arange(n, dtype=np.int32)}, state)[out][-1]
    caches = {name: (rel(batched.state_rows(name, n), state[name][:n]),
                     rel(batched.state_rows(name, n), stepped.state_rows(name, n))) for name in batched.states}
    worst_cache = max(max(v) for v in caches.values())
    assert all(np.isfinite(batched.state_rows(name, n)).all() for name in batched.states)
    errs = [rel(batched.logits(), ref), rel(batched.logits(), stepped.logits())]
    for t in rng.integers(0, cfg.vocab_size, 4):
        batched.decode(int(t), SamplingParams())
        stepped.decode(int(t), SamplingParams())
        errs.append(rel(batched.logits(), stepped.logits()))
    print(f"fp8 prefill {layout}: caches at most {worst_cache:.2e} from the reference / one-token steps; "
          f"logits {errs[0]:.2e} from the reference, then at most {max(errs[1:]):.2e} from one-token steps")
    first = max(v for name, pair in caches.items() if name.startswith("cache.0.") for v in pair)
    assert first < FP8_PREFILL_FIRST_CACHE_TOL, caches
    assert worst_cache < FP8_PREFILL_CACHE_TOL and max(errs) < FP8_PREFILL_LOGIT_TOL, (caches, errs)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
def test_fp8_kv_logits_stay_near_bf16_kv_logits_at_real_shapes(name):
    """Random weights of real shapes (4 layers), made on the GPU: a 700-token prompt through the
    batched prefill, then 16 decode steps, with a bf16 and an fp8 KV cache; the logits differ by
    the quantization of the cache alone (bound FP8_VS_BF16_TOL, measured on the H200)."""
    from fuselm.runtime.cuda_engine import CudaEngine
    from fuselm.runtime.random_weights import random_gpu_weights
    cfg = DecoderConfig.from_hf({**PRESETS[name], "num_hidden_layers": 4})
    graph = build_graph(cfg)
    weights = random_gpu_weights(graph)
    rng = np.random.default_rng()
    prompt = rng.integers(0, cfg.vocab_size, 700).tolist()
    follow = rng.integers(0, cfg.vocab_size, 16).tolist()
    logits = {}
    for kv in ("bf16", "fp8"):
        eng = CudaEngine(graph, weights, ctx=1024, kv=kv)
        eng.prefill(prompt, SamplingParams())
        rows = [eng.logits()]
        for t in follow:
            eng.decode(int(t), SamplingParams())
            rows.append(eng.logits())
        logits[kv] = np.stack(rows)
        del eng
    errs = [rel(a, b) for a, b in zip(logits["fp8"], logits["bf16"])]
    print(f"{name} fp8 vs bf16 KV: logits at most {max(errs):.2e} apart (mean {np.mean(errs):.2e})")
    assert np.isfinite(logits["fp8"]).all() and max(errs) < FP8_VS_BF16_TOL, errs

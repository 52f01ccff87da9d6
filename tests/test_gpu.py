"""GPU checks (run on the device machine): generated kernels against the numpy reference and
against Hugging Face transformers. Every check draws fresh random inputs and poisons the
activation arena with NaN first, so an element no kernel wrote shows up as NaN."""
from __future__ import annotations

import dataclasses
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from fuselm.dsl import Graph
from fuselm.errors import FuselmError
from fuselm.models import DecoderConfig, build_graph, checkpoint_views
from fuselm.models.presets import PRESETS
from fuselm.runtime.cuda_engine import gpu_available
from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.reference import new_state, run_graph

sys.path.insert(0, str(Path(__file__).parent))   # graph_strategies, shared with the CPU tests

from hub_names import mixtral_checkpoint_names  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU on this machine")]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bf16_round(x: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def random_weights(graph: Graph, rng, std=0.1) -> dict:
    """bf16-representable float32 weights, so both sides use identical numbers."""
    out = {}
    for n in graph.sources("weight"):
        w = (1 + 0.1 * rng.standard_normal(n.shape)) if len(n.shape) == 1 else std * rng.standard_normal(n.shape)
        out[n.name] = bf16_round(w.astype(np.float32))
    return out


def engine_for(graph, weights, ctx=64, **kw):
    from fuselm.runtime.cuda_engine import CudaEngine
    return CudaEngine(graph, weights, ctx=ctx, **kw)


@contextmanager
def bf16_kv_cache():
    """The reference's kv_write rounds its rows to bf16, as the GPU's KV cache stores them: the
    two sides then differ only by float32 arithmetic, and a tight tolerance means something."""
    from fuselm.dsl import ops
    plain = ops.REGISTRY["kv_write"]
    ops.REGISTRY["kv_write"] = dataclasses.replace(plain, reference=lambda c, x, p: plain.reference(c, bf16_round(x), p))
    try:
        yield
    finally:
        ops.REGISTRY["kv_write"] = plain


def compare_steps(graph, weights, tokens, ctx=64, fuse=True, tol=5e-3, variant=None, logits=None,
                  reference_weights=None):
    """Feed `tokens` one by one to the GPU and to the reference (bf16 KV cache on both sides);
    worst relative logit error. variant: the attention variant at every position (CudaEngine).
    logits: a list that receives the GPU's logits of every step. reference_weights: what the
    reference runs with, where the GPU's differ in form (quantized weights, dequantized)."""
    import cupy as cp
    eng = engine_for(graph, weights, ctx=ctx, fuse=fuse, variant=variant)
    state = new_state(graph, ctx)
    worst = 0.0
    for p, t in enumerate(tokens):
        with eng.stream:                                   # poison, ordered before the step
            eng.arena.view(cp.float32).fill(cp.nan)
            eng.workspace.fill(cp.nan)
        eng.feed(int(t))
        got = eng.output(next(iter(graph.outputs)))[0]
        with bf16_kv_cache():
            ref = run_graph(graph, reference_weights or weights,
                            {"ids": np.array([t], np.int32), "pos": np.array([p], np.int32)},
                            state)[next(iter(graph.outputs))][0]
        assert np.isfinite(got).all(), f"step {p}: unwritten or non-finite logits"
        worst = max(worst, rel(got, ref))
        if logits is not None:
            logits.append(got)
    assert worst < tol, f"relative logit error {worst:.2e}"
    return worst


TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256, intermediate_size=640,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("variant", [{}, {"tie_word_embeddings": True, "num_key_value_heads": 8},
                                     {"hidden_size": 200, "num_attention_heads": 5, "num_key_value_heads": 1},
                                     {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 4}])
def test_tiny_llama_matches_reference(fuse, variant):
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**TINY, **variant})
    graph = build_graph(cfg)
    worst = compare_steps(graph, random_weights(graph, rng), rng.integers(0, cfg.vocab_size, 40), fuse=fuse)
    print(f"tiny llama {variant} fuse={fuse}: worst rel logit error {worst:.2e}")


ARCH_TINY = {   # every architecture's distinctive features on, at sizes a test runs in seconds
    "MistralForCausalLM": dict(sliding_window=8),
    "Qwen2ForCausalLM": dict(use_sliding_window=False),
    "Qwen3ForCausalLM": dict(head_dim=64, num_attention_heads=4, num_key_value_heads=2),
    "Gemma2ForCausalLM": dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
    # top-k weights not renormalised, narrow experts. More experts would leave the batched-prefill
    # test nothing to compare: with 32 and top 4 the 4th logit led the 5th by less than
    # ROUTING_MARGIN of the largest in 8 or 9 of its 9 rows (H100 run, both prefill sizes)
    "Qwen3MoeForCausalLM": dict(head_dim=64, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=False),
    # sinks, biases, alternating windows, YaRN, routed experts with biases and the clamped SwiGLU
    "GptOssForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, attention_bias=True,
                              layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
                              rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
}


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("arch", sorted(ARCH_TINY))
def test_architectures_match_reference(arch, fuse):
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**TINY, "architectures": [arch], **ARCH_TINY[arch]})
    graph = build_graph(cfg)
    worst = compare_steps(graph, random_weights(graph, rng), rng.integers(0, cfg.vocab_size, 24), fuse=fuse)
    print(f"{arch} fuse={fuse}: worst rel logit error {worst:.2e}")


def cache_rows(eng, rows: int) -> dict[str, np.ndarray]:
    """The first `rows` rows of every KV cache of `eng`, as float32."""
    import cupy as cp
    eng.stream.synchronize()
    return {n: (cp.asnumpy(c[:rows]).astype(np.uint32) << 16).view(np.float32) for n, c in eng.states.items()}


# Batched prefill against one-token steps: Hopper's wgmma gemms take the vectors in bf16, as a bf16
# transformers run does (each rounded to 2^-9 of itself; decode keeps them float32), so the caches
# differ by a few bf16 units (measured 6e-3 to 1e-2) and the logits by up to 3e-2 (Gemma 2's
# soft-capped ones): the bound of the quantized models' staged vectors.
PREFILL_TOL = 5e-2
# Mixtral: the router stays float32-accurate, but the bf16 vectors of the layers before it move
# its inputs, and a token whose top-2 margin is below that takes another expert (measured cache
# differences 5.0e-2 to 1.0e-1 where that happens, 1e-2 where not), as in a bf16 transformers run;
# the test spreads the routers' logits (weights x 8) so that few tokens sit that close.
MOE_PREFILL_TOL = 1.5e-1


ROUTERS = ("block_sparse_moe.gate.weight", "mlp.gate.weight", "mlp.router.weight")   # Mixtral's, Qwen3-MoE's, gpt-oss's


# routing_margins: a row whose top-k router logits lead the next by less than this share of its
# largest logit may take another expert under bf16 inputs (the comment above). In the tiny MoE
# configs (routers x 32, numpy), a random error of 1e-2 (2e-2) of the router input's norm, the
# size of the GPU's differences past the first layer, moved that lead by up to 4.8e-2 (8.0e-2)
# of the largest logit over 123 rows; 3e-2 let flipped rows through (0.4 to 0.9 off).
ROUTING_MARGIN = 1e-1


def routing_margins(graph, trace: dict) -> np.ndarray:
    """Each row's smallest lead, over the MoE layers of `graph`, of its k-th router logit over the
    (k+1)-th, as a share of its largest logit: from `trace`, a reference run's node values
    (run_graph(..., trace=)). Ones where the graph has no MoE layer."""
    margins = None
    for node in graph.nodes.values():
        if node.op != "moe_ffn":
            continue
        logits = -np.sort(-np.asarray(trace[node.inputs[1]], np.float64), axis=-1)
        k = node.attrs["top_k"]
        lead = (logits[:, k - 1] - logits[:, k]) / np.abs(logits).max(axis=-1)
        margins = lead if margins is None else np.minimum(margins, lead)
    return np.ones(len(trace["ids"])) if margins is None else margins


def is_moe(cfg) -> bool:
    """Whether `cfg` routes over experts: Mixtral's `num_local_experts` or Qwen3-MoE's `num_experts`."""
    return bool(cfg.extra.get("num_local_experts") or cfg.extra.get("num_experts"))


BF16_NAN = 0x7FC0   # a bf16 quiet NaN's bits: the poison of the (uint16) KV caches


def cache_bits(eng, rows: int | None = None) -> dict[str, np.ndarray]:
    """The first `rows` rows (None: all) of every KV cache of `eng`, as their bf16 bits (uint16)."""
    import cupy as cp
    eng.stream.synchronize()
    return {n: cp.asnumpy(c[:rows]) for n, c in eng.states.items()}


def bf16_finite(bits: np.ndarray) -> bool:
    """Whether no element of these bf16 bits is a NaN or an infinity (exponent all ones)."""
    return bool(((bits & 0x7F80) != 0x7F80).all())


# Mistral's window on the tensor-core prefill pass (head size 64, 4 tokens a block), not LanePass's
PREFILL_ARCHS = {"LlamaForCausalLM": {}, **ARCH_TINY,
                 "MistralForCausalLM": dict(sliding_window=8, head_dim=64, num_attention_heads=4, num_key_value_heads=1)}


@pytest.mark.parametrize("sizes", [(64, 32), (256, 32), (512, 32), (112, 48)],
                         ids=["64+32", "256+32", "512+32", "mma-columns-112+48"])
@pytest.mark.parametrize("split_k", ["default", "every-tile"])
@pytest.mark.parametrize("arch", sorted(PREFILL_ARCHS))
def test_batched_prefill_matches_the_reference_and_one_token_steps(arch, split_k, sizes):
    """A 280-token prompt (530 with steps of 512, 264 with 112) through the batched prefill (a step of every
    size it has of `sizes`: 512 or 256, then 32 on Hopper's wgmma gemms, or 64s + 32, or steps of
    112 and 48, off wgmma's multiples of 32, whose mma.sync gemms take column tiles of 56; the last
    one padded, in its form with the logits of its tokens, which give the prompt's last token's;
    its arena and runtime buffers poisoned with NaN first) leaves the caches that one-token
    decode steps leave (bf16 vectors in the wgmma gemms, as a bf16 transformers run has them),
    and the logits of the prompt's last token match
    the numpy reference run over the whole prompt (bf16 KV cache on both sides); the decode steps
    after it agree too. "every-tile": every gemm kernel splits its K as far as it goes, a wgmma
    block taking all of a step's tokens and its slabs costed as free (the default cuts these few
    tiles along the tokens instead; the real-shape tests run the default plans)."""
    import cupy as cp

    from fuselm.codegen import Tuning
    tuning = Tuning(prefill_tokens=sizes, **(dict(gemm_blocks=1 << 16, gemm_min_chunks=1, wgmma_min_columns=256,
                                                   wgmma_slab_cost=0)
                                              if split_k == "every-tile" else {}))
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**TINY, "architectures": [arch], **PREFILL_ARCHS[arch]})
    if max(sizes) == 512 and split_k == "every-tile":
        pytest.skip("steps of 512 have no split-K plans (a wgmma block takes at most 256 tokens)")
    graph = build_graph(cfg)
    weights = random_weights(graph, rng)
    for name in weights:   # routers' logits spread out, so that bf16 vectors rarely flip an expert
        if name.endswith(ROUTERS):
            weights[name] = weights[name] * 8
    n = {512: 530, 112: 264}.get(max(sizes), 280)   # a step of each size, the last one padded
    prompt = rng.integers(0, cfg.vocab_size, n).tolist()
    batched = engine_for(graph, weights, ctx=1024, tuning=tuning)
    stepped = engine_for(graph, weights, ctx=1024, batched_prefill=False)
    assert batched.batched_prefill is not None and stepped.batched_prefill is None
    assert set(batched.batched_prefill.plan_to_logits(n, 0)) == set(batched.batched_prefill.sizes)
    with batched.stream:
        batched.batched_prefill.arena.view(cp.float32).fill(cp.nan)
        batched.batched_prefill.workspace.fill(cp.nan)     # Mixtral's experts' activations
        batched.batched_prefill.buffers["gemm_slabs"].fill(cp.nan)
        batched.batched_prefill.buffers["gemm_x"].fill(cp.nan)      # the staged vectors and sums
    splits = {l.grid[1] for step in batched.batched_prefill.steps.values() for k in step.kernels
              if k.family == "gemm" for l in k.launches}
    assert split_k == "default" or max(splits) > 1, splits
    batched.prefill(prompt, SamplingParams())
    stepped.prefill(prompt, SamplingParams())
    a, b = cache_rows(batched, len(prompt)), cache_rows(stepped, len(prompt))
    cache_err = max(rel(a[n], b[n]) for n in a)
    tol = MOE_PREFILL_TOL if is_moe(cfg) else PREFILL_TOL
    assert all(np.isfinite(a[n]).all() for n in a) and cache_err < tol, f"caches differ: {cache_err:.2e}"
    out = next(iter(graph.outputs))
    fed = prompt + rng.integers(0, cfg.vocab_size, 8).tolist()       # the prompt, then 8 decode steps
    trace = {}
    with bf16_kv_cache():
        ref = run_graph(graph, weights, {"ids": np.array(fed, np.int32), "pos": np.arange(len(fed), dtype=np.int32)},
                        new_state(graph, 1024), trace)[out][n - 1]
    # a row whose routing is a near tie in the reference may take another expert in either engine
    clear = routing_margins(graph, trace) >= ROUTING_MARGIN
    errs = {n - 1: [rel(batched.logits(), ref), rel(batched.logits(), stepped.logits())]}
    for position, t in enumerate(fed[n:], n):
        batched.decode(t, SamplingParams())
        stepped.decode(t, SamplingParams())
        errs[position] = [rel(batched.logits(), stepped.logits())]
    compared = [e for position, row in errs.items() if clear[position] for e in row]
    print(f"{arch} batched prefill: caches {cache_err:.2e} from one-token steps; last prompt token's logits "
          f"{errs[n - 1][0]:.2e} from the reference, {errs[n - 1][1]:.2e} from one-token steps; next 8 steps at most "
          f"{max(e for p in range(n, n + 8) for e in errs[p]):.2e} ({sum(not clear[p] for p in errs)} of 9 rows on near "
          f"ties of the routing set aside)")
    assert compared and max(compared) < tol, errs


@pytest.mark.parametrize("copy", [1, 2, 4])
@pytest.mark.parametrize("shape", ["whole-slots", "part-slot", "every-tile"])
def test_vectors_copied_a_slot_at_a_time_leave_the_bits_of_per_thread_copies(copy, shape):
    """The wgmma gemms with the step's vectors staged in slot order and copied a slot at a time
    (wgmma_vector_copy 1: one bulk copy a block; 2 and 4: each block's part multicast to a
    cluster of that many row tiles) put the same bf16 values in the slots as the producers'
    16-byte copies (0): the same cache and logit bits (assert_prefill_bits_equal). Rows of 200
    weights end in a part slot (its zeros staged)."""
    kernels = assert_prefill_bits_equal(shape, dict(wgmma_vector_copy=0), dict(wgmma_vector_copy=copy))
    clustered = any(f"__cluster_dims__({copy}, 1, 1)" in k.source for k in kernels)
    assert clustered == (copy > 1) or shape == "part-slot" and copy == 4    # its 2 to 10 row tiles: none in 4s


@pytest.mark.parametrize("shape", ["whole-slots", "part-slot", "every-tile"])
def test_the_gemm_epilogue_in_batches_of_rounds_leaves_the_bits_of_one_round_at_a_time(shape):
    """The gemm epilogue loading its operands for 8 rounds before any round writes (its default,
    gemm_epilogue_batch) leaves the cache and logit bits of rounds that load in turn (1)."""
    assert_prefill_bits_equal(shape, dict(gemm_epilogue_batch=1), {})


def assert_prefill_bits_equal(shape: str, a: dict, b: dict) -> list:
    """A 280-token prompt through the batched prefill (steps of 256 and 32) of a tiny Llama of
    `shape` under tunings `a` and `b`, the staged vectors, slabs and arena poisoned with NaN
    first, leaves the same cache bits and last-token logits; returns b's gemm kernels.
    "whole-slots": 4 to 16 row tiles a gemm; "part-slot": rows of 200 weights; "every-tile":
    every gemm splits its K."""
    import cupy as cp

    from fuselm.codegen import Tuning
    rng = np.random.default_rng()
    hf = {**TINY, "hidden_size": 512, "intermediate_size": 1024}
    if shape == "part-slot":
        hf = {**TINY, "hidden_size": 200, "num_attention_heads": 5, "num_key_value_heads": 1}
    split = dict(gemm_blocks=1 << 16, gemm_min_chunks=1, wgmma_min_columns=256, wgmma_slab_cost=0) \
        if shape == "every-tile" else {}
    cfg = DecoderConfig.from_hf(hf)
    graph = build_graph(cfg)
    weights = random_weights(graph, rng)
    prompt = rng.integers(0, cfg.vocab_size, 280).tolist()
    engines = [engine_for(graph, weights, ctx=512, tuning=Tuning(prefill_tokens=(256, 32), **split, **t)) for t in (a, b)]
    kernels = [k for step in engines[1].batched_prefill.steps.values() for k in step.kernels if k.family == "gemm"]
    assert shape != "every-tile" or any(l.grid[1] > 1 for k in kernels for l in k.launches)
    out = []
    for eng in engines:
        with eng.stream:
            for buf in ("gemm_x", "gemm_slabs"):
                eng.batched_prefill.buffers[buf].fill(cp.nan)
            eng.batched_prefill.arena.view(cp.float32).fill(cp.nan)
        eng.prefill(prompt, SamplingParams())
        out.append((cache_bits(eng, len(prompt)), eng.logits()))
    (bits0, logits0), (bits1, logits1) = out
    assert all(bf16_finite(x) for x in bits0.values()) and np.isfinite(logits0).all()
    assert all(np.array_equal(bits0[n], bits1[n]) for n in bits0), "the caches differ"
    assert np.array_equal(logits0.view(np.uint32), logits1.view(np.uint32)), "the last token's logits differ"
    return kernels


def test_batched_prefill_of_a_long_prompt_at_real_shapes():
    """SmolLM2's shapes, a 700-token prompt: the per-token attention walks several passes of the
    cache, and three steps of the 256-token graph replay one CUDA graph (with split-K gemms);
    caches and logits as one-token steps leave them, and a second run leaves the same bits (the
    step ending the prompt gives its last token's logits). Before the second run the
    caches are poisoned with bf16 NaN, and the decode and prefill arenas (the logits among them) and
    runtime buffers with NaN: a cache row or logit it did not write shows."""
    import cupy as cp
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(PRESETS["smollm2-135m"])
    graph = build_graph(cfg)
    weights = random_weights(graph, rng, std=0.02)
    prompt = rng.integers(0, cfg.vocab_size, 700).tolist()
    batched = engine_for(graph, weights, ctx=1024)
    stepped = engine_for(graph, weights, ctx=1024, batched_prefill=False)
    assert batched.batched_prefill is not None, batched.prefill_refused
    batched.prefill(prompt, SamplingParams())
    stepped.prefill(prompt, SamplingParams())
    a, b = cache_rows(batched, len(prompt)), cache_rows(stepped, len(prompt))
    cache_err = max(rel(a[n], b[n]) for n in a)
    logit_err = rel(batched.logits(), stepped.logits())
    print(f"smollm2 shapes, 700-token batched prefill: caches {cache_err:.2e}, logits {logit_err:.2e} from one-token steps")
    assert cache_err < PREFILL_TOL and logit_err < PREFILL_TOL
    # The same prompt again: every sum over slices of k (split-K prefill gemms, the decode GEMVs'
    # warps sharing a row) adds them in a fixed order, so the bits do not depend on timing (so does
    # a MoE's batched prefill: moe_sum_tokens adds each token's expert terms in slot order).
    logits, bits = batched.logits(), cache_bits(batched, len(prompt))
    assert all(bf16_finite(b) for b in bits.values()) and np.isfinite(logits).all()
    batched.reset()
    with batched.stream:                                   # poison, ordered before the second run
        for c in batched.states.values():
            c.fill(BF16_NAN)
        batched.arena.view(cp.float32).fill(cp.nan)        # the decode step's activations
        batched.buffer("logits").fill(cp.nan)              # (the logits are one of them)
        batched.workspace.fill(cp.nan)
        batched.batched_prefill.arena.view(cp.float32).fill(cp.nan)
        batched.batched_prefill.workspace.fill(cp.nan)
        batched.batched_prefill.buffers["gemm_slabs"].fill(cp.nan)
    batched.prefill(prompt, SamplingParams())
    again, again_logits = cache_bits(batched), batched.logits()
    # Rows 0 .. 699 are the prompt's: two cut-down steps of 256 write 0 .. 511, the step ending the
    # prompt 512 .. 699 and its padding to 767; rows from 768 on are no step's, and stay poisoned.
    # The padding's rows are not compared.
    end = sum(batched.batched_prefill.plan_to_logits(len(prompt), 0))
    assert end == 768, end
    assert all(bf16_finite(again[n][:len(prompt)]) for n in again), "the second prefill left poisoned cache rows"
    assert all(np.array_equal(bits[n], again[n][:len(prompt)]) for n in bits), "a second prefill of the same prompt differs"
    assert all((again[n][end:] == BF16_NAN).all() for n in again), f"the second prefill wrote cache rows past {end}"
    assert np.isfinite(again_logits).all(), "the second run left poisoned or non-finite logits"
    assert np.array_equal(logits.view(np.uint32), again_logits.view(np.uint32)), \
        "the last prompt token's logits differ the second time"


def test_logits_of_a_text_through_the_steps_ending_a_prompt():
    """logits_of (perplexity) over 300 tokens goes through the prefill's forms with logits (steps
    of 256 and 64): every position's logits, and the caches, as one-token steps leave them; a
    text whose steps the cache cannot hold goes one token at a time."""
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    weights = random_weights(graph, rng)
    text = rng.integers(0, cfg.vocab_size, 300).tolist()
    batched = engine_for(graph, weights, ctx=512)
    stepped = engine_for(graph, weights, ctx=512, batched_prefill=False)
    assert batched.batched_prefill.plan(len(text), 0) == [256, 64]
    a, b = batched.logits_of(text), stepped.logits_of(text)
    assert a.shape == b.shape == (300, cfg.vocab_size) and batched.position == stepped.position == 300
    caches = max(rel(x, y) for x, y in zip(cache_rows(batched, 300).values(), cache_rows(stepped, 300).values()))
    print(f"logits_of 300 tokens through the ending steps: logits {rel(a, b):.2e}, caches {caches:.2e} from one-token steps")
    assert rel(a, b) < PREFILL_TOL and caches < PREFILL_TOL
    near_end = engine_for(graph, weights, ctx=320)          # 300 tokens from 0: a step of 64 would end at 320 ...
    near_end.position = 10                                  # ... but from 10 at 330: one token at a time
    assert near_end.logits_of(text).shape == a.shape and near_end.position == 310


def test_batched_prefill_of_a_second_turn_near_the_context_end():
    """A conversation's second prompt starts at a position that is no multiple of the step, and
    its steps reach the end of a 100-row cache, so part of it goes one token at a time: caches,
    logits, the seen marks of the repetition penalty and the sampler's step counter as one-token
    steps leave them."""
    from fuselm.runtime.cuda_engine import SAMPLING_ARGS
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    weights = random_weights(graph, rng)
    penal = SamplingParams(repetition_penalty=1.3)
    engines = [engine_for(graph, weights, ctx=100), engine_for(graph, weights, ctx=100, batched_prefill=False)]
    first, second = rng.integers(0, cfg.vocab_size, 40).tolist(), rng.integers(0, cfg.vocab_size, 50).tolist()
    replies = rng.integers(0, cfg.vocab_size, 5).tolist()   # fed to both, whatever each one samples
    picks = []
    for eng in engines:
        picks.append([eng.prefill(first, penal)] + [eng.decode(t, penal) for t in replies])
        assert eng.position == 45
        picks[-1].append(eng.prefill(second, penal))         # 49 to feed: 32 batched (45-76), 17 stepped
        assert eng.position == 95
    batched, stepped = engines
    a, b = cache_rows(batched, 95), cache_rows(stepped, 95)
    cache_err = max(rel(a[n], b[n]) for n in a)
    logit_err = rel(batched.logits(), stepped.logits())
    at = SAMPLING_ARGS.fields["step"][1]
    for e in engines:
        e.stream.synchronize()
    steps = [int(e.sampling_args[at:at + 4].view(np.int32).get()[0]) for e in engines]
    print(f"second turn near the context end: caches {cache_err:.2e}, logits {logit_err:.2e}; sampler steps {steps}")
    assert cache_err < PREFILL_TOL and logit_err < PREFILL_TOL
    prompts = sorted(set(first + second))
    seen = [e.seen.get() for e in engines]
    assert all(v[prompts].all() for v in seen)              # every prompt token is marked, in both
    # beyond those, each one's own picks (the same but for near-ties); replies fed to decode()
    # are the caller's, not marked by either
    assert set(np.flatnonzero(seen[0] != seen[1])) <= set(picks[0] + picks[1]) - set(prompts)
    assert steps[0] == steps[1]


def test_epilogue_bias_interleaved_rope_softcap():
    """Ops no Llama uses: bias + interleaved RoPE + GELU + soft-capping fused after GEMVs; softmax row-wise."""
    g = Graph("custom")
    ids, pos = g.input("ids", ("T",), "i32"), g.input("pos", ("T",), "i32")
    inv = g.constant("inv_freq", (1.0 / 10000 ** (np.arange(0, 32, 2) / 32)).astype(np.float32))
    x = g.op("embedding", g.weight("emb", (300, 128)), ids)
    h = g.op("rmsnorm", x, g.weight("n", (128,)), eps=1e-6)
    q = g.op("linear", h, g.weight("wq", (256, 128))) + g.weight("bq", (256,))
    q = g.op("rope", q, pos, inv, head_dim=32, interleaved=True)
    y = g.op("gelu_tanh", g.op("linear", q, g.weight("wo", (384, 256))))
    y = g.op("softcap", y, cap=3.0)
    g.output(out=g.op("softmax", g.op("scale", y, factor=2.0)))
    rng = np.random.default_rng()
    worst = compare_steps(g, random_weights(g, rng, std=0.2), rng.integers(0, 300, 12))
    print(f"custom epilogue graph: worst rel error {worst:.2e}")


def test_router_and_experts_at_mixtral_shapes():
    """The router GEMV (8 outputs: split-K) and the moe kernels at Mixtral-8x7B's sizes (D 4096,
    I 14336, 8 experts, top 2) against the float64 reference, on fresh random inputs."""
    import cupy as cp
    E, D, I = 8, 4096, 14336
    g = Graph("moe")
    x = g.input("x", ("T", D))
    logits = g.op("linear", x, g.weight("router", (E, D)))
    w1, w3, w2 = g.weight("w1", (E, I, D)), g.weight("w3", (E, I, D)), g.weight("w2", (E, D, I))
    g.output(y=g.op("moe_ffn", x, logits, w1, w3, w2, top_k=2, act="silu"), logits=logits)
    rng = np.random.default_rng()
    weights = {n.name: bf16_round(rng.standard_normal(n.shape, dtype=np.float32) * np.float32(0.02))
               for n in g.sources("weight")}
    eng = engine_for(g, weights, ctx=8)
    xs = rng.standard_normal((4, D)).astype(np.float32)
    want = run_graph(g, weights, {"x": xs}, {})
    for t in range(len(xs)):
        with eng.stream:                                   # poison, ordered before the step
            eng.arena.view(cp.float32).fill(cp.nan)
            eng.workspace.fill(cp.nan)
        eng.set_input("x", xs[t:t + 1])
        eng.step()
        for k in ("logits", "y"):
            err = rel(eng.output(k)[0], want[k][t])
            print(f"mixtral-shape {k} token {t}: rel error {err:.2e}")
            assert err < 1e-4 if k == "logits" else err < 1e-3, f"{k} token {t}: {err:.2e}"


@pytest.mark.parametrize("fuse", [True, False])
def test_random_graphs_match_reference(fuse):
    """Hypothesis-drawn DSL graphs (tests/graph_strategies.py: GEMVs with norms, biases, RoPE,
    elementwise chains, cached attention, reductions; odd sizes), one token per step on the GPU,
    against the op-by-op reference on all tokens at once."""
    import cupy as cp
    from hypothesis import HealthCheck, given, settings

    from graph_strategies import random_graphs

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=random_graphs())
    def check(case):
        weights = {k: bf16_round(v) for k, v in case.weights.items()}
        state = {k: bf16_round(v) for k, v in case.state.items()}
        want = run_graph(case.graph, weights, case.feeds, {k: v.copy() for k, v in state.items()})
        rows = max([v.shape[0] for v in state.values()] + [8])
        eng = engine_for(case.graph, weights, ctx=rows, fuse=fuse)
        for name, value in state.items():
            eng.set_state(name, value)
        got = {k: [] for k in case.graph.outputs}
        for t in range(case.tokens):
            with eng.stream:                               # poison, ordered before the step
                eng.arena.view(cp.float32).fill(cp.nan)
            for name, value in case.feeds.items():
                eng.set_input(name, value[t:t + 1])
            eng.step()
            for k in got:
                got[k].append(eng.output(k))
        for k, parts in got.items():
            g, w = np.concatenate(parts), want[k]
            if g.dtype.kind == "f":
                assert np.isfinite(g).all(), f"{k}: unwritten or non-finite"
                assert rel(g, w) < 3e-2 or np.abs(g - w).max() < 3e-2, f"{k}: {rel(g, w):.2e}"

    check()


def test_cuda_graph_matches_eager_launches():
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    w = random_weights(graph, rng)
    prompt = rng.integers(0, cfg.vocab_size, 8).tolist()
    runs = []
    for use_graph in (True, False):
        eng = engine_for(graph, w, ctx=64, use_graph=use_graph)
        tok, toks = eng.prefill(prompt, SamplingParams()), []
        for _ in range(32):
            toks.append(tok)
            tok = eng.decode(tok, SamplingParams())
        runs.append(toks)
    assert runs[0] == runs[1]


def test_gpu_sampling_respects_top_k_and_seed():
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    eng = engine_for(graph, random_weights(graph, rng, std=0.3), ctx=128)
    params = SamplingParams(temperature=1.0, top_k=5, seed=1234)
    seqs = []
    for _ in range(2):
        eng.reset()
        tok, seq = eng.prefill([1, 2, 3], params), []
        for _ in range(20):
            top5 = np.argsort(eng.logits())[-5:]
            assert tok in top5
            seq.append(tok)
            tok = eng.decode(tok, params)
        seqs.append(seq)
    assert seqs[0] == seqs[1], "the same seed must give the same tokens"
    assert len(set(seqs[0])) > 1


REAL_SHAPES = {"smollm2-135m": {}, "llama-3.2-1b": {}, "llama-3.1-8b": {},
               # the other architectures at their real layer shapes, 4 layers deep
               "mistral-7b": {"num_hidden_layers": 4}, "qwen2.5-7b": {"num_hidden_layers": 4},
               "qwen3-8b": {"num_hidden_layers": 4}, "gemma-2-9b": {"num_hidden_layers": 4},
               "mixtral-8x7b": {"num_hidden_layers": 4},
               "gpt-oss-20b": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}}


@pytest.mark.parametrize("variant", [{"head_dim": 64, "num_key_value_heads": 1},
                                     {"architectures": ["MistralForCausalLM"], "head_dim": 128, "sliding_window": 70},
                                     {"architectures": ["Gemma2ForCausalLM"], **ARCH_TINY["Gemma2ForCausalLM"],
                                      "head_dim": 256, "sliding_window": 70}])
def test_long_context_spans_attention_chunks(variant):
    """A conversation long enough for both attention variants to cover several passes, by each of
    them: one launch walking every position, and split + combine over two or more chunks (the
    sizes depend on the head layout), and as the engine picks them by position (switching
    mid-run); windows start mid-chunk."""
    from fuselm.codegen import Target, Tuning
    from fuselm.codegen.attention import Layout
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**TINY, **variant})
    layout = Layout(cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, Target.of_device(), Tuning())
    steps = max(150, max(2 * layout.split_pass.chunk, layout.single_until) + 22)
    graph = build_graph(cfg)
    weights, tokens = random_weights(graph, rng), rng.integers(0, cfg.vocab_size, steps)
    runs = {}
    # Against the reference, runs of hundreds of steps are bounded by the bf16 KV cache: a row
    # whose bf16 rounding flips (float32 sums in another order) stays in the cache, and the flips
    # add up (one 534-step draw: 5.3e-3, others 5e-4 to 1e-3). Gemma-2's attention is sharper
    # (scores scaled by 24^-0.5 at head size 256, not 256^-0.5), so one flip weighs more, at any
    # step: 12 draws of its 150 steps on the H200 reached 1.3e-3 to 5.8e-3 (at steps 4 to 143),
    # and one 8.6e-3.
    sharp = variant.get("query_pre_attn_scalar", cfg.head_dim) < cfg.head_dim
    tol = 1e-2 if steps > 300 or sharp else 5e-3
    for attention in ("single", "general", None):
        runs[attention] = []
        worst = compare_steps(graph, weights, tokens, ctx=steps + 42, variant=attention, tol=tol,
                              logits=runs[attention])
        line = f"long context {variant.get('architectures', ['Llama'])[0]}, {steps} steps, attention {attention}: " \
               f"worst rel logit error {worst:.2e}"
        if attention != "single":   # the variants run the same GEMVs on the same inputs: closer
            # Closer, but not by much everywhere: their sums differ in order, so cache rows round
            # apart as they do against the reference (a Gemma-2 draw on the H200: 1.01e-3 apart,
            # 7.9e-4 from the reference). Half the reference tolerance still catches a variant
            # that is off without failing compare_steps.
            apart = max(rel(a, b) for a, b in zip(runs[attention], runs["single"]))
            line += f", {apart:.2e} from the one-launch run"
            assert apart < tol / 2, f"attention {attention} departs from the one-launch variant by {apart:.2e}"
        print(line)


def test_the_wide_split_matches_the_split_at_real_shapes():
    """One decode step of Llama-3.2-1B (4 layers) at position 4100 over caches of random bf16 rows:
    by position the engine runs the wide split there (chunks of 288); forced "general", the split
    (chunks of 256). Same GEMVs, the same rows, other chunk boundaries: the logits agree to the
    float32 sums' order. Arena and workspace poisoned."""
    import cupy as cp

    from fuselm.codegen import Tuning
    from fuselm.runtime.cuda_engine import CudaEngine
    from fuselm.runtime.random_weights import random_gpu_weights
    assert Tuning().attn_wide_warps, "the wide split is on by default"
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**PRESETS["llama-3.2-1b"], "num_hidden_layers": 4})
    graph = build_graph(cfg)
    weights = random_gpu_weights(graph, seed=int(rng.integers(1 << 30)))
    rows, at = 4608, 4100
    state = {n.name: bf16_round(rng.standard_normal((at, n.shape[-1])).astype(np.float32))
             for n in graph.sources("state")}
    token = int(rng.integers(cfg.vocab_size))
    logits = {}
    for variant, suffix in ((None, "_split_wide"), ("general", "_split")):
        eng = CudaEngine(graph, weights, ctx=rows, variant=variant)
        launched = [launch.function for _, launch, _ in eng.schedule_at(at)]
        assert sum(f.endswith(suffix) for f in launched) == 4, launched
        for n, value in state.items():
            eng.set_state(n, value)
        eng.set_input("ids", [token])
        eng.set_input("pos", [at])
        with eng.stream:                                   # poison, ordered before the step
            eng.arena.view(cp.float32).fill(cp.nan)
            eng.workspace.fill(cp.nan)
        eng.step()
        logits[variant] = eng.output("logits")
        assert np.isfinite(logits[variant]).all(), f"{variant}: unwritten or non-finite logits"
        del eng
    err = rel(logits[None], logits["general"])
    print(f"llama-3.2-1b (4 layers) at {at}: wide split vs split, rel logit difference {err:.2e}")
    assert err < 1e-4, f"wide split vs split: relative logit difference {err:.2e}"


def attention_graph(heads: int, kv_heads: int, head_dim: int, window: int, softcap: float,
                    sinks: bool = False) -> Graph:
    """One attention node over caches "kc" and "vc" (states) that its inputs k and v are written
    into at "pos"; queries "q"; output "out"; with `sinks`, the weight "sinks" [H] (gpt-oss)."""
    g = Graph("attention")
    pos = g.input("pos", ("T",), "i32")
    q, k, v = (g.input(n, ("T", h * head_dim)) for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
    kc = g.op("kv_write", g.state("kc", ("S", kv_heads * head_dim)), k, pos)
    vc = g.op("kv_write", g.state("vc", ("S", kv_heads * head_dim)), v, pos)
    extra = [g.weight("sinks", (heads,))] if sinks else []
    g.output(out=g.op("attention", q, kc, vc, pos, *extra, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                      scale=head_dim ** -0.5, window=window, softcap=softcap))
    return g


def sink_logits(heads: int, rng) -> dict:
    """Sink logits about as large as the scores (random unit rows), bf16-representable."""
    return {"sinks": bf16_round((1.5 * rng.standard_normal(heads)).astype(np.float32))}


@pytest.mark.parametrize("heads,kv_heads,head_dim,window,softcap,cuda_cores,sinks", [
    *((*case, False) for case in [
        (32, 8, 128, 0, 0.0, False), (9, 3, 64, 0, 0.0, False), (28, 4, 128, 0, 0.0, False),
        (32, 4, 64, 1000, 0.0, False), (32, 8, 64, 0, 2.0, False), (32, 8, 128, 0, 0.0, True),
        (9, 3, 64, 1000, 0.0, True), (48, 4, 64, 0, 0.0, False), (16, 8, 256, 1000, 50.0, False),
        (4, 2, 6, 0, 0.0, False)]),
    (64, 8, 64, 128, 0.0, False, True), (64, 8, 64, 0, 0.0, True, True)])   # gpt-oss's heads, with sinks
def test_attention_at_long_context(heads, kv_heads, head_dim, window, softcap, cuda_cores, sinks, monkeypatch):
    """One step at position 3001 of caches filled with random bf16 rows, by both attention
    variants: one block per KV head walking every position, and dozens of chunks merged by the
    combine kernel (a thousand-row window: starting mid-chunk); against the float64 reference.
    Head sizes 64 and 128 with up to 8 query heads per KV head run on tensor cores (MmaPass), the
    others on CUDA cores (LanePass), as do two of the former with MmaPass taken away (mma_fits
    patched to refuse); a soft cap of 2 bends most scores (random rows, unit queries)."""
    import cupy as cp

    from fuselm.codegen import Target, Tuning, attention
    from fuselm.runtime.cuda_engine import CudaEngine
    if cuda_cores:
        monkeypatch.setattr(attention, "mma_fits", lambda head_dim, group, target: False)
    target = Target.of_device()
    mma = not cuda_cores and attention.mma_fits(head_dim, heads // kv_heads, target)
    rng = np.random.default_rng()
    rows, at = 3072, 3001   # row `at` of the head-size-6 caches starts mid-sector
    g = attention_graph(heads, kv_heads, head_dim, window, softcap, sinks)
    weights = sink_logits(heads, rng) if sinks else {}
    state = {n: bf16_round(rng.standard_normal((rows, kv_heads * head_dim)).astype(np.float32)) for n in ("kc", "vc")}
    feeds = {"pos": np.array([at], np.int32), **{n: bf16_round(rng.standard_normal((1, w)).astype(np.float32))
                                                 for n, w in (("q", heads * head_dim), ("k", kv_heads * head_dim),
                                                              ("v", kv_heads * head_dim))}}
    ref = run_graph(g, weights, feeds, {n: x.astype(np.float64) for n, x in state.items()})["out"]
    # the wide split where it covers this position (with 12 warps the (32, 8, 128) layout covers 3001;
    # at the default 9 none does: test_the_wide_split_matches_the_split_at_real_shapes covers it)
    wide = attention.Layout(kv_heads, head_dim, heads // kv_heads, target, Tuning()).wide_split()
    for variant in ("single", "general", *(["wide"] if wide and wide.start <= at < wide.until else [])):
        eng = CudaEngine(g, weights, ctx=rows, variant=variant)
        launched = [launch.function for _, launch, _ in eng.schedule_at(at)]
        suffix = {"general": "_split", "wide": "_split_wide"}.get(variant, f"_{variant}")
        assert any(f.endswith(suffix) for f in launched), launched
        (source,) = [k.source for k in eng.kernels if k.family == "attention"]
        assert ("MmaPass<" in source, "LanePass<" in source) == (mma, not mma), "the pass the test means to run"
        for name, rows_ in state.items():
            eng.set_state(name, rows_)
        for name, value in feeds.items():
            eng.set_input(name, value)
        with eng.stream:                                   # poison, ordered before the step
            eng.arena.view(cp.float32).fill(cp.nan)
            eng.workspace.fill(cp.nan)
        eng.step()
        got = eng.output("out")
        assert np.isfinite(got).all(), f"{variant}: unwritten or non-finite attention output"
        err = rel(got, ref)
        print(f"attention h{heads} kv{kv_heads} d{head_dim} window {window} softcap {softcap} sinks {sinks} at {at}, {variant}, "
              f"{'tensor' if mma else 'CUDA'} cores: rel error {err:.2e}")
        assert err < 2e-5, f"{variant}: relative error {err:.2e}"   # measured: <= 3e-6 (tensor), 3e-7 (CUDA cores)


@pytest.mark.parametrize("heads,kv_heads,head_dim,window,softcap,sinks", [
    (32, 8, 128, 0, 0.0, False), (32, 8, 64, 0, 2.0, False), (28, 4, 128, 0, 0.0, False), (9, 3, 64, 1000, 0.0, False),
    (8, 2, 64, 37, 50.0, False), (64, 8, 64, 128, 0.0, True)])   # the last: gpt-oss's heads, window and sinks
@pytest.mark.parametrize("warps", [4, 8])
def test_flash_prefill_kernel_matches_float64(heads, kv_heads, head_dim, window, softcap, sinks, warps):
    """The flash prefill kernel alone (blocks of 4 or 8 warps: flash_warps), launched on a
    256-token step at positions 2900 .. 3155 of caches of random bf16 rows (the step's own rows
    among them), its output poisoned with NaN: against the float64 reference. Covers idle query
    rows (7 and 3 heads per KV head leave 1 of 64), windows starting mid-tile, and soft-capping
    (2 bends most scores)."""
    import cupy as cp

    from fuselm.codegen import Target, Tuning, generate, headers, module_source
    from fuselm.codegen.nvrtc import compile_cubin, options
    from fuselm.compiler import compile_graph
    from fuselm.runtime.launch import load_cubin
    rng = np.random.default_rng()
    rows, start, T = 3584, 2900, 256
    g = attention_graph(heads, kv_heads, head_dim, window, softcap, sinks)
    weights = sink_logits(heads, rng) if sinks else {}
    G = compile_graph(g, tokens=T)
    (flash,) = [k for k in generate(G, ctx=rows, target=Target.of_device(), tokens=T, tuning=Tuning(flash_warps=warps))
                if k.family == "attention"]
    assert "flash_prefill<" in flash.source, "the kernel the test means to run"
    (launch,) = flash.launches
    cubin, _, _ = compile_cubin(module_source([flash]), headers(), options(Target.of_device().arch))
    fn = load_cubin(cp, cubin).get_function(launch.function)
    fn.max_dynamic_shared_size_bytes = launch.smem
    caches = {n: bf16_round(rng.standard_normal((rows, kv_heads * head_dim)).astype(np.float32)) for n in ("kc", "vc")}
    queries = bf16_round(rng.standard_normal((T, heads * head_dim)).astype(np.float32))
    positions = np.arange(start, start + T, dtype=np.int32)
    ref = run_graph(g, weights, {"pos": positions, "q": queries, "k": caches["kc"][positions], "v": caches["vc"][positions]},
                    {n: x.astype(np.float64) for n, x in caches.items()})["out"]
    bits = {n: cp.asarray((x.view(np.uint32) >> 16).astype(np.uint16)) for n, x in caches.items()}
    out = cp.full((T, heads * head_dim), cp.nan, cp.float32)
    by_value = {"q": cp.asarray(queries), "pos": cp.asarray(positions), **bits,   # the caches by state name
                **{n: cp.asarray((w.view(np.uint32) >> 16).astype(np.uint16)) for n, w in weights.items()}}
    args = [by_value.get(a, out) for a in launch.args]
    assert sum(a is out for a in args) == 1, launch.args
    fn(launch.grid, (launch.block,), tuple(args), shared_mem=launch.smem)
    got = cp.asnumpy(out)
    assert np.isfinite(got).all(), "unwritten or non-finite attention output"
    err = rel(got, ref)
    print(f"flash prefill h{heads} kv{kv_heads} d{head_dim} window {window} softcap {softcap} sinks {sinks}, {T} tokens from {start}: "
          f"rel error {err:.2e}")
    assert err < 1e-2, f"relative error {err:.2e}"   # bf16 queries and probabilities: a few 2^-9


def test_gpu_sampling_filters_and_penalty_match_the_cpu_sampler():
    """Every GPU draw with top-k + top-p + min-p lies in the set the CPU sampler keeps; greedy with
    a repetition penalty after a prompt picks what the CPU sampler picks from the same logits."""
    from fuselm.runtime.sampling import Sampler, filtered_probs
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    eng = engine_for(graph, random_weights(graph, rng, std=0.3), ctx=128)
    prompt = rng.integers(0, cfg.vocab_size, 12).tolist()
    penal = SamplingParams(repetition_penalty=1.8)
    tok = eng.prefill(prompt, penal)
    assert tok == Sampler(penal)(eng.logits(), history=prompt)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.6, min_p=0.05, seed=7)
    eng.reset()
    tok = eng.prefill(prompt, params)
    for _ in range(30):
        kept = np.flatnonzero(filtered_probs(eng.logits(), top_k=20, top_p=0.6, min_p=0.05) > 0)
        assert tok in kept
        tok = eng.decode(tok, params)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3)])
def test_gpu_non_finite_logits_stop_generation(bad, sampling):
    """One NaN or inf logit (an lm_head row poisoned) makes prefill and decode raise
    NonFiniteLogits naming the position, greedy or sampled; with finite weights the same engine
    generates again after a reset."""
    from fuselm.runtime.engine import NonFiniteLogits
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    weights = random_weights(graph, rng)
    row = int(rng.integers(cfg.vocab_size))
    weights["lm_head.weight"][row] = bad
    eng = engine_for(graph, weights, ctx=64)
    prompt = rng.integers(0, cfg.vocab_size, 9).tolist()
    with pytest.raises(NonFiniteLogits) as err:
        eng.prefill(prompt, sampling)
    assert err.value.position == len(prompt) - 1
    eng.reset()
    eng.weights["lm_head.weight"][row] = 0          # finite again: generation goes on
    tok = eng.prefill(prompt, sampling)
    for _ in range(3):
        tok = eng.decode(tok, sampling)
    assert 0 <= tok < cfg.vocab_size and eng.position == len(prompt) + 3
    eng.weights["lm_head.weight"][row] = 0x7FC0      # a bf16 NaN, mid-generation
    with pytest.raises(NonFiniteLogits) as err:
        eng.decode(tok, sampling)
    assert err.value.position == len(prompt) + 3


@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_real_shapes_match_transformers(name):
    """Random weights of real shapes, shared with transformers on the GPU through DLPack.

    transformers in bf16 makes the greedy tokens; the same weights upcast to float32 in
    transformers give the reference logits. Our logits (bf16 weights and KV cache, float32
    activations) must be as close to that reference as transformers' own bf16 run is, and our
    greedy token must agree wherever the reference's top-2 margin is clear of our error."""
    import cupy as cp
    import torch
    import transformers
    spec = {**PRESETS[name], **REAL_SHAPES[name]}
    arch = spec["architectures"][0]
    conf = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        **{k: v for k, v in spec.items() if k != "architectures"}, attn_implementation="eager")
    conf._experts_implementation = "eager"
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    with torch.device("cuda"):
        hf = getattr(transformers, arch)(conf).to(torch.bfloat16).eval()
    cfg = DecoderConfig.from_hf(spec)
    graph = build_graph(cfg)
    sd = hf.state_dict()
    if arch == "MixtralForCausalLM":
        # Random routers put the 2nd and 3rd expert close enough that bf16 noise flips choices
        # (test_router_and_experts_at_mixtral_shapes checks the routing itself): widen the margins.
        routers = [v for k, v in sd.items() if k.endswith("mlp.gate.weight")]
        assert len(routers) == cfg.num_layers, "transformers renamed Mixtral's router"
        with torch.no_grad():
            for v in routers:
                v.mul_(8)
        sd = mixtral_checkpoint_names(sd, cfg.intermediate_size)
    if arch == "GptOssForCausalLM":   # the same for its routers (a bias too: it stays)
        with torch.no_grad():
            for k, v in sd.items():
                if k.endswith("mlp.router.weight"):
                    v.mul_(8)
    raw = {k: cp.from_dlpack(v.contiguous().view(torch.int16)).view(cp.uint16) for k, v in sd.items()}
    views = checkpoint_views(cfg, set(raw))   # gpt-oss's experts: interleaved, transposed stacks
    weights = {n.name: raw[n.name] if n.name in raw else
               cp.ascontiguousarray(views[n.name].take(*(raw[src] for src in views[n.name].sources)))
               for n in graph.sources("weight")}
    eng = engine_for(graph, weights, ctx=128)
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        gen = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        seq = gen.sequences
        with torch.device("cuda"):
            hf32 = getattr(transformers, arch)(conf).float().eval()
        upcast = hf.state_dict()   # copied a tensor at a time: a float32 copy of all would not fit an 80 GB card
        for k, v in hf32.state_dict().items():
            if k in upcast:
                v.copy_(upcast[k])
        ref_all = hf32(seq[:, :-1]).logits[0, 15:].float().cpu().numpy()     # [32, vocab]
        del hf32
    hf_tokens = seq[0, 16:].tolist()
    first = eng.prefill(prompt[0].tolist(), SamplingParams())
    ours_err, hf_err, agree, clear = [], [], 0, 0
    for i in range(32):
        ref = ref_all[i]
        ours = eng.logits()
        ours_err.append(rel(ours, ref))
        hf_err.append(rel(gen.scores[i][0].float().cpu().numpy(), ref))
        top2 = np.sort(ref)[-2:]
        if top2[1] - top2[0] > 2 * np.abs(ours - ref).max():
            clear += 1
            agree += int(np.argmax(ours) == np.argmax(ref))
        if i < 31:
            eng.decode(hf_tokens[i], SamplingParams())
    print(f"{name}: rel logit error vs float32 transformers: ours median {np.median(ours_err):.2e} max "
          f"{max(ours_err):.2e}, transformers bf16 median {np.median(hf_err):.2e} max {max(hf_err):.2e}; "
          f"greedy agreement {agree}/{clear} clear-margin steps; first token ours {first} hf {hf_tokens[0]}")
    assert max(ours_err) < max(2e-2, 1.5 * max(hf_err))
    assert agree == clear
    del hf, eng, weights
    torch.cuda.empty_cache()


# ---- the CUDA engine's user-facing errors: one line naming the problem, and nothing lost -------------

def test_a_missing_or_misshapen_weight_is_named():
    """CudaEngine checks each of the graph's weights before compiling (check_weights): one the
    mapping lacks (or maps to None) is a one-line error naming it; one of another shape, host
    array or device bits, names it and both shapes."""
    import cupy as cp

    from fuselm.runtime.cuda_engine import to_bf16_bits
    rng = np.random.default_rng()
    graph = build_graph(DecoderConfig.from_hf(TINY))
    weights = random_weights(graph, rng)
    nodes = list(graph.sources("weight"))
    missing = nodes[len(nodes) // 2].name
    for given in ({k: v for k, v in weights.items() if k != missing}, {**weights, missing: None}):
        with pytest.raises(FuselmError, match=f"^missing weight '{re.escape(missing)}'$"):
            engine_for(graph, given, batched_prefill=False)
    bad = next(n for n in reversed(nodes) if len(n.shape) == 2 and n.shape[0] != n.shape[1])
    for wrong in (weights[bad.name].T, weights[bad.name][:-1], cp.asarray(to_bf16_bits(weights[bad.name].T))):
        message = f"weight '{bad.name}' has shape {tuple(wrong.shape)}, expected {bad.shape}"
        with pytest.raises(FuselmError, match=f"^{re.escape(message)}$"):
            engine_for(graph, {**weights, bad.name: wrong}, batched_prefill=False)


def test_an_unknown_variant_is_refused_by_the_engine():
    """CudaEngine(variant=...) goes through check_variant: a name no kernel has is a one-line
    error listing the ones there are (a Llama's attention: "single"; "general" always)."""
    rng = np.random.default_rng()
    graph = build_graph(DecoderConfig.from_hf(TINY))
    with pytest.raises(FuselmError, match=r"^variant 'singel': no kernel of this graph has it \(known: general, single\)$"):
        engine_for(graph, random_weights(graph, rng), variant="singel")


def sampler_step(eng) -> int:
    """The sampler's step counter on the device (SamplingArgs.step)."""
    from fuselm.runtime.cuda_engine import SAMPLING_ARGS
    at = SAMPLING_ARGS.fields["step"][1]
    eng.stream.synchronize()
    return int(eng.sampling_args[at:at + 4].view(np.int32).get()[0])


def test_a_prompt_past_the_context_or_an_empty_one_is_refused_and_changes_nothing():
    """CudaEngine.prefill refuses a prompt that does not fit the rows left (on the first turn and
    on a later one) and an empty prompt, and SamplingParams.validate refuses bad sampling
    settings (a ValueError: generate() and the API turn it into a FuselmError), all before
    anything moves: the next prompt gives the tokens, logits, seen marks, position and sampler
    step that it gives without the refused calls."""
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    eng = engine_for(graph, random_weights(graph, rng, std=0.3), ctx=64)
    penal = SamplingParams(repetition_penalty=1.3)          # the seen marks matter to the picks
    first, second, long_ = (rng.integers(0, cfg.vocab_size, n).tolist() for n in (40, 20, 30))
    with pytest.raises(FuselmError, match="^prompt of 65 tokens at position 0 does not fit the context of 64$"):
        eng.prefill(rng.integers(0, cfg.vocab_size, 65).tolist(), penal)
    assert eng.position == 0
    picks = [eng.prefill(first, penal)]
    assert eng.position == 40
    # 40 + 30 rows of 64: the message names the prompt's length, where it starts and the context
    with pytest.raises(FuselmError, match="^prompt of 30 tokens at position 40 does not fit the context of 64$"):
        eng.prefill(long_, penal)
    with pytest.raises(FuselmError, match="^empty prompt: nothing to feed$"):
        eng.prefill([], penal)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0.0$"):
        eng.prefill(second, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="^repetition_penalty must be > 0, got 0.0$"):
        eng.decode(second[0], SamplingParams(repetition_penalty=0.0))
    assert eng.position == 40
    picks.append(eng.prefill(second, penal))
    got = (picks, eng.logits(), eng.seen.get(), eng.position, sampler_step(eng))
    eng.reset()                                             # the same turns, nothing refused
    want = ([eng.prefill(first, penal), eng.prefill(second, penal)], eng.logits(), eng.seen.get(),
            eng.position, sampler_step(eng))
    print(f"refused prompts: picks {got[0]} and {want[0]} without them, position {got[3]}, sampler step {got[4]}")
    assert got[0] == want[0], "the refused calls changed the picks"
    assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32)), "the refused calls changed the logits"
    assert np.array_equal(got[2], want[2]), "the refused calls changed the seen marks"
    assert got[3:] == want[3:] == (60, 60), "the refused calls moved the position or the sampler's step"


def test_decoding_past_the_context_is_refused_and_changes_nothing():
    """CudaEngine.decode at a full cache (feed: position == ctx) is a one-line error naming the
    context, as is a prompt of one token then; the last step's logits and the position stay, and
    after reset() the same conversation gives the same tokens."""
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    eng = engine_for(graph, random_weights(graph, rng, std=0.3), ctx=64)
    prompt = rng.integers(0, cfg.vocab_size, 60).tolist()
    runs = []
    for _ in range(2):
        eng.reset()
        toks = [eng.prefill(prompt, SamplingParams())]
        for _ in range(4):                                 # positions 60 .. 63: the last rows
            toks.append(eng.decode(toks[-1], SamplingParams()))
        assert eng.position == 64
        runs.append(toks)
        last = eng.logits()
        with pytest.raises(FuselmError, match="^the conversation reached the context of 64 tokens$"):
            eng.decode(toks[-1], SamplingParams())
        with pytest.raises(FuselmError, match="^prompt of 1 token at position 64 does not fit the context of 64$"):
            eng.prefill([toks[-1]], SamplingParams())
        assert eng.position == 64
        assert np.array_equal(eng.logits().view(np.uint32), last.view(np.uint32)), "a refused step ran"
    assert runs[0] == runs[1], runs


def test_a_prefill_that_its_steps_cannot_take_is_refused_before_any_step():
    """Prefill.run (the engine calls it only with what its plan takes) refuses tokens that its
    steps cannot put in the rows left, naming the context and the step sizes, before it queues
    a step: the caches stay as they were, and the engine's own prefill of as many tokens (steps
    as far as they go, the rest one at a time) fills the context."""
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf(TINY)
    graph = build_graph(cfg)
    eng = engine_for(graph, random_weights(graph, rng), ctx=100)
    assert eng.batched_prefill is not None, eng.prefill_refused
    sizes = " or ".join(map(str, eng.batched_prefill.sizes))
    prompt = rng.integers(0, cfg.vocab_size, 100).tolist()  # steps are multiples of 8: at most 96 of 100 rows
    with pytest.raises(FuselmError, match=f"^prefill of 100 tokens from position 0 does not fit the context "
                                          f"of 100 in steps of {re.escape(sizes)}$"):
        eng.batched_prefill.run(prompt, 0)
    assert all(not b.any() for b in cache_bits(eng).values()), "a refused prefill wrote cache rows"
    eng.prefill(prompt, SamplingParams())
    assert eng.position == 100
    assert all(bf16_finite(b) and b.any(axis=1).all() for b in cache_bits(eng).values())

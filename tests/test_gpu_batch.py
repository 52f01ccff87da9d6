"""GPU checks of continuous batching (runtime/cuda_batch.py, codegen's paged kernels): steps that
mix prompt chunks and decode tokens of several sequences, whose rows lie on shuffled pool pages,
give each sequence the cache rows and logits the numpy reference gives it alone (bf16 KV cache
on both sides, or fp8 pools against the reference's exact fp8 cache; the gemms take bf16 vectors, as the prefill's: PREFILL_TOL over a sequence's
rows, twice that for a single row's spike). Fresh random weights each run; the batch engine's
arena and its pool poisoned with NaN first, so a row read before it is written, or a logits row
left unwritten, shows."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fuselm.dsl.ops import page_rows
from fuselm.models import DecoderConfig, build_graph
from fuselm.runtime.batch import Chunk
from fuselm.runtime.cuda_engine import gpu_available
from fuselm.runtime.reference import new_state, run_graph

sys.path.insert(0, str(Path(__file__).parent))
from test_batch import feed_in_steps  # noqa: E402
from test_gpu import (ARCH_TINY, MOE_PREFILL_TOL, PREFILL_TOL, ROUTERS, ROUTING_MARGIN, TINY,  # noqa: E402
                      bf16_kv_cache, engine_for, is_moe, random_weights, rel, routing_margins)

# With fp8 pages a token's K and V differ from the reference's by up to an e4m3 step wherever the
# GPU's bf16 values round to another code: the caches sit 4-5e-2 from the reference (against
# ~1e-2 with bf16 pages), and by ROUTING_MARGIN's simulation (a router-input error of 2e-2 moved a
# row's lead by up to 8e-2 of its largest logit) leads move up to ~2e-1. On an H100 one gpt-oss
# row past ROUTING_MARGIN came out 0.8 off, the size of another expert taken.
FP8_ROUTING_MARGIN = 2.5e-1

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU on this machine")]

CTX = 200
CONFIGS = {   # the paged pass on CUDA cores (head 32) and on tensor cores (head 128), windows, soft-caps, experts
    "llama head 32": {},
    "llama head 128": dict(hidden_size=1024, num_attention_heads=8),
    "mistral window 8": {"architectures": ["MistralForCausalLM"], **ARCH_TINY["MistralForCausalLM"]},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], **ARCH_TINY["Gemma2ForCausalLM"]},
    "mixtral": {"architectures": ["MixtralForCausalLM"], **ARCH_TINY["MixtralForCausalLM"]},
    "gpt-oss": {"architectures": ["GptOssForCausalLM"], **ARCH_TINY["GptOssForCausalLM"]},
}
# tokens per step and sequence: a full 64-token step, mixed chunks, single tokens (steps of 32 mostly
# padding), then one sequence's token alone (the one-token step: decode GEMVs, paged split attention)
PLAN = [[40, 9, 15], [20, 1, 30], [10, 1, 40], [1, 1, 1], [1, 0, 33], [30, 1, 1], [1, 1, 1],
        [0, 0, 1], [1, 0, 0], [0, 1, 0]]


# fp8 pools: the paged pass on CUDA cores and on tensor cores, and gpt-oss (windows, sinks, experts);
# test_gpu_kv's bounds for the prefill's fp8 caches (code flips compound through the layers)
FP8_CONFIGS = ["llama head 32", "llama head 128", "gpt-oss"]
E4M3_NAN, BF16_NAN = 0x7F, 0x7FC0


@pytest.mark.parametrize("name,kv", [(n, "bf16") for n in CONFIGS] + [(n, "fp8") for n in FP8_CONFIGS],
                         ids=[n for n in CONFIGS] + [f"{n} fp8" for n in FP8_CONFIGS])
def test_mixed_batch_steps_on_shuffled_pages_match_each_sequence_alone(name, kv):
    import cupy as cp

    from fuselm.codegen.build import batch_page
    from fuselm.dsl.kv_dtype import with_kv_dtype
    from fuselm.runtime.cuda_batch import CudaBatchEngine
    from fuselm.runtime.cuda_engine import rows_as_float
    from fuselm.codegen.kv_cache import layout_of
    from test_gpu_kv import FP8_PREFILL_CACHE_TOL, FP8_PREFILL_LOGIT_TOL
    rng = np.random.default_rng()
    cfg = DecoderConfig.from_hf({**TINY, "max_position_embeddings": 256, **CONFIGS[name]})
    graph = build_graph(cfg)
    weights = random_weights(graph, rng)
    for w in weights:   # routers' logits spread out (more than the prefill tests': 19 rows of 3 sequences
        if w.endswith(ROUTERS):   # are compared, where a flipped expert moved a row by 0.4)
            weights[w] = weights[w] * 32
    engine = engine_for(graph, weights, ctx=CTX, batched_prefill=False, kv=kv)
    program = engine.program
    per_seq = -(-CTX // batch_page(graph, program.target, program.tuning))
    batch = CudaBatchEngine(engine, pages=3 * per_seq + 2, sizes=(64, 32, 1))
    order = rng.permutation(batch.pages)[:3 * per_seq].reshape(3, per_seq).tolist()   # shuffled pages
    with engine.stream:
        batch.arena.view(cp.float32).fill(cp.nan)
        for c in batch.states.values():
            c.fill(E4M3_NAN if kv == "fp8" else BF16_NAN)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (104, 16, 123)]   # the last steps feed each
    got, fed = feed_in_steps(batch, seqs, order, PLAN)
    tol = MOE_PREFILL_TOL if is_moe(cfg) else PREFILL_TOL
    cache_tol = tol
    if kv == "fp8":
        tol, cache_tol = FP8_PREFILL_LOGIT_TOL, FP8_PREFILL_CACHE_TOL
    worst, worst_row, worst_cache = 0.0, 0.0, 0.0
    G = batch.steps[0].G
    pool = {n: rows_as_float(layout_of(G, n), cp.asnumpy(c)) for n, c in batch.states.items()}
    ref_graph = with_kv_dtype(graph, kv)
    near_ties = 0
    for i, ids in enumerate(seqs):
        state, trace = new_state(graph, CTX), {}
        feeds = {"ids": np.array(ids[:fed[i]], np.int32), "pos": np.arange(fed[i], dtype=np.int32)}
        if kv == "fp8":     # the reference models the fp8 cache exactly
            want = run_graph(ref_graph, weights, feeds, state, trace)["logits"]
        else:
            with bf16_kv_cache():
                want = run_graph(graph, weights, feeds, state, trace)["logits"]
        # rows whose routing is a near tie in the reference may take another expert: not compared
        clear = routing_margins(graph, trace) >= (FP8_ROUTING_MARGIN if kv == "fp8" else ROUTING_MARGIN)
        near_ties += sum(not clear[position] for position, _ in got[i])
        got[i] = [(position, row) for position, row in got[i] if clear[position]]
        rows = page_rows(order[i], np.arange(fed[i]), batch.page)
        cache_err = max(rel(pool[c][rows], np.asarray(state[c][:fed[i]], np.float32)) for c in pool)
        assert cache_err < cache_tol, f"{name} {kv}: sequence {i}: its pool rows {cache_err:.2e} from the reference's cache"
        if not got[i]:
            continue
        rows_got = np.stack([row for _, row in got[i]])
        assert np.isfinite(rows_got).all(), f"{name}: sequence {i}: non-finite logits"
        errs = [rel(row, want[position]) for position, row in got[i]]
        err = rel(rows_got, want[[position for position, _ in got[i]]])
        assert err < tol and max(errs) < 2 * tol, f"{name}: sequence {i}: rel error {err:.2e}, rows {errs}"
        worst, worst_row, worst_cache = max(worst, err), max(worst_row, *errs), max(worst_cache, cache_err)
    compared = sum(map(len, got))
    assert compared >= near_ties, f"{name}: {near_ties} of {compared + near_ties} rows route on near ties"
    print(f"batch steps {name} {kv} (pages of {batch.page} rows): caches {worst_cache:.2e} from the reference; "
          f"logits {worst:.2e} over a sequence's rows, {worst_row:.2e} at worst in one of {compared} rows "
          f"({near_ties} on near ties of the routing set aside)")


def test_a_batch_step_refuses_a_page_outside_the_pool_and_too_many_tokens():
    from fuselm.errors import FuselmError
    from fuselm.runtime.cuda_batch import CudaBatchEngine
    rng = np.random.default_rng()
    graph = build_graph(DecoderConfig.from_hf(TINY))
    engine = engine_for(graph, random_weights(graph, rng), ctx=CTX, batched_prefill=False)
    batch = CudaBatchEngine(engine, pages=8, sizes=(32,))
    with pytest.raises(FuselmError, match="outside the pool of 8"):
        batch.step([Chunk([1, 2], 0, [8, 0, 1, 2])])
    with pytest.raises(FuselmError, match="larger than the largest, 32"):
        batch.step([Chunk(list(range(33)), 0, [0, 1, 2, 3])])
    with pytest.raises(FuselmError, match="cannot hold one sequence"):
        CudaBatchEngine(engine, pages=1, sizes=(32,))


def test_steps_fed_the_picks_of_the_step_before_on_the_gpu_equal_steps_fed_them_by_hand():
    """launch(chunks, picks), as the server queues greedy steps ahead: one-token chunks take the
    step before's argmax rows on the GPU, queued before that step is done, twice in a row (so the
    two pinned input buffers take turns), and give the logits of the same steps fed by hand."""
    from fuselm.runtime.cuda_batch import CudaBatchEngine
    rng = np.random.default_rng()
    graph = build_graph(DecoderConfig.from_hf(TINY))
    engine = engine_for(graph, random_weights(graph, rng), ctx=CTX, batched_prefill=False)
    prompts = [rng.integers(0, 256, n).tolist() for n in (7, 12, 3)]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    first = [Chunk(p, 0, t) for p, t in zip(prompts, tables)]
    by_hand, ahead = CudaBatchEngine(engine, pages=10, sizes=(32,)), CudaBatchEngine(engine, pages=10, sizes=(32,))
    want, ids = [], np.array(by_hand.launch(first).result().picks())
    for k in range(3):   # each step: the three sequences' next tokens
        rows = by_hand.launch([Chunk([int(ids[i])], len(p) + k, t) for i, (p, t) in enumerate(zip(prompts, tables))])
        logits = rows.result()
        want.append(logits.rows.get())
        ids = logits.picks()
    before = ahead.launch(first)
    queued = []
    for k in range(3):
        before = ahead.launch([Chunk([0], len(p) + k, t) for p, t in zip(prompts, tables)],
                              (before, [(0, 0), (1, 1), (2, 2)]))
        queued.append(before)
    got = [q.result().rows.get() for q in queued]
    for k in range(3):
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"step {k}")


@pytest.mark.parametrize("vocab,copies", [(32000, 1), (128256, 3)])
def test_rows_sampled_on_the_gpu_pick_what_the_host_picks(vocab, copies):
    """runtime/sampling.sample_rows on CuPy rows (how a batch step picks: the row-picks kernel,
    radix selects instead of a sort) against the same on numpy with the same draws: every pick
    lies in the set the filters keep, the picks agree but where float64 sums in another order
    move a draw across a boundary (rare), and a second run on the GPU picks the same ids. Half
    the rows are rounded (ties, which the cuts must break by id as numpy's stable sort), some
    rows have a grammar's mask."""
    import cupy
    from fuselm.runtime.engine import SamplingParams
    from fuselm.runtime.sampling import Sampler, filtered_probs, sample_rows
    rng = np.random.default_rng()
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, seed=int(rng.integers(1 << 30)))
              for _ in range(copies) for t in (0.0, 0.7, 1.3) for k in (0, 40) for p in (1.0, 0.9) for mp in (0.0, 0.05)]
    rows = (rng.standard_normal((len(params), vocab)) * 3).astype(np.float32)
    rows[::2] = np.round(rows[::2])
    allowed = [rng.random(vocab) < 0.3 if r % 5 == 1 else None for r in range(len(params))]
    draws = [Sampler(p).draw(allowed=a) for p, a in zip(params, allowed)]
    host = sample_rows(rows, draws)
    gpu = cupy.asnumpy(sample_rows(cupy.asarray(rows), draws))
    again = cupy.asnumpy(sample_rows(cupy.asarray(rows), draws))
    np.testing.assert_array_equal(gpu, again)
    for r, (p, t) in enumerate(zip(params, gpu)):
        x = rows[r] if allowed[r] is None else np.where(allowed[r], rows[r], -np.inf)
        if p.greedy:
            assert t == x.argmax(), (r, p)
        else:
            assert filtered_probs(x / p.temperature, p.top_k, p.top_p, p.min_p)[t] > 0, (r, p, t)
    assert (gpu == host).sum() >= len(params) - 1, (gpu, host)

"""Paged KV caches and steps over many sequences (dsl/paging.py, runtime/kv_pages.py,
runtime/batch.py): a sequence fed in chunks beside others, its rows scattered over pool pages,
gives the logits the one-sequence engine gives; the page pool shares prefixes and returns every
page."""
import numpy as np
import pytest

from fuselm.dsl.paging import is_paged, paged
from fuselm.errors import FuselmError
from fuselm.models import DecoderConfig, build_graph
from fuselm.runtime.batch import Chunk, CpuBatchEngine
from fuselm.runtime.cpu_engine import CpuEngine
from fuselm.runtime.kv_pages import PagePool

from test_generate import tiny_llama


def alone(graph, weights, ids, ctx=64):
    """Every position's logits [len(ids), vocab] of `ids` fed one token at a time, alone."""
    engine = CpuEngine(graph, weights, ctx)
    return np.concatenate([engine.logits_of([i]) for i in ids])


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_paged_graph_adds_the_page_table_and_keeps_the_rest():
    graph, _ = tiny_llama()
    g = paged(graph, 4)
    ops = [n.op for n in g.nodes.values()]
    assert is_paged(g) and not is_paged(graph)
    assert ops.count("paged_kv_write") == 4 and ops.count("paged_attention") == 2
    assert "kv_write" not in ops and "attention" not in ops
    assert g.nodes["pages"].shape == ("T", "P") and list(g.nodes)[0] == "pages"
    assert all(n.attrs["page"] == 4 for n in g.nodes.values() if n.op.startswith("paged_"))
    with pytest.raises(FuselmError, match="at least one row"):
        paged(graph, 0)


def feed_in_steps(engine, seqs, tables, plan, until_done=False):
    """Feed sequences `seqs` (on page tables `tables`) to a batch engine, step k taking plan[k][i]
    tokens of sequence i (fewer where it has fewer left), then with `until_done` one token of each
    a step until all are in. Each sequence's [(position, logits row)] of its chunks' last tokens,
    and the tokens fed of each."""
    got, fed, plan = [[] for _ in seqs], [0] * len(seqs), list(plan)
    while (plan or until_done) and any(f < len(s) for f, s in zip(fed, seqs)):
        chunks, owners = [], []
        for i, n in enumerate(plan.pop(0) if plan else [1] * len(seqs)):
            n = min(n, len(seqs[i]) - fed[i])
            if n:
                chunks.append(Chunk(seqs[i][fed[i]:fed[i] + n], fed[i], tables[i]))
                owners.append((i, fed[i] + n - 1))
                fed[i] += n
        for (i, position), row in zip(owners, engine.step(chunks) if chunks else []):
            got[i].append((position, row))
    return got, fed


@pytest.mark.parametrize("window", [0, 5])
def test_interleaved_chunks_on_scattered_pages_match_each_sequence_alone(window):
    """Three sequences, prompts in chunks of several sizes beside single decode tokens of the
    others, each on pages taken out of order from the pool (sliding window too)."""
    cfg = {"sliding_window": window} if window else {}
    graph, weights = tiny_llama()
    if window:
        graph = build_graph(DecoderConfig.from_hf({
            "architectures": ["MistralForCausalLM"], "vocab_size": 300, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, **cfg}))
    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(0, 256, n)) for n in (13, 7, 22)]
    tables = [[9, 2, 14, 5, 0, 11], [3, 12, 7], [1, 8, 4, 15, 6, 10]]     # pages of 4 rows, shuffled
    engine = CpuBatchEngine(graph, weights, pages=16, page=4, max_context=24)
    plan = [[5, 1, 8], [5, 3, 6], [3, 2, 8], [1, 1, 1], [1, 0, 0], [2, 2, 0]]   # tokens per step and sequence
    got, _ = feed_in_steps(engine, seqs, tables, plan, until_done=True)
    for i, ids in enumerate(seqs):
        want = alone(graph, weights, ids)
        for position, row in got[i]:
            assert rel(row, want[position]) < 1e-5, (i, position)


def test_a_batch_step_refuses_what_does_not_fit():
    graph, weights = tiny_llama()
    with pytest.raises(FuselmError, match="cannot hold one sequence of 24 tokens"):
        CpuBatchEngine(graph, weights, pages=5, page=4, max_context=24)
    engine = CpuBatchEngine(graph, weights, pages=8, page=4, max_context=24)
    with pytest.raises(FuselmError, match="pass the context of 24"):
        engine.step([Chunk([1, 2], 23, [0, 1, 2, 3, 4, 5])])
    with pytest.raises(FuselmError, match="at least one token"):
        engine.step([Chunk([], 0, [0])])


def test_a_step_fed_the_picks_of_the_step_before_equals_one_fed_them_by_hand():
    """launch(chunks, picks): one-token chunks take the argmax rows of the step before (what the
    server's planning ahead relies on); a chunk of more tokens cannot take a pick."""
    graph, weights = tiny_llama()
    by_hand, ahead = (CpuBatchEngine(graph, weights, pages=8, page=4, max_context=24) for _ in range(2))
    first = [Chunk([5, 6, 7], 0, [0, 1]), Chunk([9, 3], 0, [2])]
    picks = by_hand.launch(first).result().picks()
    want = by_hand.launch([Chunk([int(picks[1])], 2, [2]), Chunk([int(picks[0])], 3, [0, 1])]).result().rows
    before = ahead.launch(first)
    got = ahead.launch([Chunk([0], 2, [2]), Chunk([0], 3, [0, 1])], (before, [(0, 1), (1, 0)])).result().rows
    np.testing.assert_array_equal(got, want)
    with pytest.raises(FuselmError, match="must be one token"):
        ahead.launch([Chunk([0, 0], 4, [0, 1, 2])], (before, [(0, 0)]))


def test_the_pool_shares_published_prefixes_and_returns_every_page():
    pool = PagePool(pages=6, page=4)
    a = list(range(10))                       # two full pages and a part
    table_a = pool.allocate(pool.pages_for(len(a)))
    assert len(table_a) == 3 and pool.held == 3 and pool.match(a) == []
    pool.publish(table_a, a)                  # its two full pages become findable
    b = a[:8] + [99, 98, 97]
    shared = pool.match(b, limit=len(b) - 1)
    assert shared == table_a[:2] and pool.held == 3     # shared, not copied
    assert pool.match(a[:4] + [7, 7, 7, 7]) == [table_a[0]]          # agrees only on the first page
    pool.release([table_a[0]])
    assert pool.match([5] + a[1:8]) == []                             # the first token differs
    table_b = shared + pool.allocate(1)
    pool.release(table_a)
    assert pool.held == 3 and pool.available == 3
    pool.release(table_b)
    assert pool.held == 0 and pool.available == 6
    # the published pages stay cached until needed, then are forgotten
    again = pool.match(a)
    assert again == table_a[:2]
    pool.release(again)
    taken = pool.allocate(6)
    assert sorted(taken) == list(range(6)) and pool.match(a) == []
    assert pool.allocate(1) is None
    pool.release(taken)
    with pytest.raises(FuselmError, match="released but not held"):
        pool.release([taken[0]])


def test_match_limit_keeps_a_token_to_compute():
    pool = PagePool(pages=4, page=4)
    ids = list(range(8))
    table = pool.allocate(2)
    pool.publish(table, ids)
    assert pool.match(ids, limit=len(ids) - 1) == table[:1]   # the last page would leave nothing to feed


def test_the_cuda_build_refuses_paged_graphs_by_name():
    from fuselm.codegen.build import build_program
    graph, _ = tiny_llama()
    with pytest.raises(FuselmError, match="reads paged KV caches: its steps come from build_batch"):
        build_program(paged(graph, 4), 64, compile=False)


GPU_SHAPES = {"head 32 (CUDA-core pass)": dict(hidden_size=256, num_attention_heads=8),
              "head 128 (tensor-core pass)": dict(hidden_size=1024, num_attention_heads=8)}


@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_the_batch_build_pages_every_cache_and_compiles(shape):
    """build_batch: a module per step size, compiled by NVRTC for sm_90; every attention the
    paged kernel (a block per KV head and token), every cache row written through the page
    table, logits for every token; pages a whole number of the paged pass's chunks."""
    from fuselm.codegen import Target, Tuning
    from fuselm.codegen.build import batch_page, build_batch
    graph = build_graph(DecoderConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 500, "intermediate_size": 640, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 256, **GPU_SHAPES[shape]}))
    steps = build_batch(graph, 200, Target(), Tuning(), sizes=(64, 32))
    page = batch_page(graph, Target(), Tuning())
    assert [s.tokens for s in steps] == [64, 32] and all(s.page == page for s in steps) and page % 16 == 0
    for s in steps:
        attention = [k for k in s.kernels if k.family == "attention"]
        assert len(attention) == 2 and all(k.passes["paged"].chunk <= page and page % k.passes["paged"].chunk == 0
                                           and k.launches[0].grid == (2, "T") for k in attention)
        assert s.source.count("attention_paged<") == 1 and "paged_row(" in s.source   # one kernel shared by both layers
        assert s.G.nodes[s.logits]["shape"] == ("T", 500) and s.cubin
        assert s.G.nodes["pages"]["shape"] == ("T", -(-200 // page))


def test_a_lone_decoding_sequence_takes_a_step_of_one_token():
    """The default step sizes start at one token: its GEMVs are the decode step's (no padding to a
    gemm step), its attention the split over page-sized chunks of the sequence's own pages and the
    combine (one form for every position), its cache rows written through the page table."""
    from fuselm.codegen import Target, Tuning
    from fuselm.codegen.build import batch_page, build_batch
    graph = build_graph(DecoderConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 500, "intermediate_size": 640, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "hidden_size": 512, "num_attention_heads": 4}))
    steps = build_batch(graph, 200, Target(), Tuning())
    assert sorted(s.tokens for s in steps) == sorted((1, *Tuning().prefill_tokens))
    one = next(s for s in steps if s.tokens == 1)
    page = batch_page(graph, Target(), Tuning())
    families = {k.family for k in one.kernels}
    assert "gemv" in families and "gemm" not in families
    (attention,) = {k.name: k for k in one.kernels if k.family == "attention"}.values()
    split, combine = attention.launches
    chunk = attention.passes["split"].chunk
    assert page % chunk == 0 and split.grid == (2, -(-200 // chunk)) and combine.grid == (4, 1)
    assert f"PagedRows<{page}>" in attention.source and "paged_row(" in one.source and one.cubin
    assert attention.workspace_floats == 4 * split.grid[1] * (128 + 4)    # a record per head and chunk


def test_paged_kernels_refuse_what_they_cannot_run():
    from fuselm.codegen import Target, Tuning, generate
    from fuselm.compiler import compile_graph
    graph = build_graph(DecoderConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 500, "hidden_size": 1024, "intermediate_size": 640,
        "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 256}))
    cases = [(paged(graph, 16, table=8), 32, "pages of 16 rows are no multiple of the attention pass's 32-row chunks"),
             (paged(graph, 32), 32, "a page table of a fixed width")]
    for g, tokens, message in cases:
        with pytest.raises(FuselmError, match=message):
            generate(compile_graph(g, tokens=tokens), ctx=256, target=Target(), tuning=Tuning(), tokens=tokens)


def test_row_logprobs_are_the_raw_rows_log_softmax_with_ties_in_id_order():
    """row_logprobs (OpenAI's logprobs where the logits are): each asking row's pick and its
    best ids, from the raw logits (not what a draw's filters left), the most asked for."""
    from fuselm.runtime.picks import row_logprobs
    from fuselm.runtime.engine import SamplingParams
    from fuselm.runtime.sampling import Sampler
    rng = np.random.default_rng(3)
    rows = np.round(rng.standard_normal((4, 50)) * 2).astype(np.float32)      # ties
    best = np.array([7, 3, 11, 0])
    draws = [Sampler(SamplingParams()).draw(logprobs=k) if k is not None else None for k in (2, None, 5, 0)]
    asked, picked, ids, values = row_logprobs(rows, best, draws)
    assert asked == [0, 2, 3] and ids.shape == values.shape == (3, 5)
    for k, r in enumerate(asked):
        x = rows[r].astype(np.float64)
        log_softmax = x - np.log(np.exp(x).sum())
        np.testing.assert_allclose(picked[k], log_softmax[best[r]], rtol=1e-12)
        order = sorted(range(50), key=lambda i: (-x[i], i))[:5]
        assert ids[k].tolist() == order
        np.testing.assert_allclose(values[k], log_softmax[order], rtol=1e-12)

"""The parts of the CUDA runtime and the benchmark that need no GPU."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from fuselm.codegen import generate
from fuselm.compiler import compile_graph
from fuselm.errors import FuselmError
from fuselm.models import DecoderConfig, build_graph
from fuselm.tools.bench import step_bytes
from fuselm.runtime.cuda_engine import check_weights, to_bf16_bits


def test_bf16_bits_round_to_nearest_even_like_ml_dtypes():
    x = np.concatenate([np.random.default_rng().standard_normal(10000).astype(np.float32) * 100,
                        np.float32([0.0, -0.0, 1.0, 3.0e38, -1e-40, 1.00390625, 1.01171875])])
    assert (to_bf16_bits(x) == x.astype(ml_dtypes.bfloat16).view(np.uint16)).all()


def test_weights_the_graph_lacks_or_has_in_another_shape_are_named_before_any_compile():
    graph = build_graph(DecoderConfig.from_hf(dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)))
    weights = {n.name: np.zeros(n.shape, np.float32) for n in graph.sources("weight")}
    check_weights(graph, weights)                       # complete: no error
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(FuselmError, match=f"^missing weight '{name}'$"):
        check_weights(graph, {k: v for k, v in weights.items() if k != name})
    with pytest.raises(FuselmError, match=f"^missing weight '{name}'$"):
        check_weights(graph, {**weights, name: None})
    with pytest.raises(FuselmError, match=rf"^weight '{name}' has shape \(128, 64\), expected \(64, 128\)$"):
        check_weights(graph, {**weights, name: weights[name].T})


class _Cache:
    def __init__(self, width):
        self.shape = (1, width)


def _kernels_and_caches(cfg_dict):
    graph = build_graph(DecoderConfig.from_hf(cfg_dict))
    caches = {n.name: _Cache(n.shape[-1]) for n in graph.sources("state")}
    return generate(compile_graph(graph), ctx=64), caches, graph


def test_step_bytes_count_one_embedding_row_and_the_chosen_experts_only():
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    kernels, caches, graph = _kernels_and_caches({**base, "architectures": ["LlamaForCausalLM"]})
    weights = sum(int(np.prod(n.shape)) * 2 for n in graph.sources("weight"))
    table = 1000 * 64 * 2
    got = step_bytes(kernels, caches, context=0)
    # every weight once, except the embedding table, of which one row; plus small activations
    assert weights - table + 64 * 2 <= got < weights - table + 64 * 2 + 100_000

    moe = {**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2}
    kernels, caches, graph = _kernels_and_caches(moe)
    experts = sum(int(np.prod(n.shape)) * 2 for n in graph.sources("weight") if "*" in n.name)
    others = sum(int(np.prod(n.shape)) * 2 for n in graph.sources("weight") if "*" not in n.name)
    got = step_bytes(kernels, caches, context=0)
    assert others - table + experts * 2 / 8 <= got < others - table + experts * 2 / 8 + 100_000


def test_pdl_launch_structs_match_the_driver_abi(monkeypatch):
    """cuLaunchKernelEx reads these through a pointer: sizes and offsets as in cuda.h (64-bit)."""
    import ctypes

    from fuselm.runtime import launch
    from fuselm.runtime.launch import LaunchAttribute, LaunchConfig, pdl_wanted
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.alignment(LaunchAttribute) == 8
    assert LaunchConfig.hStream.offset == 32 and LaunchConfig.attrs.offset == 40
    assert ctypes.sizeof(LaunchConfig) == 56
    monkeypatch.setattr(launch.ctypes, "CDLL", lambda name: type("Lib", (), {"cuLaunchKernelEx": None})())
    assert pdl_wanted(90) and not pdl_wanted(80)


def test_an_unknown_attention_variant_is_a_one_line_error():
    """CudaEngine(variant=...) takes None, "general" or a variant some kernel has ("single")."""
    import pytest

    from fuselm.errors import FuselmError
    from fuselm.runtime.cuda_engine import check_variant
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2))
    kernels = generate(compile_graph(build_graph(cfg)), ctx=256)
    for ok in (None, "general", "single"):
        check_variant(kernels, ok)
    with pytest.raises(FuselmError, match=r"^variant 'singel': no kernel of this graph has it \(known: general, single\)$"):
        check_variant(kernels, "singel")


def test_bench_rows_leave_out_what_a_decode_only_run_did_not_measure():
    from fuselm.tools.bench import _row
    r = {"model": "llama-3.2-1b", "dtype": "bf16", "decode_tok_s": 1322.1, "ms_per_token": 0.756, "bandwidth_fraction": 0.777,
         "ttft_32_ms": 23.5, "ttft_512_ms": None, "decode_tok_s_at_4k": 1152.3, "ratio_4k": 0.872,
         "compile_cold_s": None, "compile_warm_s": None, "peak_gpu_GiB": 3.93}
    assert _row(r) == ("llama-3.2-1b   bf16      1322.1 tok/s   0.756 ms/tok  77.7% of copy bw | ttft32 23.5 ms "
                       "| 4k ctx 1152.3 tok/s (87.2%) | 3.93 GiB")
    full = _row({**r, "ttft_512_ms": 401.5, "compile_cold_s": 2.66, "compile_warm_s": 0.16, "warm_start_s": 0.61,
                 "prefill_tok_s_512": 1275.0, "ttft_4096_ms": 3010.0, "prefill_tok_s_4096": 1361.0})
    assert "ttft512 401.5 ms (1275 tok/s) ttft4096 3010.0 ms (1361 tok/s)" in full
    assert "compile 2.66s cold 0.16s warm | warm start 0.61s" in full
    assert "None" not in full


def test_bench_positions_size_the_cache_or_say_why_they_cannot():
    """--positions: the cache grows to hold a run from the last position; a negative one, a run
    past the model's maximum and a value that is not integers are one-line errors; the row lists
    the rates from each position."""
    import argparse

    from fuselm.models.presets import preset
    from fuselm.tools.bench import _positions, _row, context_for
    cfg = preset("smollm2-135m")                      # holds 8192 positions
    assert context_for(cfg, "smollm2-135m", 4608, (), 128) == 4608
    assert context_for(cfg, "smollm2-135m", 4608, (1024, 6000), 128) == 6129
    with pytest.raises(FuselmError, match=r"^--positions: a run of 128 tokens from 8100 needs 8229 positions; "
                                          r"smollm2-135m holds 8192$"):
        context_for(cfg, "smollm2-135m", 4608, (8100,), 128)
    with pytest.raises(FuselmError, match=r"^--positions: start positions must be 0 or more, got -5$"):
        context_for(cfg, "smollm2-135m", 4608, (10, -5), 128)
    assert context_for(cfg, "smollm2-135m", 4608, (), 128, prompts=(6000,)) == 6001
    with pytest.raises(FuselmError, match=r"^--prompts: a prompt of 8192 tokens and its answer need 8193 positions; "
                                          r"smollm2-135m holds 8192$"):
        context_for(cfg, "smollm2-135m", 4608, (), 128, prompts=(8192,))
    with pytest.raises(FuselmError, match=r"^--prompts: prompts must be at least 1 token long, got 0$"):
        context_for(cfg, "smollm2-135m", 4608, (), 128, prompts=(0, 10))
    assert _positions("1024,2048") == (1024, 2048)
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers, got '1k'"):
        _positions("1k")
    r = {"model": "m", "dtype": "q4_k_m", "decode_tok_s": 100.0, "ms_per_token": 10.0, "ttft_32_ms": 1.0, "ttft_512_ms": None,
         "decode_tok_s_at_4k": None, "compile_cold_s": None, "peak_gpu_GiB": 1.0,
         "decode_tok_s_from": {"1024": 95.5, "6000": 80.1}, "ttft_at_ms": {"32768": 1200.0},
         "prefill_tok_s_at": {"32768": 27307}}
    assert "| from 1024: 95.5, 6000: 80.1 tok/s |" in _row(r)
    assert "ttft32768 1200.0 ms (27307 tok/s)" in _row(r)


def test_bench_records_the_tuning_it_ran_under():
    """A bench record's "tuning" lists the values that differ from the defaults (an A/B's side)."""
    from fuselm.codegen import Tuning
    assert Tuning().changed() == {}
    assert Tuning.parse("gemv_warps=4,prefill_tokens=32/64/256").changed() == {"gemv_warps": 4}
    assert Tuning.parse("prefill_tokens=32").changed() == {"prefill_tokens": (32,)}


def test_prefill_steps_fit_the_context():
    """step_sizes: steps of the largest size while more tokens remain than it holds, then the
    smallest step that holds the rest, as long as each step ends inside the cache; the rest of a
    prompt goes one token at a time. Prefill.run refuses more than its steps take."""
    import types

    import pytest

    from fuselm.errors import FuselmError
    from fuselm.runtime.prefill import Prefill, step_sizes
    assert step_sizes(39, 100, (64, 32)) == [64]            # one step of 64 costs less than two of 32
    assert step_sizes(20, 100, (64, 32)) == [32]            # the smallest step that holds them
    assert step_sizes(100, 200, (64, 32)) == [64, 64]
    assert step_sizes(150, 200, (64, 32)) == [64, 64, 32]
    assert step_sizes(49, 55, (64, 32)) == [32]             # a step of 64 would end at 109 of 100
    assert step_sizes(39, 100, (32,)) == [32, 32]
    assert step_sizes(10, 20, (64, 32)) == []               # no step fits: one token at a time
    assert step_sizes(64, 64, (64, 32)) == [64]
    assert step_sizes(0, 64, (64, 32)) == []
    p = Prefill.__new__(Prefill)                   # the arithmetic alone: no GPU buffers
    p.sizes, p.engine = (64, 32), types.SimpleNamespace(max_context=100)
    assert p.plan(49, 45) == [32]
    with pytest.raises(FuselmError, match="does not fit the context of 100 in steps of 64 or 32"):
        p.run(list(range(49)), 45)


def test_a_prompt_ends_in_a_step_with_logits_where_it_can():
    """plan_to_logits: a prompt goes in the steps plan() gives, the last of them in its form with
    logits; a one-token prompt, a prompt the steps cannot hold to its end, or a last step size
    without that form takes the decode step for its last token instead."""
    import types

    from fuselm.runtime.prefill import Prefill
    p = Prefill.__new__(Prefill)                   # the arithmetic alone: no GPU buffers
    p.sizes, p.engine, p.ends = (256, 64, 32), types.SimpleNamespace(max_context=1000), {256: 0, 64: 0, 32: 0}
    assert p.plan_to_logits(1, 0) is None
    assert p.plan_to_logits(2, 0) == [32] and p.plan_to_logits(512, 0) == [256, 256]
    assert p.plan_to_logits(700, 0) == [256, 256, 256]
    assert p.plan_to_logits(40, 936) == [64]       # ends at 1000
    assert p.plan_to_logits(40, 937) is None       # 63 rows left: a step of 32, then none holds 8
    p.ends = {256: 0, 32: 0}                       # no 64-token form with logits
    assert p.plan_to_logits(40, 0) is None and p.plan_to_logits(20, 0) == [32]


def test_tuning_values_are_checked(monkeypatch):
    """Every tuning value is range-checked where it is made (Tuning(), parse, $FUSELM_TUNE), with
    a one-line error naming it; prefill step sizes are distinct multiples of 8 up to 1024, and the
    values that must be powers of two are."""
    from fuselm.codegen import Tuning
    assert Tuning.parse("prefill_tokens=32/64/32").prefill_tokens == (64, 32)
    for bad, message in (("prefill_tokens=48/20", "prefill_tokens=48/20: distinct step sizes"),
                         ("prefill_tokens=2048", "prefill_tokens=2048: distinct"),
                         ("wgmma_vector_copy=3", "wgmma_vector_copy=3: how wgmma producers copy the vectors"),
                         ("attn_warps=64", "attn_warps=64: warps per attention split block must be an integer from 1 to 32"),
                         ("gemm_blocks=lots", "'gemm_blocks=lots': the value must be an integer"),
                         ("bogus=1", "'bogus=1': expected name=value"), ("gemv_warps", "'gemv_warps': expected")):
        with pytest.raises(FuselmError, match=re.escape(message)):
            Tuning.parse(bad)
    with pytest.raises(FuselmError, match=r"^tuning attn_combine_group=0: .* from 1 to 64$"):
        Tuning(attn_combine_group=0)
    monkeypatch.setenv("FUSELM_TUNE", "attn_wide_warps=0")
    assert Tuning.from_env().attn_wide_warps == 0
    monkeypatch.setenv("FUSELM_TUNE", "attn_wide_warps=-1")
    with pytest.raises(FuselmError, match="^FUSELM_TUNE: tuning attn_wide_warps=-1"):
        Tuning.from_env()


def test_prefill_steps_say_why_a_model_has_none():
    """prefill_steps returns the reason instead of steps: GPUs before sm_80, rows that are no
    multiple of 32 (in GEMVs or in the experts of a MoE)."""
    from fuselm.codegen import Target, Tuning
    from fuselm.codegen.build import prefill_steps
    tiny = build_graph(DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64,
                                                 hidden_size=36, intermediate_size=50, num_hidden_layers=1,
                                                 num_attention_heads=3, num_key_value_heads=1)))
    assert "sm_80" in prefill_steps(tiny, 64, Target("sm_75"), Tuning())
    assert "not a multiple of 32" in prefill_steps(tiny, 64, Target(), Tuning())
    moe = build_graph(DecoderConfig.from_hf(dict(architectures=["MixtralForCausalLM"], vocab_size=64,
                                                hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)))
    why = prefill_steps(moe, 64, Target(), Tuning())
    assert isinstance(why, str) and "down rows of 48 weights are not a multiple of 32" in why, why


def test_moe_prefill_takes_steps_longer_than_its_blocks_and_refuses_tiles_too_large():
    """The moe prefill routes a step's tokens in a launch of its own (a warp a token), so a step
    may hold more tokens than a block has threads; its experts take at most PASS_TOKENS of them
    at a time, and a tile of those that does not fit shared memory is refused by name."""
    from fuselm.codegen import Tuning, moe
    from fuselm.codegen.emit import prefill_unsupported
    graph = build_graph(DecoderConfig.from_hf(dict(architectures=["MixtralForCausalLM"], vocab_size=64,
                                                   hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)))
    G = compile_graph(graph, tokens=256, state_only=True)
    launch = next(l for l in G.graph["schedule"] if l.family == "moe")
    assert prefill_unsupported(G, 256) is None
    assert moe.unsupported(G, launch, 256, Tuning(gemm_warps=1)) is None     # 32 threads, 256 tokens
    assert (moe.pass_tokens(256, False), moe.pass_tokens(32, False), moe.pass_tokens(256, True)) == (64, 32, 32)
    why = moe.unsupported(G, launch, 256, Tuning(gemm_warps=8))                # 128-row tiles of 64 tokens
    assert why and "gate/up GEMMs at 256 tokens per step (64 at a time)" in why and "shared memory" in why, why


def test_moe_prefill_routes_once_and_sizes_its_workspace_by_entries():
    """A moe prefill kernel is four launches: _route (a warp a token), then _up and _down (a block
    per expert and row tile) and _sum; its workspace holds each of the step's T K entries' route,
    weight, act row [I] and weighted product [D], not every expert's rows for every token."""
    from fuselm.codegen import Target, Tuning, moe
    from fuselm.codegen.kernel import KernelSpec
    graph = build_graph(DecoderConfig.from_hf(dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64,
                                                   hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   num_experts=16, num_experts_per_tok=4)))
    tokens, E, K, I, D = 256, 16, 4, 32, 64
    G = compile_graph(graph, tokens=tokens, state_only=True)
    launch = next(l for l in G.graph["schedule"] if l.family == "moe")
    tuning = Tuning()
    k = moe.generate(KernelSpec(G, launch, 64, tokens, Target(), tuning))
    assert [l.function.rsplit("_", 1)[1] for l in k.launches] == ["route", "up", "down", "sum"]
    assert k.launches[0].grid == (tokens // tuning.gemm_warps, 1)          # a warp a token
    assert k.launches[1].grid[0] == E * -(-I // (16 * tuning.gemm_warps))
    assert k.workspace_floats == tokens * K * (2 + I + D)
    assert "route_step<16, 4," in k.source and "moe_up_tokens<16, 4, 32, 64, 256, 64," in k.source


def test_prefill_steps_leave_out_the_step_sizes_a_model_cannot_take():
    """prefill_steps keeps each step size the model's kernels can take and drops the others (here:
    8-warp gemm blocks, whose expert tiles of 64 tokens do not fit shared memory); with none left,
    the reason."""
    from fuselm.codegen import Target, Tuning
    from fuselm.codegen.build import prefill_steps
    graph = build_graph(DecoderConfig.from_hf(dict(architectures=["MixtralForCausalLM"], vocab_size=64,
                                                   hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)))
    assert [s.tokens for s in prefill_steps(graph, 128, Target(), Tuning())] == [256, 64, 32]
    eight_warps = Tuning(gemm_warps=8)
    assert [s.tokens for s in prefill_steps(graph, 128, Target(), eight_warps)] == [32]
    why = prefill_steps(graph, 128, Target(), Tuning(gemm_warps=8, prefill_tokens=(64,)))
    assert isinstance(why, str) and "gate/up GEMMs at 64 tokens per step" in why, why


def test_mma_gemm_blocks_take_column_tiles_where_every_token_does_not_fit():
    """gemm.mma_columns: a mma.sync block takes every token of the step where its tile and staged
    chunk fit the static shared memory, else the widest half, quarter, ... in whole tiles of 8
    tokens; none fitting, the kernel is refused with the narrowest width tried."""
    from fuselm.codegen import Tuning, gemm
    t = Tuning()
    assert gemm.mma_columns(2048, 1, 64, t) == 64            # a MoE router's step of 64: whole
    assert gemm.mma_columns(2048, 1, 256, t) == 64           # of 256: four column tiles
    assert gemm.mma_columns(4096, 2, 112, t) == 56           # gate/up off wgmma's multiples of 32
    assert gemm.mma_columns(4096, 8, 24, t) is None          # 24 does not halve into tiles of 8
    assert gemm.smem_bytes(4096, 8, 24, t) > gemm.SMEM_STATIC >= gemm.smem_bytes(4096, 2, 256, t, columns=64)


def test_gemm_split_k_takes_the_fewest_slices_that_fill_the_gpu():
    """gemm.splits: tiles x slices reach gemm_blocks with the fewest slices that cut K into equal
    runs of at least gemm_min_chunks chunks; kernels with tiles enough, or rows too short, do not split."""
    from fuselm.codegen import Tuning, gemm
    t = Tuning()
    assert (t.gemm_blocks, t.gemm_min_chunks) == (512, 4)    # the defaults the GPU tests ran under
    assert gemm.splits(14336, 64, t) == 8        # the 8B's down projection: 112 chunks of 128
    assert gemm.splits(4096, 224, t) == 4        # its gate/up: 896 blocks
    assert gemm.splits(8192, 32, t) == 16        # the 1B's down projection
    t = Tuning(gemm_blocks=256)
    assert gemm.splits(14336, 64, t) == 4
    assert gemm.splits(4096, 224, t) == 2
    assert gemm.splits(4096, 300, t) == 1        # enough tiles
    assert gemm.splits(8192, 32, t) == 8
    assert gemm.splits(2048, 48, t) == 4         # short rows: at most 16 / 4 slices
    assert gemm.splits(1536, 9, t) == 3          # 12 chunks, slices of 4 or more: at most 3 (below gemm_blocks)
    assert gemm.splits(576, 15, t) == 1          # 9 chunks of 64: no equal slices of 4 or more
    assert gemm.splits(576, 15, Tuning(gemm_blocks=256, gemm_min_chunks=1)) == 9

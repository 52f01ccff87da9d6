"""Every kernel the code generator emits compiles with NVRTC, for sm_80 and sm_90, without a GPU.

For every architecture in models.ARCHITECTURES (through its presets, real shapes) and a few tiny
odd configs (hidden size not a multiple of 8, head_dim 40, MQA, tied embeddings), fused and
unfused: generate the whole per-token schedule (sampler included), compile it as one module to a
cubin, and check ptxas' resource report (NVRTC --ptxas-options=-v): a report for every entry
function, and zero spill bytes in the GEMV and attention kernels on sm_90 (their registers hold the loads in
flight; sm_80 may spill up to SM80_TOLERATED_SPILL_BYTES).

CuPy's low-level `cupy.cuda.nvrtc` needs no driver, so this runs on CI (cupy-cuda12x +
nvidia-cuda-nvrtc-cu12). Nothing is skipped and nothing is cached on disk (use_cache=False);
generated kernels are shared between the two architectures through a module-scoped fixture.
"""
from __future__ import annotations

import re

import pytest

from fuselm.codegen import Target, Tuning, generate, headers, module_source, sample
from fuselm.codegen.attention import Layout
from fuselm.codegen.nvrtc import compile_cubin, options, spills, static_smem
from fuselm.compiler import compile_graph
from fuselm.models import ARCHITECTURES, DecoderConfig, build_graph
from fuselm.models.presets import PRESETS, preset

SIZES = Tuning().prefill_tokens

ARCHS = ("sm_80", "sm_90")


def tiny(**overrides) -> DecoderConfig:
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=300)          # 300 rows: the last attention chunk is partial
    d.update(overrides)
    return DecoderConfig.from_hf(d, source="tiny test config")


TINY = {
    # every GEMV row (K = 36 and 50) is not 16-byte aligned; odd vocab
    "tiny-hidden36": lambda: tiny(hidden_size=36, num_attention_heads=3, num_key_value_heads=1,
                                  head_dim=12, intermediate_size=50, vocab_size=97),
    "tiny-headdim40": lambda: tiny(hidden_size=160, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=40, intermediate_size=200),
    "tiny-mqa": lambda: tiny(num_attention_heads=4, num_key_value_heads=1),
    "tiny-tied": lambda: tiny(tie_word_embeddings=True),
}
SUPPORTED_PRESETS = [n for n, d in PRESETS.items() if d["architectures"][0] in ARCHITECTURES]
CONFIGS = {**{n: (lambda n=n: preset(n)) for n in SUPPORTED_PRESETS}, **TINY}


@pytest.fixture(scope="module")
def kernels_of():
    """(config name, fuse) -> the runtime's kernel list (sampler last), generated once per module."""
    made = {}

    def get(name: str, fuse: bool):
        if (name, fuse) not in made:
            cfg = CONFIGS[name]()
            G = compile_graph(build_graph(cfg), fuse=fuse, tokens=1)
            ks = generate(G, ctx=min(cfg.max_position_embeddings, 4096))
            logits = next(iter(G.graph["outputs"].values()))
            made[name, fuse] = ks + [sample.generate(G.nodes[logits]["shape"][-1], Tuning())]
        return made[name, fuse]
    return get


def test_every_architecture_has_a_preset_compiled_here():
    covered = {PRESETS[n]["architectures"][0] for n in SUPPORTED_PRESETS}
    assert covered == set(ARCHITECTURES), f"architectures without a preset: {set(ARCHITECTURES) - covered}"


def test_the_ptxas_report_is_in_the_nvrtc_log():
    """options(verbose=True) must make NVRTC return ptxas' report; spills() must read it."""
    src = 'extern "C" __global__ void probe(float* x) { x[threadIdx.x] *= 2.0f; }'
    _, log, cached = compile_cubin(src, {}, options("sm_90", verbose=True), use_cache=False)
    assert not cached
    assert "ptxas info" in log and "Compiling entry function 'probe'" in log, log
    assert spills(log) == {"probe": 0}
    _, quiet, _ = compile_cubin(src, {}, options("sm_90"), use_cache=False)
    assert "ptxas info" not in quiet


# On sm_80 (not the GPU we tune for) ptxas spills up to 32 bytes in a few GEMVs of the 3584- and
# 18944-wide models and in Qwen2.5's attention split kernel (7 query heads per KV head); a spill
# there is tolerated up to this size. On sm_90 any spill fails.
SM80_TOLERATED_SPILL_BYTES = 32


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_module_compiles_and_gemv_and_attention_kernels_do_not_spill(kernels_of, name, fuse, arch):
    ks = kernels_of(name, fuse)
    cubin, log, cached = compile_cubin(module_source(ks), headers(), options(arch, verbose=True),
                                       use_cache=False)
    assert not cached
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return a cubin"
    functions = {launch.function for k in ks for launch in k.all_launches()}
    for f in functions:
        assert f.encode() in cubin, f"{f} is launched but not in the cubin"
    report = spills(log)
    missing = functions - set(report)
    assert not missing, f"no ptxas resource report for {sorted(missing)}; log:\n{log[:2000]}"
    assert f"for '{arch}a'" in log if arch == "sm_90" else f"for '{arch}'" in log   # sm_90 builds as sm_90a (wgmma)
    gemv = {launch.function for k in ks if k.family in ("gemv", "attention") for launch in k.all_launches()}
    assert gemv, "no gemv kernel generated"
    spilling = {f: report[f] for f in sorted(gemv) if report[f]}
    if arch == "sm_80" and spilling and max(spilling.values()) <= SM80_TOLERATED_SPILL_BYTES:
        pytest.xfail(f"small sm_80 spills, tolerated: {spilling}")
    if arch == "sm_90":
        assert_shared_memory_fits(ks, log)
    assert not spilling, f"{name} {arch}: gemv or attention kernels spill (bytes stored + loaded): {spilling}"


# on sm_90 the wgmma gemm takes rows of any multiple of 8 weights (tiny-headdim40's 200 too)
PREFILL_UNSUPPORTED = {"tiny-hidden36": "rows of 36 weights are not a multiple of 32"}


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tokens", SIZES, ids=[f"{t}-tokens" for t in SIZES])
def test_prefill_module_compiles_and_does_not_spill(name, fuse, tokens):
    """The batched-prefill module of each step size (state only, steps of `tokens` tokens: gemm
    kernels and one attention block per KV head and token) of every config, fused and unfused (an
    unfused engine's prefill), compiles for sm_90 without spills in its gemm and attention
    kernels, or prefill_unsupported names why it has none."""
    from fuselm.codegen.emit import prefill_unsupported
    cfg = CONFIGS[name]()
    graph = build_graph(cfg)
    moe = any(n.op == "moe_ffn" for n in graph.nodes.values())
    G = compile_graph(graph, fuse=fuse, tokens=tokens, state_only=True)
    why = prefill_unsupported(G, tokens)
    if name in PREFILL_UNSUPPORTED:
        assert why and PREFILL_UNSUPPORTED[name] in why
        return
    assert why is None, why
    ks = generate(G, ctx=min(cfg.max_position_embeddings, 4096), tokens=tokens)
    assert {k.family for k in ks} <= {"gemm", "attention", "rowwise", "moe"} and "gemm" in {k.family for k in ks}
    cubin, log, _ = compile_cubin(module_source(ks), headers(), options("sm_90", verbose=True), use_cache=False)
    functions = {launch.function for k in ks for launch in k.all_launches()}
    assert all(f.encode() in cubin for f in functions)
    report = spills(log)
    spilling = {f: report[f] for f in functions if report[f] and not f.startswith("rowwise")}
    assert any(f.startswith("moe") for f in functions) == moe
    assert not spilling, f"{name}: prefill kernels spill: {spilling}"
    assert_shared_memory_fits(ks, log)


@pytest.mark.parametrize("copy", [1, 2, 4])
@pytest.mark.parametrize("name", ["llama-3.2-1b", "smollm2-135m", "tiny-headdim40"])
def test_prefill_with_vectors_copied_a_slot_at_a_time_compiles(name, copy):
    """With wgmma_vector_copy (the step's vectors staged in slot order, copied by one bulk copy a
    slot, or multicast within clusters of `copy` row tiles) every prefill module compiles for
    sm_90 without spills; a gemm kernel is a cluster of `copy` blocks where that divides its row
    tiles, else it copies in bulk alone; rows of 200 weights (tiny-headdim40) stage a
    zero-padded last slot."""
    cfg = CONFIGS[name]()
    tuning = Tuning(wgmma_vector_copy=copy)
    G = compile_graph(build_graph(cfg), tokens=256, state_only=True)
    ks = generate(G, ctx=4096, tokens=256, tuning=tuning)
    gemms = [k for k in ks if k.family == "gemm" and k.launches[-1].block == 384]    # the wgmma form
    assert gemms
    for k in gemms:
        tiles = k.launches[-1].grid[0]
        clustered = f"__cluster_dims__({copy}, 1, 1)" in k.source
        assert clustered == (copy > 1 and tiles % copy == 0), (k.name, tiles)
        assert "COPY = 1;" in k.source if not clustered else f"COPY = {copy};" in k.source
    cubin, log, _ = compile_cubin(module_source(ks), headers(), options("sm_90", verbose=True), use_cache=False)
    functions = {launch.function for k in ks for launch in k.all_launches()}
    report = spills(log)
    assert not {f: report[f] for f in functions if report[f] and not f.startswith("rowwise")}
    assert_shared_memory_fits(ks, log)


def assert_shared_memory_fits(kernels, log: str) -> None:
    """Every launch's dynamic shared memory beside its function's static arrays (ptxas' report)
    fits what the H200 lets a block opt into: more fails at launch, not here."""
    static = static_smem(log)
    limit = Target().smem_per_block
    over = {l.function: (l.smem, static.get(l.function, 0)) for k in kernels for l in k.all_launches()
            if l.smem + static.get(l.function, 0) > limit}
    assert not over, f"launches over {limit} B of shared memory (dynamic, static): {over}"


def test_random_graphs_compile_for_sm90():
    """Every hypothesis-drawn DSL graph (tests/graph_strategies.py) compiles, fused and not:
    the code generator has no shape or op combination it cannot emit."""
    from hypothesis import HealthCheck, given, settings

    from graph_strategies import random_graphs

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=random_graphs())
    def check(case):
        rows = max([v.shape[0] for v in case.state.values()] + [8])
        for fuse in (True, False):
            G = compile_graph(case.graph, fuse=fuse, tokens=1)
            cubin, _, _ = compile_cubin(module_source(generate(G, ctx=rows)), headers(),
                                        options("sm_90"), use_cache=False)
            assert cubin[:4] == b"\x7fELF"

    check()


@pytest.mark.parametrize("K", [768, 800, 2880, 4096])
def test_staged_vectors_stay_16_byte_aligned_in_arrays(K):
    """StagedX (quant.cuh) is read and written as int4: in the moe kernel's array of them (one per
    chosen expert) every element must start on 16 bytes, also where K/32 is no multiple of 4
    (gpt-oss: 2880), and codegen's shared-memory budget (staged_bytes) must count its padding."""
    from fuselm.codegen.gemv import staged_bytes
    source = ('#include "quant.cuh"\n'
              f"static_assert(sizeof(StagedX<{K}>) == {staged_bytes(K)}, \"staged_bytes\");\n"
              f"static_assert(alignof(StagedX<{K}>) == 16 && sizeof(StagedX<{K}>) % 16 == 0, \"alignment\");\n")
    compile_cubin(source, headers(), options("sm_90"), use_cache=False)   # raises on a failed assert


def test_float_literals_are_valid_c_for_any_float():
    from fuselm.codegen.cexpr import float_literal
    assert float_literal(30) == "30.0f" and float_literal(1e-5) == "1e-05f"
    assert float_literal(float("nan")) == "__int_as_float(0x7fc00000)"
    assert float_literal(float("-inf")) == "__int_as_float(0xff800000)"


def test_attention_too_wide_for_shared_memory_is_a_clear_error():
    """64 query heads of 256 per KV head need more shared memory than the kernel gets even with one
    warp per block (wider layouts get fewer warps, see the test below): refused with one line
    naming the node, not an NVRTC failure."""
    from fuselm.errors import FuselmError
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=3072,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=64,
                                     num_key_value_heads=1, head_dim=256))
    G = compile_graph(build_graph(cfg))
    with pytest.raises(FuselmError, match=r"attention_\d+: 64 query heads per KV head of 256 need \d+ bytes"):
        generate(G, ctx=64)


def test_attention_head_dim_over_256_is_a_clear_error():
    from fuselm.errors import FuselmError
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=512,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                                     num_key_value_heads=1, head_dim=512))
    with pytest.raises(FuselmError, match=r"attention_\d+: head_dim 512 > 256 is not supported"):
        generate(compile_graph(build_graph(cfg)), ctx=64)


def test_attention_position_must_be_a_graph_input():
    """The attention kernel reads the position before waiting for the previous kernel, so a
    position computed inside the step is refused."""
    from fuselm.dsl import Graph
    from fuselm.errors import FuselmError
    g = Graph("computed_pos")
    pos = g.input("pos", ("T",), "i32")
    q, k, v = (g.input(n, ("T", 16)) for n in "qkv")
    shifted = g.op("add", pos, pos)
    kc = g.op("kv_write", g.state("kc", ("S", 16)), k, pos)
    vc = g.op("kv_write", g.state("vc", ("S", 16)), v, pos)
    g.output(out=g.op("attention", q, kc, vc, shifted, n_heads=1, n_kv_heads=1, head_dim=16, scale=0.25))
    with pytest.raises(FuselmError, match=r"attention_\d+: the position must be a graph input"):
        generate(compile_graph(g, tokens=1), ctx=16)


def test_attention_falls_back_to_fewer_warps_where_shared_memory_is_short():
    """Eight query heads of 256 per KV head: eight warps' softmax states would need more than 48 kB
    of shared memory, so both attention kernels run four, and the module still compiles."""
    narrow, wide = (Layout(1, hd, group, Target(), Tuning()) for hd, group in ((128, 4), (256, 8)))
    assert narrow.single_warps == Tuning().attn_single_warps == 8 and narrow.split_warps == Tuning().attn_warps == 8
    assert wide.single_warps == wide.split_warps == 4
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=256,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
                                     num_key_value_heads=1, head_dim=256))
    ks = generate(compile_graph(build_graph(cfg)), ctx=512)
    (att,) = [k for k in ks if k.family == "attention"]
    (single,) = att.launches_of("single")
    split, _ = att.launches_of("general")
    assert single.block == split.block == 32 * 4 and att.variants[0].until > 0
    cubin, _, _ = compile_cubin(module_source(ks), headers(), options("sm_90"), use_cache=False)
    assert single.function.encode() in cubin and split.function.encode() in cubin


@pytest.mark.parametrize("warps", [9, 12])
def test_the_wide_split_takes_over_where_the_split_outgrows_one_wave(warps):
    """Llama-3.2-1B (8 KV heads, chunks of 256): from position 16 x 256 = 4096 the split would
    launch more blocks than the H200's 132 SMs, so up to 16 x 288 (the default, 9 warps: chunks of
    288) or 16 x 384 (12 warps) the wide split and its
    combine run instead; between the one-launch attention and 4096 the split as before, and past
    the wide split's range too (a longer context). SmolLM2's 3 KV heads fit in one wave up to 44
    chunks: no wide split at 4608 rows. attn_wide_warps=0 turns it off. The module compiles, the
    wide kernels without spills."""
    tuning = Tuning(attn_wide_warps=warps)
    chunk = 32 * warps                       # head size 64: 32 positions per warp (MmaPass)
    graph = build_graph(preset("llama-3.2-1b"))
    for rows in (4608, 8192):
        until = min(16 * chunk, rows)
        ks = generate(compile_graph(graph), ctx=rows, tuning=tuning)
        (att, *_) = [k for k in ks if k.family == "attention"]
        assert [(v.name, v.until) for v in att.variants] == [("single", 512), ("split", 4096), ("wide", until)]
        assert [l.function for l in att.launches_at(4095)] == [f"{att.name}_split", f"{att.name}_combine"]
        split, combine = att.launches_at(4096)
        assert (split.function, combine.function) == (f"{att.name}_split_wide", f"{att.name}_combine_wide")
        assert split.grid == (8, -(-rows // chunk)) and split.block == warps * 32
        assert att.launches_at(until) == att.launches
    cubin, log, _ = compile_cubin(module_source(ks), headers(), options("sm_90", verbose=True), use_cache=False)
    assert split.function.encode() in cubin and not spills(log).get(split.function)
    smol = generate(compile_graph(build_graph(preset("smollm2-135m"))), ctx=4608)
    assert [v.name for k in smol for v in k.variants] == ["single"] * 30
    off = Tuning(attn_wide_warps=0)
    assert not any(v.name == "wide" for k in generate(compile_graph(graph), ctx=4608, tuning=off) for v in k.variants)


def test_gemv_epilogue_operands_are_loaded_before_the_dot_products_where_the_schedule_allows():
    """Llama-3.2-1B: the O and down projections load their residual, and the Q/K/V GEMVs of layers
    1 on the position for RoPE and the cache row, before the weight loop (plan_early_reads), through
    L2; layer 0's Q/K/V, with no GEMV ahead of it in the step, reads the position after its wait as
    before; gate/up and the LM head have no such operand. The module compiles without spills."""
    graph = compile_graph(build_graph(preset("llama-3.2-1b")))
    ks = [k for k in generate(graph, ctx=512) if k.family == "gemv"]
    early = {}
    for k in ks:
        lines = [line.strip() for line in k.source.splitlines() if "__ldcg(" in line]
        assert all(line.startswith("const ") for line in lines), lines     # declarations ahead of the loop
        early.setdefault(k.name.rsplit("_", 1)[0], set()).add(len(lines))
    assert early == {"gemv_norm_k2048_1x2048_1x512_1x512": {0, 4}, "gemv_k2048_1x2048": {1}, "gemv_k8192_1x2048": {1},
                     "gemv_norm_k2048_2x8192": {0}, "gemv_norm_k2048_1x128256": {0}}, early
    qkv0, qkv1 = ks[0], ks[4]                         # launch order: Q/K/V, O, gate/up, down per layer
    assert "__ldcg(" not in qkv0.source and qkv1.source.count("__ldcg(") == 4
    cubin, log, _ = compile_cubin(module_source(generate(graph, ctx=512)), headers(), options("sm_90", verbose=True),
                                  use_cache=False)
    assert not any(spills(log).values()), spills(log)


def test_only_few_block_kernels_release_their_successor_before_waiting():
    """Row-wise kernels and attention split + combine (a block per row, per KV head and chunk, per
    query head) let the next kernel be scheduled before they wait, at the top of the entry point
    (after the block-timeline hook, a no-op unless traced); the one-launch attention,
    GEMVs and the sampler only after their wait."""
    import re
    ks = generate(compile_graph(build_graph(preset("qwen3-8b"))), ctx=4608) + [sample.generate(151936, Tuning())]
    families = {k.family for k in ks}
    assert {"rowwise", "attention", "gemv"} <= families
    for k in ks:
        entries = re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(.*?\{\n    TRACE_BLOCK\(\);\n(.*?)\n',
                             k.source, re.S)
        assert len(entries) == k.source.count('extern "C"'), k.name
        assert entries, k.name
        for function, first in entries:
            early = k.family == "rowwise" or function.endswith(("_split", "_combine", "_split_wide", "_combine_wide"))
            assert (first.strip() == "grid_release();") == early, (function, first)
        if k.family not in ("rowwise", "attention"):
            assert "grid_release();" not in k.source


def test_attention_passes_run_on_tensor_cores_where_they_fit():
    """Head sizes 64 and 128 with at most 8 query heads per KV head get MmaPass from sm_80 on
    (the split and the one-launch kernel; the wide split's with its V rows after the queries,
    LATE_V); other layouts and older GPUs LanePass, whose chunk (positions per split block) is
    MmaPass's wherever its lanes hold 8 rows (up to 4 query heads per KV head)."""
    from fuselm.codegen.attention import Pass, pass_of

    def layout(hd, group, kv=1, arch="sm_90"):
        return Layout(kv, hd, group, Target(arch), Tuning())
    assert layout(64, 4, kv=8).split_pass == Pass("MmaPass<8, 64, 8, 4>", 256, on_tensor_cores=True)
    assert layout(128, 7, kv=4).split_pass == Pass("MmaPass<4, 128, 8, 7>", 128, on_tensor_cores=True)
    assert layout(128, 4, kv=8).single_pass.type == "MmaPass<8, 128, 8, 4>"
    assert layout(256, 2, kv=8).split_pass.type.startswith("LanePass<8, 256, 8, ")
    assert layout(64, 12, kv=4).split_pass == Pass("LanePass<4, 64, 8, 2, 12>", 64)
    assert pass_of(8, 6, 2, 4, 8, Target()).type.startswith("LanePass<")
    assert layout(64, 4, kv=8).wide_split().pass_ == Pass("MmaPass<8, 64, 9, 4, true>", 288, True, True)
    source = "\n".join(k.source for k in generate(compile_graph(build_graph(preset("llama-3.2-1b"))), ctx=4608))
    assert "attention_chunk<32, 8, 64, MmaPass<8, 64, 8, 4>, 18>" in source
    assert "attention_chunk<32, 8, 64, MmaPass<8, 64, 9, 4, true>, 16>" in source     # the wide split
    assert "attention_single<32, 8, 64, MmaPass<8, 64, 8, 4>>" in source
    old = [layout(h, g, arch="sm_75").split_pass for h, g in ((64, 4), (128, 4), (64, 3), (128, 7))]
    assert old == [Pass("LanePass<1, 64, 8, 8, 4>", 256), Pass("LanePass<1, 128, 8, 8, 4>", 128),
                   Pass("LanePass<1, 64, 8, 8, 3>", 256), Pass("LanePass<1, 128, 8, 4, 7>", 64)]
    assert layout(64, 4, arch="sm_75").single_pass.type == "LanePass<1, 64, 8, 4, 4>"


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_kernel_argument_has_memory(name, fuse):
    """What CudaEngine binds to each launch argument exists: a graph source (weight, constant,
    input, KV cache), a value the buffer plan placed, or a runtime buffer. (A value a kernel names
    but no launch writes has no memory: a KeyError when the engine is built.)"""
    from fuselm.codegen.params import storage_of
    from fuselm.runtime.cuda_engine import RUNTIME_BUFFERS
    cfg = CONFIGS[name]()
    G = compile_graph(build_graph(cfg), fuse=fuse, tokens=1)
    logits = G.graph["outputs"]["logits"]
    kernels = generate(G, ctx=min(cfg.max_position_embeddings, 4096)) + [sample.generate(G.nodes[logits]["shape"][-1], Tuning())]
    for k in kernels:
        for launch in k.all_launches():
            for a in launch.args:
                if a in RUNTIME_BUFFERS:
                    continue
                store = storage_of(G, logits if a == "logits" else a)   # the sampler's "logits": the output
                assert G.nodes[store]["op"] in ("weight", "constant", "input", "state") \
                    or store in G.graph["buffers"], f"{launch.function}: argument {a} has no memory"
    # the batched prefill (runtime/prefill.py) binds graph sources, its own arena and its own
    # workspace (the moe kernels') only
    from fuselm.codegen.emit import prefill_unsupported
    for tokens in SIZES:
        P = compile_graph(build_graph(cfg), fuse=fuse, tokens=tokens, state_only=True)
        if not prefill_unsupported(P, tokens):
            check_prefill_arguments(P, generate(P, ctx=min(cfg.max_position_embeddings, 4096), tokens=tokens))


def check_prefill_arguments(P, kernels) -> None:
    """Every argument of the prefill kernels is a graph source, a buffer of P's arena or a runtime
    buffer of runtime/prefill.py that the kernel sizes (the moe workspace, split-K slabs and counts,
    the staged vectors)."""
    from fuselm.codegen.params import storage_of
    sized = {"workspace": lambda k: k.workspace_floats, "gemm_slabs": lambda k: k.slab_floats,
             "gemm_counts": lambda k: k.tile_counts, "gemm_x": lambda k: k.staged_floats}
    for k in kernels:
        for launch in k.all_launches():
            for a in launch.args:
                if a in sized:
                    assert sized[a](k) > 0, f"{launch.function}: a {a} argument, but none sized"
                    continue
                store = storage_of(P, a) if a in P else None
                assert store is not None and (P.nodes[store]["op"] in ("weight", "constant", "input", "state")
                                              or store in P.graph["buffers"]), f"{launch.function}: argument {a} has no memory"


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-8b", "gpt-oss-20b", "tiny-mqa"])
def test_fp8_batch_module_compiles_and_does_not_spill(name):
    """The batch module over an fp8 KV pool (its gemms' and GEMVs' fp8 writes through the page
    tables, the paged attention reading fp8 rows) compiles for sm_90 without spills in its gemm,
    GEMV and attention kernels."""
    from fuselm.codegen.build import build_batch
    cfg = CONFIGS[name]()
    steps = build_batch(build_graph(cfg), min(cfg.max_position_embeddings, 4096), Target(), Tuning(), sizes=(1, 32),
                        compile=False, kv="fp8")
    for step in steps:
        assert any(k.name.startswith("attention") and "_paged" in k.name and "_fp8" in k.name for k in step.kernels)
        assert any("kvfp8" in k.name for k in step.kernels if k.family in ("gemm", "gemv"))
        cubin, log, _ = compile_cubin(step.source, headers(), options("sm_90", verbose=True), use_cache=False)
        functions = {launch.function for k in step.kernels for launch in k.all_launches()}
        assert all(f.encode() in cubin for f in functions)
        spilling = {f: b for f, b in spills(log).items() if b and f in functions and not f.startswith(("rowwise", "sample"))}
        assert not spilling, f"{name}: fp8 batch kernels spill (bytes stored + loaded): {spilling}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_module_compiles_and_does_not_spill(name):
    """The continuous-batching module of every config (its paged graph in steps of 32 tokens:
    gemm kernels writing the caches through the page tables, the paged attention kernel, logits
    for every token) compiles for sm_90 without spills in its gemm and attention kernels."""
    from fuselm.codegen.build import build_batch
    from fuselm.errors import FuselmError
    cfg = CONFIGS[name]()
    graph = build_graph(cfg)
    if name in PREFILL_UNSUPPORTED:
        with pytest.raises(FuselmError, match=PREFILL_UNSUPPORTED[name]):
            build_batch(graph, min(cfg.max_position_embeddings, 4096), Target(), Tuning(), sizes=(32,), compile=False)
        return
    (step,) = build_batch(graph, min(cfg.max_position_embeddings, 4096), Target(), Tuning(), sizes=(32,),
                          compile=False)
    assert any(k.name.startswith("attention") and "_paged" in k.name for k in step.kernels)
    assert_step_compiles_without_spills(step, f"{name}: batch kernels")


def assert_step_compiles_without_spills(step, what: str) -> None:
    """A step's module compiles for sm_90 with every launch's function in the cubin, no spills
    but in row-wise kernels, and shared memory that fits."""
    cubin, log, _ = compile_cubin(step.source, headers(), options("sm_90", verbose=True), use_cache=False)
    functions = {launch.function for k in step.kernels for launch in k.all_launches()}
    assert all(f.encode() in cubin for f in functions)
    report = spills(log)
    spilling = {f: report[f] for f in functions if report[f] and not f.startswith("rowwise")}
    assert not spilling, f"{what} spill (bytes stored + loaded): {spilling}"
    assert_shared_memory_fits(step.kernels, log)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_row_picks_kernel_compiles_without_spills_at_its_block_size(arch):
    """The batch steps' sampled picks (codegen/sample.py: generate_row_picks; launched by
    runtime/sampling.sample_rows, PICK_THREADS a block): NVRTC builds it, without spills, within
    the registers that let 1024 threads run (64 a thread)."""
    from fuselm.codegen.sample import PICK_THREADS, generate_row_picks
    name, source = generate_row_picks()
    _, log, _ = compile_cubin(source, headers(), options(arch, verbose=True), use_cache=False)
    assert spills(log)[name] == 0, log
    registers = int(re.search(rf"Function properties for {name}.*?Used (\d+) registers", log, re.S).group(1))
    assert registers * PICK_THREADS <= 65536, registers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_steps_ending_a_prompt_compile_and_do_not_spill(name):
    """The prefill steps that end a prompt (the whole graph at each step size, with the logits of
    every token: build.ending_steps) of every config compile for sm_90 without spills in their
    gemm and attention kernels (a MoE's at 256 tokens too: its router's mma.sync tiles take part
    of the tokens a block); a config without prefill has none."""
    from fuselm.codegen.build import ending_steps
    cfg = CONFIGS[name]()
    graph = build_graph(cfg)
    steps = ending_steps(graph, min(cfg.max_position_embeddings, 4096), Target(), Tuning(), list(SIZES))
    expected = [] if name in PREFILL_UNSUPPORTED else list(SIZES)
    assert [s.tokens for s in steps] == expected
    for step in steps:
        assert step.logits and step.G.nodes[step.logits]["shape"][-1] == cfg.vocab_size
        assert_step_compiles_without_spills(step, f"{name}: the kernels of the {step.tokens}-token step ending a prompt")

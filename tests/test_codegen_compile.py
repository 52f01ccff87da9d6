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

import pytest

from fuselm.codegen import generate, headers, module_source, sampler
from fuselm.codegen.nvrtc import compile_cubin, options, spills
from fuselm.compiler import compile_graph
from fuselm.models import ARCHITECTURES, DecoderConfig, build_graph
from fuselm.models.presets import PRESETS, preset
from fuselm.runtime.prefill import SIZES

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
            ks = generate(G, rows=min(cfg.max_position_embeddings, 4096))
            logits = next(iter(G.graph["outputs"].values()))
            made[name, fuse] = ks + [sampler(G.nodes[logits]["shape"][-1])]
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
    assert f"for '{arch}'" in log
    gemv = {launch.function for k in ks if k.family in ("gemv", "attention") for launch in k.all_launches()}
    assert gemv, "no gemv kernel generated"
    spilling = {f: report[f] for f in sorted(gemv) if report[f]}
    if arch == "sm_80" and spilling and max(spilling.values()) <= SM80_TOLERATED_SPILL_BYTES:
        pytest.xfail(f"small sm_80 spills, tolerated: {spilling}")
    assert not spilling, f"{name} {arch}: gemv or attention kernels spill (bytes stored + loaded): {spilling}"


PREFILL_UNSUPPORTED = {"tiny-hidden36": "rows of 36 weights are not a multiple of 32",
                       "tiny-headdim40": "rows of 200 weights are not a multiple of 32"}


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
    G = compile_graph(build_graph(cfg), fuse=fuse, tokens=tokens, state_only=True)
    why = prefill_unsupported(G, tokens)
    if name in PREFILL_UNSUPPORTED:
        assert why and PREFILL_UNSUPPORTED[name] in why
        return
    assert why is None
    ks = generate(G, rows=min(cfg.max_position_embeddings, 4096), tokens=tokens)
    assert {k.family for k in ks} <= {"gemm", "attention", "rowwise", "moe"} and "gemm" in {k.family for k in ks}
    cubin, log, _ = compile_cubin(module_source(ks), headers(), options("sm_90", verbose=True), use_cache=False)
    functions = {launch.function for k in ks for launch in k.all_launches()}
    assert all(f.encode() in cubin for f in functions)
    report = spills(log)
    spilling = {f: report[f] for f in functions if report[f] and not f.startswith("rowwise")}
    assert any(f.startswith("moe") for f in functions) == ("num_local_experts" in cfg.extra)
    assert not spilling, f"{name}: prefill kernels spill: {spilling}"


UNSTAGED_CHECK = """
from fuselm.codegen import generate, headers, module_source
from fuselm.codegen.nvrtc import compile_cubin, options, spills
from fuselm.compiler import compile_graph
from fuselm.models import build_graph
from fuselm.models.presets import preset
normed_splits = []      # gemms with a norm prologue and split-K: the gather adds partial sums
for name in ("smollm2-135m", "llama-3.2-1b"):
    G = compile_graph(build_graph(preset(name)), tokens=64, state_only=True)
    ks = [k for k in generate(G, rows=4096, tokens=64) if k.family == "gemm"]
    assert all(len(k.launches) == 1 and "VectorsFromX<" in k.source and "StagedVectors<" not in k.source
               for k in ks), name
    normed_splits += [k for k in ks if k.name.startswith("gemm_norm") and "splitk_gather<" in k.source]
    assert all(k.source.index("grid_wait_then_release();") < k.source.index("gemm_tile<") for k in ks), name
    _, log, _ = compile_cubin(module_source(ks), headers(), options("sm_90", verbose=True), use_cache=False)
    assert not any(spills(log).values()), (name, spills(log))
assert normed_splits and all(", TT, true, THREADS>(" in k.source for k in normed_splits)
print("ok")
"""


def test_prefill_gemms_compile_without_staging_or_the_early_wait():
    """FUSELM_GEMM_STAGED=0 FUSELM_GEMM_EARLY=0 (read at import: a fresh interpreter) give the
    gemms' other paths: every block converting its own vectors (a norm prologue's partial sums of
    squares added by the split-K gather) and waiting for the previous kernel first; one launch
    per kernel, and the modules compile for sm_90 without spills."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "FUSELM_GEMM_STAGED": "0", "FUSELM_GEMM_EARLY": "0"}
    done = subprocess.run([sys.executable, "-c", UNSTAGED_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


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
            cubin, _, _ = compile_cubin(module_source(generate(G, rows=rows)), headers(),
                                        options("sm_90"), use_cache=False)
            assert cubin[:4] == b"\x7fELF"

    check()


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
        generate(G, rows=64)


def test_attention_head_dim_over_256_is_a_clear_error():
    from fuselm.errors import FuselmError
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=512,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                                     num_key_value_heads=1, head_dim=512))
    with pytest.raises(FuselmError, match=r"attention_\d+: head_dim 512 > 256 is not supported"):
        generate(compile_graph(build_graph(cfg)), rows=64)


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
        generate(compile_graph(g, tokens=1), rows=16)


def test_attention_falls_back_to_fewer_warps_where_shared_memory_is_short():
    """Eight query heads of 256 per KV head: eight warps' softmax states would need more than 48 kB
    of shared memory, so both attention kernels run four, and the module still compiles."""
    from fuselm.codegen.attention import SINGLE_WARPS, WARPS, single_warps, split_warps
    assert single_warps(128, 4) == SINGLE_WARPS == 8 and split_warps(128, 4) == WARPS == 8
    assert single_warps(256, 8) == split_warps(256, 8) == 4
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=256,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
                                     num_key_value_heads=1, head_dim=256))
    ks = generate(compile_graph(build_graph(cfg)), rows=512)
    (att,) = [k for k in ks if k.family == "attention"]
    (single,) = att.launches_of("single")
    split, _ = att.launches_of("general")
    assert single.block == split.block == 32 * 4 and att.variants[0].until > 0
    cubin, _, _ = compile_cubin(module_source(ks), headers(), options("sm_90"), use_cache=False)
    assert single.function.encode() in cubin and split.function.encode() in cubin


@pytest.mark.parametrize("warps", [None, 12])
def test_the_wide_split_takes_over_where_the_split_outgrows_one_wave(warps, monkeypatch):
    """Llama-3.2-1B (8 KV heads, chunks of 256): from position 16 x 256 = 4096 the split would
    launch more blocks than the H200's 132 SMs, so up to 16 x 288 (the default, 9 warps: chunks of
    288) or 16 x 384 (12 warps) the wide split and its
    combine run instead; between the one-launch attention and 4096 the split as before, and past
    the wide split's range too (a longer context). SmolLM2's 3 KV heads fit in one wave up to 44
    chunks: no wide split at 4608 rows. FUSELM_ATTN_WIDE_WARPS=0 turns it off. The module
    compiles, the wide kernels without spills."""
    from fuselm.codegen import attention
    if warps:
        monkeypatch.setattr(attention, "WIDE_WARPS", warps)
    warps = attention.WIDE_WARPS
    if warps not in (9, 12) or attention.SMS != 132:
        pytest.skip("FUSELM_ATTN_WIDE_WARPS or FUSELM_SMS set to a value this test does not cover")
    chunk = 32 * warps                       # head size 64: 32 positions per warp (MmaPass)
    graph = build_graph(preset("llama-3.2-1b"))
    for rows in (4608, 8192):
        until = min(16 * chunk, rows)
        ks = generate(compile_graph(graph), rows=rows)
        (att, *_) = [k for k in ks if k.family == "attention"]
        assert [(v.name, v.until) for v in att.variants] == [("single", 512), ("split", 4096), ("wide", until)]
        assert [l.function for l in att.launches_at(4095)] == [f"{att.name}_split", f"{att.name}_combine"]
        split, combine = att.launches_at(4096)
        assert (split.function, combine.function) == (f"{att.name}_split_wide", f"{att.name}_combine_wide")
        assert split.grid == (8, -(-rows // chunk)) and split.block == warps * 32
        assert att.launches_at(until) == att.launches
    cubin, log, _ = compile_cubin(module_source(ks), headers(), options("sm_90", verbose=True), use_cache=False)
    assert split.function.encode() in cubin and not spills(log).get(split.function)
    smol = generate(compile_graph(build_graph(preset("smollm2-135m"))), rows=4608)
    assert [v.name for k in smol for v in k.variants] == ["single"] * 30
    monkeypatch.setattr(attention, "WIDE_WARPS", 0)
    assert not any(v.name == "wide" for k in generate(compile_graph(graph), rows=4608) for v in k.variants)


def test_gemv_epilogue_operands_are_loaded_before_the_dot_products_where_the_schedule_allows(monkeypatch):
    """Llama-3.2-1B: the O and down projections load their residual, and the Q/K/V GEMVs of layers
    1 on the position for RoPE and the cache row, before the weight loop (plan_early_reads), through
    L2; layer 0's Q/K/V, with no GEMV ahead of it in the step, reads the position after its wait as
    before; gate/up and the LM head have no such operand. FUSELM_GEMV_EARLY_READS=0 turns it off.
    The module compiles without spills."""
    from fuselm.codegen import gemv
    graph = compile_graph(build_graph(preset("llama-3.2-1b")))
    ks = [k for k in generate(graph, rows=512) if k.family == "gemv"]
    early = {}
    for k in ks:
        lines = [line.strip() for line in k.source.splitlines() if "__ldcg(" in line]
        assert all(line.startswith("const ") for line in lines), lines     # declarations ahead of the loop
        early.setdefault(k.name.rsplit("_", 1)[0], set()).add(len(lines))
    assert early == {"gemv_norm_k2048_1x2048_1x512_1x512": {0, 4}, "gemv_k2048_1x2048": {1}, "gemv_k8192_1x2048": {1},
                     "gemv_norm_k2048_2x8192": {0}, "gemv_norm_k2048_1x128256": {0}}, early
    qkv0, qkv1 = ks[0], ks[4]                         # launch order: Q/K/V, O, gate/up, down per layer
    assert "__ldcg(" not in qkv0.source and qkv1.source.count("__ldcg(") == 4
    cubin, log, _ = compile_cubin(module_source(generate(graph, rows=512)), headers(), options("sm_90", verbose=True),
                                  use_cache=False)
    assert not any(spills(log).values()), spills(log)
    monkeypatch.setattr(gemv, "EARLY_READS", 0)
    assert not any("__ldcg(" in k.source for k in generate(graph, rows=512))


def test_only_few_block_kernels_release_their_successor_before_waiting():
    """Row-wise kernels and attention split + combine (a block per row, per KV head and chunk, per
    query head) let the next kernel be scheduled before they wait, at the top of the entry point
    (after the block-timeline hook, a no-op unless FUSELM_TRACE=1); the one-launch attention,
    GEMVs and the sampler only after their wait."""
    import re
    ks = generate(compile_graph(build_graph(preset("qwen3-8b"))), rows=4608) + [sampler(151936)]
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


@pytest.mark.parametrize("env,message", [
    ({"FUSELM_EARLY_RELEASE": "rowwise,bogus"}, "FUSELM_EARLY_RELEASE=rowwise,bogus: unknown kernel kinds ['bogus']"),
    ({"FUSELM_GEMV_WARPS": "3"}, "FUSELM_GEMV_WARPS=3: warps per GEMV block must be a power of 2 from 1 to 32"),
    ({"FUSELM_ATTN_MMA": "split,combine"}, "FUSELM_ATTN_MMA=split,combine: unknown kernels ['combine']"),
    ({"FUSELM_ATTN_COMBINE_GROUP": "0"}, "FUSELM_ATTN_COMBINE_GROUP=0: must be 1 to 64"),
    ({"FUSELM_ATTN_WARPS": "64"}, "FUSELM_ATTN_WARPS=64: must be 1 to 32"),
    ({"FUSELM_GEMM_BLOCKS": "lots"}, "FUSELM_GEMM_BLOCKS=lots: must be an integer from 1 to 65536")])
def test_a_bad_codegen_knob_is_a_one_line_error_at_import(env, message):
    """The experiment knobs are read when fuselm.codegen is imported; a bad value stops it there."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import fuselm.codegen"], capture_output=True, text=True,
                       env={**os.environ, **env})
    assert r.returncode != 0 and message in r.stderr.strip().splitlines()[-1]


def test_attention_passes_run_on_tensor_cores_where_they_fit():
    """Head sizes 64 and 128 with at most 8 query heads per KV head get MmaPass (both the split and
    the one-launch kernel, by default; the wide split's with its V rows after the queries, LATE_V);
    other layouts LanePass. Under FUSELM_ATTN_MMA=0 every kernel uses LanePass; its chunk
    (positions per split block) is MmaPass's wherever its lanes hold 8 rows (up to 4 query heads
    per KV head). FUSELM_ATTN_LATE_V=split,wide defers the split's V rows too, 0 neither's."""
    import os
    import subprocess
    import sys

    from fuselm.codegen.attention import split_pass, pass_of, single_pass
    assert split_pass(64, 4, kv=8) == ("MmaPass<8, 64, 8, 4>", 256)
    assert split_pass(128, 7, kv=4) == ("MmaPass<4, 128, 8, 7>", 128)
    assert single_pass(128, 4, kv=8)[0] == "MmaPass<8, 128, 8, 4>"
    assert split_pass(256, 2, kv=8)[0].startswith("LanePass<8, 256, 8, ")
    assert split_pass(64, 12, kv=4) == ("LanePass<4, 64, 8, 2, 12>", 64)
    assert pass_of("split", 8, 6, 2, 4, 8)[0].startswith("LanePass<")
    source = "\n".join(k.source for k in generate(compile_graph(build_graph(preset("llama-3.2-1b"))), rows=4608))
    assert "attention_chunk<32, 8, 64, MmaPass<8, 64, 8, 4>, 18>" in source
    assert "attention_chunk<32, 8, 64, MmaPass<8, 64, 9, 4, true>, 16>" in source     # the wide split
    assert "attention_single<32, 8, 64, MmaPass<8, 64, 8, 4>>" in source
    code = ("from fuselm.codegen.attention import split_pass, single_pass; "
            "print([split_pass(h, g, 1) for h, g in ((64, 4), (128, 4), (64, 3), (128, 7))], single_pass(64, 4, 1)[0])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "FUSELM_ATTN_MMA": "0"}, check=True)
    assert r.stdout.strip() == ("[('LanePass<1, 64, 8, 8, 4>', 256), ('LanePass<1, 128, 8, 8, 4>', 128), "
                                "('LanePass<1, 64, 8, 8, 3>', 256), ('LanePass<1, 128, 8, 4, 7>', 64)] "
                                "LanePass<1, 64, 8, 4, 4>")
    code = "from fuselm.codegen.attention import split_pass, wide_split; print(split_pass(64, 4, 8), wide_split(64, 4, 8)['pass'])"
    for late, printed in (("split,wide", "('MmaPass<8, 64, 8, 4, true>', 256) MmaPass<8, 64, 9, 4, true>"),
                          ("0", "('MmaPass<8, 64, 8, 4>', 256) MmaPass<8, 64, 9, 4>")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "FUSELM_ATTN_LATE_V": late}, check=True)
        assert r.stdout.strip() == printed


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
    kernels = generate(G, rows=min(cfg.max_position_embeddings, 4096)) + [sampler(G.nodes[logits]["shape"][-1])]
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
            check_prefill_arguments(P, generate(P, rows=min(cfg.max_position_embeddings, 4096), tokens=tokens))


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

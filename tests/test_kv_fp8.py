"""The fp8 KV cache on the CPU: the reference's e4m3 rounding and scale rule, the kv dtype's
plumbing (API, CLI, engines, errors naming the parameter), the cache layout and its bytes, the
memory check with a faked free figure, and the kernels it generates (names, NVRTC for sm_90)."""
from __future__ import annotations

import numpy as np
import pytest

from fuselm.codegen import Target, Tuning, headers
from fuselm.codegen.build import build_program, prefill_steps
from fuselm.codegen.kv_cache import CacheLayout, graph_kv_bytes
from fuselm.codegen.nvrtc import compile_cubins, options, spills
from fuselm.dsl.kv_dtype import (KvDtypeError, e4m3_codes, e4m3_values, fp8_round_trip, quantize_heads,
                                 with_kv_dtype)
from fuselm.errors import FuselmError
from fuselm.models import ARCHITECTURES, DecoderConfig, build_graph
from fuselm.models.presets import PRESETS, preset

# value -> e4m3 (fn) bits: exact values, ties to even, subnormals, saturation, signs
E4M3_TABLE = [
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-0.5, 0xB0), (448.0, 0x7E), (-448.0, 0xFE),
    (500.0, 0x7E), (1e6, 0x7E), (-1e6, 0xFE),            # saturated, as cvt.satfinite does
    (2.0 ** -6, 0x08), (2.0 ** -9, 0x01), (7 * 2.0 ** -9, 0x07),
    (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02),          # ties between subnormals: to even
    (1.0625, 0x38), (1.1875, 0x3A), (1.125, 0x39),       # ties between normals: to even mantissa
    (240.0, 0x77), (232.0, 0x76), (1.0 + 2 ** -20, 0x38), (1.0625 + 2 ** -20, 0x39),
    (float("nan"), 0x7F),
]


@pytest.mark.parametrize("value,bits", E4M3_TABLE)
def test_e4m3_rounding_of_known_values(value, bits):
    assert int(e4m3_codes(np.float32([value]))[0]) == bits


def test_e4m3_rounding_matches_ml_dtypes_and_every_code_round_trips():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    codes = np.arange(256, dtype=np.uint8)
    values = e4m3_values(codes)
    finite = ~np.isnan(values)
    assert (e4m3_codes(values[finite]) == codes[finite]).all()
    mids = ((values[1:126] + values[:125]) / 2).astype(np.float32)     # every tie between neighbours
    rng = np.random.default_rng(0)
    x = np.concatenate([mids, -mids] + [rng.standard_normal(20000).astype(np.float32) * s
                                        for s in (1e-3, 0.05, 1.0, 60.0)])
    x = x[np.abs(x) <= 448]                 # beyond, ml_dtypes gives NaN where we saturate
    assert (e4m3_codes(x) == x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)).all()


def test_quantize_heads_scales_each_token_and_head_by_its_amax():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 3 * 16)) * np.array([1e-3, 1.0, 50.0]).repeat(16)).astype(np.float32)
    x[2, 16:32] = 0.0                                   # an all-zero head: scale 0, codes 0
    codes, scales = quantize_heads(x, 16)
    xh = x.reshape(5, 3, 16)
    assert scales.shape == (5, 3) and scales.dtype == np.float32
    np.testing.assert_array_equal(scales, (np.abs(xh).max(-1) / np.float32(448)).astype(np.float32))
    assert scales[2, 1] == 0 and (codes.reshape(5, 3, 16)[2, 1] == 0).all()
    top = np.abs(e4m3_values(codes)).reshape(5, 3, 16).max(-1)
    assert np.all((top == 448) | (scales == 0))           # every other head reaches the largest code
    back = fp8_round_trip(x, 16).reshape(5, 3, 16)
    amax = np.abs(xh).max(-1, keepdims=True)
    # relative 2^-4 for normal codes, plus half a subnormal step of the head's grid
    assert np.all(np.abs(back - xh) <= np.abs(xh) / 16 + amax / 448 * 2.0 ** -10 + 1e-30)


def test_the_reference_kv_write_stores_what_an_fp8_cache_holds():
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64,
                                     intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64))
    from fuselm.runtime.cpu_engine import CpuEngine
    graph = build_graph(cfg)
    rng = np.random.default_rng(2)
    weights = {n.name: (1 + 0.1 * rng.standard_normal(n.shape) if len(n.shape) == 1
                        else 0.1 * rng.standard_normal(n.shape)).astype(np.float32) for n in graph.sources("weight")}
    ids = rng.integers(0, 64, 12).tolist()
    logits = {}
    for kv in ("bf16", "fp8"):
        eng = CpuEngine(graph, weights, 64, kv=kv)
        logits[kv] = eng.logits_of(ids)
        cache = eng.state["cache.0.k"][:12]
        if kv == "fp8":   # every row is its own fp8 round trip: a fixed point of quantization
            np.testing.assert_array_equal(cache, fp8_round_trip(cache, 16))
            assert not np.array_equal(cache, plain_k)
        else:
            plain_k = cache.copy()
    err = np.linalg.norm(logits["fp8"] - logits["bf16"]) / np.linalg.norm(logits["bf16"])
    assert 0 < err < 0.05, err


def test_with_kv_dtype_marks_every_cache_write_with_its_head_size():
    graph = build_graph(preset("smollm2-135m"))
    assert with_kv_dtype(graph, "bf16") is graph
    g = with_kv_dtype(graph, "fp8")
    writes = [n for n in g.nodes.values() if n.op == "kv_write"]
    assert len(writes) == 60 and all(n.attrs["kv"] == "fp8" and n.attrs["head_dim"] == 64 for n in writes)
    assert all("kv" not in n.attrs for n in graph.nodes.values() if n.op == "kv_write")   # a copy


@pytest.mark.parametrize("call", ["dsl", "api", "cpu_engine", "build"])
def test_a_bad_kv_dtype_is_refused_naming_the_parameter(call, tmp_path):
    graph = build_graph(preset("smollm2-135m"))
    choices = "bf16, fp8, auto" if call == "api" else "bf16, fp8"   # the API takes "auto" too
    with pytest.raises(KvDtypeError, match=rf"^kv must be one of {choices}, got 'fp16'$") as e:
        if call == "dsl":
            with_kv_dtype(graph, "fp16")
        elif call == "api":
            import fuselm.api
            fuselm.api.load(str(tmp_path), kv="fp16")
        elif call == "cpu_engine":
            from fuselm.runtime.cpu_engine import CpuEngine
            CpuEngine(graph, {}, 16, kv="fp16")
        else:
            build_program(graph, 64, compile=False, kv="fp16")
    assert e.value.param == "kv"


def test_auto_takes_fp8_beyond_8192_positions(tmp_path):
    """kv="auto": bf16 up to AUTO_FP8_FROM positions, fp8 beyond; the engine fuselm.load makes
    gets what it resolves to."""
    import json

    from tiny_files import TINY, write_tiny_folder

    import fuselm
    from fuselm.dsl.kv_dtype import AUTO_FP8_FROM, resolve_kv

    assert [resolve_kv("auto", n) for n in (1, AUTO_FP8_FROM, AUTO_FP8_FROM + 1)] == ["bf16", "bf16", "fp8"]
    assert resolve_kv("bf16", 10 ** 6) == "bf16" and resolve_kv("fp8", 16) == "fp8"
    folder = write_tiny_folder(tmp_path)
    (folder / "config.json").write_text(json.dumps({**TINY, "max_position_embeddings": AUTO_FP8_FROM + 64}))
    assert fuselm.load(folder, device="cpu", ctx=64, kv="auto", progress=False).engine.kv_dtype == "bf16"
    assert fuselm.load(folder, device="cpu", ctx=AUTO_FP8_FROM + 1, kv="auto", progress=False).engine.kv_dtype == "fp8"


def test_the_cli_takes_kv_and_refuses_other_values(capsys):
    from fuselm.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(["run", "-p", "x", "--kv", "fp8"]).kv == "fp8"
    assert parser.parse_args(["run", "-p", "x"]).kv == "bf16"
    assert parser.parse_args(["bench", "--kv", "fp8", "--positions", "1024,4096"]).kv == "fp8"
    assert parser.parse_args(["run", "-p", "x", "--kv", "auto"]).kv == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "-p", "x", "--kv", "int8"])
    assert "--kv" in capsys.readouterr().err


def test_fp8_cache_rows_and_bytes():
    lay = CacheLayout("fp8", 1024, 128)               # Llama-3.1-8B: 8 KV heads of 128
    assert (lay.scale_at, lay.stride, lay.c_type) == (1024, 1056, "KvFp8<1056, 1024>")
    assert CacheLayout("fp8", 192, 64).stride == 224   # SmolLM2: 192 codes + 12 scale bytes, to 32
    assert CacheLayout("fp8", 6, 6).scale_at == 8
    g8 = build_graph(preset("llama-3.1-8b"))
    assert graph_kv_bytes(g8, 131072, "bf16") == 131072 * 32 * 2 * 1024 * 2
    assert graph_kv_bytes(g8, 131072, "fp8") == 131072 * 32 * 2 * 1056
    assert graph_kv_bytes(g8, 131072, "fp8") <= 9 * 2**30    # issue 28: 128k of the 8B in <= 9 GiB


def test_a_context_that_does_not_fit_is_refused_with_what_it_needs_and_what_is_free():
    """The check runs before any upload; the free figure is faked, so no GPU is needed."""
    import cupy
    from fuselm.runtime.cuda_engine import check_device_memory
    graph = build_graph(preset("llama-3.1-8b"))
    check_device_memory(cupy, graph, 131072, kv="fp8", free=24 * 2**30)        # 15 + 8.25 GiB fit
    with pytest.raises(FuselmError) as e:
        check_device_memory(cupy, graph, 131072, kv="bf16", free=24 * 2**30)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("the model needs 31.0 GiB of GPU memory (weights 15.0 GiB, a KV cache of 131072 "
                          "tokens in bf16 16.0 GiB) but ")
    assert msg.endswith("has 24.0 GiB free; lower --ctx to at most 74075")
    with pytest.raises(FuselmError, match=r"a KV cache of 131072 tokens in fp8 8\.2 GiB.* 20\.0 GiB free; "
                                          r"lower --ctx to at most 80112$"):
        check_device_memory(cupy, graph, 131072, kv="fp8", free=20 * 2**30)


def _program(name: str, kv: str = "fp8", **kw):
    cfg = preset(name)
    return build_program(build_graph(cfg), ctx=min(cfg.max_position_embeddings, 4096), compile=False, kv=kv, **kw)


def test_fp8_kernels_say_so_in_their_names_and_bf16_ones_do_not_change():
    fp8, bf16 = _program("llama-3.2-1b"), _program("llama-3.2-1b", kv="bf16")
    names = [k.name for k in fp8.decode.kernels]
    assert any(n.startswith("attention_h32_kv8_d64_fp8_") for n in names)
    assert any("_kvfp8_" in n and n.startswith("gemv_norm_") for n in names)
    assert any("_kvfp8_t" in k.name for k in fp8.prefill[0].kernels)
    assert not any("fp8" in k.name for s in bf16.steps() for k in s.kernels)
    assert "KvFp8<" in fp8.decode.source and "KvFp8<" not in bf16.decode.source
    # the caches' kernel arguments are bytes in fp8, bf16 values otherwise
    assert "unsigned char* p" in fp8.decode.source


def test_fp8_needs_sm89():
    """Refused for older GPUs by the decode attention, and by the flash prefill built alone."""
    with pytest.raises(FuselmError, match="an fp8 KV cache needs sm_89 or later"):
        _program("smollm2-135m", target=Target(arch="sm_80"))
    refused = prefill_steps(with_kv_dtype(build_graph(preset("smollm2-135m")), "fp8"), 512, Target(arch="sm_80"), Tuning())
    assert isinstance(refused, str) and "an fp8 KV cache needs sm_89 or later" in refused, refused


def test_fp8_prefill_takes_flash_attention():
    """fp8 caches' prefill steps read the cache in flash attention's tiles (fp8_tile_to_bf16), as
    bf16 caches' do, not in the decode-style pass."""
    program = _program("llama-3.2-1b")
    for step in program.prefill:
        names = [k.name for k in step.kernels if k.family == "attention"]
        assert names and all(n.startswith("attention_h32_kv8_d64_fp8_flash_") for n in names), names
        assert all("KvFp8<" in k.source for k in step.kernels if k.name in names)


SUPPORTED_PRESETS = [n for n, d in PRESETS.items() if d["architectures"][0] in ARCHITECTURES]


@pytest.mark.parametrize("name", SUPPORTED_PRESETS)
def test_every_presets_fp8_modules_compile_for_sm90(name):
    """Decode and every prefill step size, fp8 KV, through NVRTC without a GPU; no spills in the
    attention and GEMV kernels."""
    program = _program(name)
    sources = [s.source for s in program.steps()]
    assert len(sources) >= 2, program.prefill_refused
    for cubin, log, _ in compile_cubins(sources, headers(), options("sm_90", verbose=True), use_cache=False):
        assert cubin
        bad = {f: n for f, n in spills(log).items() if n and f.startswith(("attention", "gemv"))}
        assert not bad, bad

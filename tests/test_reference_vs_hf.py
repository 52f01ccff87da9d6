"""The numpy reference executor (models.build_graph + runtime.reference.run_graph) against Hugging
Face transformers (torch CPU, float32) on tiny random Llama and Mistral models.

Each case: a prompt of T tokens (logits of every row), then single-token decode steps through the
KV cache on both sides. Pass/fail bound: ||ours - hf|| / ||hf|| < 1e-4 per step. The worst relative
error per kind of config is printed at the end of the module (pytest -s shows it).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

TOL = 1e-4
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_worst():
    yield
    if WORST:
        print("\nworst relative error of the reference executor vs transformers (float32):")
        for kind, err in sorted(WORST.items()):
            print(f"  {kind:<28} {err:.2e}")
        print(f"  {'ALL':<28} {max(WORST.values()):.2e}")


def record(kind: str, err: float) -> None:
    """Keep the worst error of each kind for the summary printed at the end of the module."""
    WORST[kind] = max(WORST.get(kind, 0.0), err)


def compare(h, model, weights, cfg, prompt, steps, kind) -> list[float]:
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    ours = h.ours_prefill_then_decode(cfg, weights, prompt, steps)
    assert ours[0].shape == (len(prompt), cfg.vocab_size)
    assert all(o.shape == (1, cfg.vocab_size) for o in ours[1:])
    assert float(np.std(theirs[0])) > 0.1, "logits nearly constant: the comparison proves little"
    errs = [h.rel_err(o, t) for o, t in zip(ours, theirs)]
    record(kind, max(errs))
    assert max(errs) < TOL, f"{kind}: relative errors per step {errs}"
    return errs


# ---- configs ---------------------------------------------------------------------------------------

@st.composite
def llama_case(draw):
    kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3]))
    heads = kv * group
    hd = draw(st.sampled_from([2, 4, 6, 8, 10, 16]))
    explicit_hd = draw(st.booleans())
    # transformers wants hidden % heads == 0 even with head_dim given; the width per head may be odd
    per_head = draw(st.integers(2, 13).filter(lambda m: m != hd)) if explicit_hd else hd
    hidden = heads * per_head
    rope = draw(st.sampled_from(["none", "linear", "llama3"]))
    scaling = {"none": None,
               "linear": {"rope_type": "linear", "factor": draw(st.sampled_from([2.0, 4.0]))},
               "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}[rope]
    kw = dict(
        vocab_size=draw(st.integers(17, 70)), hidden_size=hidden,
        intermediate_size=draw(st.integers(5, 50)), num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads, num_key_value_heads=kv,
        tie_word_embeddings=draw(st.booleans()),
        rope_theta=draw(st.sampled_from([10000.0, 500000.0, 100.0])),
        rms_norm_eps=draw(st.sampled_from([1e-5, 1e-6])), rope_scaling=scaling)
    if explicit_hd:
        kw["head_dim"] = hd
    attn = "MHA" if group == 1 else "MQA" if kv == 1 else "GQA"
    return kw, attn, rope


def kind_of(kw, attn, rope):
    tied = "tied" if kw["tie_word_embeddings"] else "untied"
    hd = "head_dim given" if "head_dim" in kw else "head_dim=D/H"
    return [f"llama {attn}", f"llama {tied}", f"llama rope {rope}", f"llama {hd}"]


@given(case=llama_case(), prompt_len=st.integers(1, 7), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60)
def test_llama_vs_transformers(h, case, prompt_len, seed):
    kw, attn, rope = case
    model, weights, cfg = h.make_hf_model("LlamaForCausalLM", seed=seed, **kw)
    assert cfg.head_dim == kw.get("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    assert ("lm_head.weight" in weights) != cfg.tie_word_embeddings
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, kw["vocab_size"], prompt_len).tolist()
    steps = rng.integers(0, kw["vocab_size"], 3).tolist()
    errs = compare(h, model, weights, cfg, prompt, steps, f"llama {attn}")
    for kind in kind_of(kw, attn, rope):
        record(kind, max(errs))


@given(kv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]), hd=st.sampled_from([4, 6, 8]),
       layers=st.integers(1, 3), window=st.integers(2, 5), extra=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_mistral_sliding_window_vs_transformers(h, kv, group, hd, layers, window, extra, seed):
    """Mistral with a sliding window shorter than the sequence, in the prompt and in decode.

    transformers masks key j for query i unless i - window < j <= i (masking_utils'
    sliding_window_overlay: kv_idx > q_idx - sliding_window), i.e. each token sees itself and the
    window - 1 before it; its DynamicSlidingWindowLayer keeps window - 1 rows of cache.
    """
    heads = kv * group
    kw = dict(vocab_size=41, hidden_size=heads * hd + 3, head_dim=hd, intermediate_size=29,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              sliding_window=window, rope_theta=10000.0)
    model, weights, cfg = h.make_hf_model("MistralForCausalLM", seed=seed, **kw)
    assert cfg.sliding_window == window
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 41, window + extra).tolist()
    steps = rng.integers(0, 41, 3).tolist()
    errs = compare(h, model, weights, cfg, prompt, steps, "mistral sliding window")
    # the window matters here: without it, fuselm's own logits move far beyond the tolerance
    unwindowed = h.ours_prefill_then_decode(dataclasses.replace(cfg, sliding_window=None),
                                            weights, prompt, steps)
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    moved = max(h.rel_err(o, t) for o, t in zip(unwindowed, theirs))
    assert moved > 100 * max(max(errs), TOL / 100), (moved, errs)


def test_longer_llama_decode_vs_transformers(h):
    """One fixed GQA + llama3 case decoding well past original_max_position_embeddings."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    model, weights, cfg = h.make_hf_model(
        "LlamaForCausalLM", seed=7, vocab_size=64, hidden_size=36, head_dim=8, intermediate_size=45,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=scaling, tie_word_embeddings=True)
    rng = np.random.default_rng(7)
    compare(h, model, weights, cfg, rng.integers(0, 64, 12).tolist(), rng.integers(0, 64, 12).tolist(),
            "llama long decode (24 pos)")


# ---- biases (once known gaps, now supported) -----------------------------------------------------

@pytest.mark.parametrize("flag,bias", [("attention_bias", "self_attn.o_proj.bias"),   # Q, K, V and O
                                       ("mlp_bias", "mlp.down_proj.bias")])        # gate, up and down
def test_llama_biases_vs_transformers(h, flag, bias):
    """Llama's optional biases, as transformers adds them."""
    model, weights, cfg = h.make_hf_model(
        "LlamaForCausalLM", seed=3, vocab_size=30, hidden_size=16, intermediate_size=20,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, **{flag: True})
    assert f"model.layers.0.{bias}" in weights
    compare(h, model, weights, cfg, [1, 2, 3, 4], [5], f"llama {flag}")


def test_llama_hidden_act_vs_transformers(h):
    """A Llama config's hidden_act is the MLP's activation (here GELU, tanh form), as in transformers."""
    model, weights, cfg = h.make_hf_model(
        "LlamaForCausalLM", seed=5, vocab_size=30, hidden_size=16, intermediate_size=20,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh")
    compare(h, model, weights, cfg, [1, 2, 3, 4], [5], "llama hidden_act")


def test_from_hf_reads_rope_parameters():
    import transformers

    from fuselm.models import DecoderConfig, rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=256,
                                  num_attention_heads=2, rope_theta=500000.0, rope_scaling=scaling,
                                  max_position_embeddings=131072)
    d = hf.to_dict()                                  # what save_pretrained writes
    assert "rope_parameters" in d
    cfg = DecoderConfig.from_hf(d)
    expect = DecoderConfig.from_hf({**d, "rope_scaling": scaling})
    assert cfg.rope_theta == 500000.0
    np.testing.assert_allclose(rope_inv_freq(cfg), rope_inv_freq(expect), rtol=1e-6)

"""Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Mixtral, OLMo 2 and SmolLM3: the reference executor against transformers
(torch CPU, float32) on tiny random configs, and every new architecture's graph through the
compiler, the code generator and NVRTC.

Each case feeds a prompt (logits of every row) and then single-token decode steps through the KV
cache on both sides; bound ||ours - hf|| / ||hf|| < 1e-4 per step. The worst relative error per
architecture is printed at the end of the module (pytest -s shows it). Every case also checks
that the graph reads exactly the weights the HF model has (a bias or norm we forgot shows).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hub_names import expert_checkpoint_names, mixtral_checkpoint_names
from hypothesis import assume, given, settings, strategies as st

TOL = 1e-4
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_worst():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)    # tiny matrices: 2 threads made each case ~40x slower on CI's 2 cores
    yield
    torch.set_num_threads(threads)
    if WORST:
        print("\nworst relative error of the reference executor vs transformers (float32):")
        for kind, err in sorted(WORST.items()):
            print(f"  {kind:<34} {err:.2e}")


def hf_config_class(arch: str):
    """transformers' config class of a CausalLM class (Gemma 3's text model has its own)."""
    import transformers

    return getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(arch, arch.replace("ForCausalLM", "Config")))


MOE = {"MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"}


def hf_model(h, arch: str, seed: int, **kw):
    """A tiny float32 HF model of `arch` with random weights; its weights under checkpoint names
    (what the Hub's safetensors files hold) and fuselm's DecoderConfig from its config dict."""
    import torch
    import transformers

    from fuselm.models import DecoderConfig

    hf_cfg = hf_config_class(arch)(architectures=[arch], attn_implementation="eager", **kw)
    if arch in MOE:
        hf_cfg._experts_implementation = "eager"   # torch._grouped_mm wants 16-byte strides
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_cfg).eval()
    h.randomize_(model, seed)
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if arch == "MixtralForCausalLM":
        weights = mixtral_checkpoint_names(weights, hf_cfg.intermediate_size)
    if arch == "Qwen3MoeForCausalLM":
        weights = expert_checkpoint_names(weights, hf_cfg.moe_intermediate_size)
    return model, weights, DecoderConfig.from_hf(hf_cfg.to_dict(), source=f"tiny {arch}")


def compare(h, model, weights, cfg, prompt, steps, kind, graph=None) -> float:
    from fuselm.models import build_graph

    graph = graph or build_graph(cfg)
    used = {n.name for n in graph.sources("weight")}
    assert used == set(weights), f"graph reads {sorted(used - set(weights))}, ignores {sorted(set(weights) - used)}"
    for n in graph.sources("weight"):
        assert n.shape == weights[n.name].shape, (n.name, n.shape, weights[n.name].shape)
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    ours = h.ours_prefill_then_decode(cfg, weights, prompt, steps, graph=graph)
    assert float(np.std(theirs[0])) > 0.1, "logits nearly constant: the comparison proves little"
    errs = [h.rel_err(o, t) for o, t in zip(ours, theirs)]
    WORST[kind] = max(WORST.get(kind, 0.0), max(errs))
    assert max(errs) < TOL, f"{kind}: relative errors per step {errs}"
    return max(errs)


def tokens(seed: int, vocab: int, prompt_len: int, steps: int = 3):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, prompt_len).tolist(), rng.integers(0, vocab, steps).tolist()


def check_windows_without_layer_types(model, cfg):
    """An older config.json has no layer_types: the architecture's own rule must give the same
    per-layer windows as transformers' config.layer_types."""
    from fuselm.models.layers import layer_windows

    extra = {k: v for k, v in cfg.extra.items() if k != "layer_types"}
    old = dataclasses.replace(cfg, extra=extra)
    windows = [a.attrs["window"] for a in build_graph_of(old).nodes.values() if a.op == "attention"]
    expect = [cfg.sliding_window if t == "sliding_attention" else 0 for t in model.config.layer_types]
    assert windows == layer_windows(cfg) == [w or 0 for w in expect]


def build_graph_of(cfg):
    from fuselm.models import build_graph
    return build_graph(cfg)


# ---- Qwen2 / Qwen2.5 -------------------------------------------------------------------------------

@st.composite
def gqa(draw, hds=(2, 4, 6, 8)):
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    return heads, kv, draw(st.sampled_from(hds))


@given(shape=gqa(), layers=st.integers(1, 3), tied=st.booleans(), sliding=st.booleans(),
       window=st.integers(2, 4), first_sliding=st.integers(0, 3), prompt_len=st.integers(1, 7),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=50)
def test_qwen2_vs_transformers(h, shape, layers, tied, sliding, window, first_sliding, prompt_len, seed):
    heads, kv, hd = shape
    kw = dict(vocab_size=53, hidden_size=heads * hd, intermediate_size=37, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
              rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=sliding,
              sliding_window=window, max_window_layers=first_sliding)
    model, weights, cfg = hf_model(h, "Qwen2ForCausalLM", seed, **kw)
    assert "model.layers.0.self_attn.q_proj.bias" in weights
    assert "model.layers.0.self_attn.o_proj.bias" not in weights
    check_windows_without_layer_types(model, cfg)
    compare(h, model, weights, cfg, *tokens(seed, 53, prompt_len), "qwen2")


# ---- Qwen3 -----------------------------------------------------------------------------------------

@given(shape=gqa(), per_head=st.integers(2, 9), layers=st.integers(1, 3), bias=st.booleans(),
       tied=st.booleans(), sliding=st.booleans(), window=st.integers(2, 4),
       first_sliding=st.integers(0, 3), prompt_len=st.integers(1, 7), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=50)
def test_qwen3_vs_transformers(h, shape, per_head, layers, bias, tied, sliding, window, first_sliding,
                               prompt_len, seed):
    heads, kv, hd = shape     # head_dim explicit, independent of hidden / heads
    kw = dict(vocab_size=47, hidden_size=heads * per_head, head_dim=hd, intermediate_size=31,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              attention_bias=bias, tie_word_embeddings=tied, rope_theta=1000000.0,
              use_sliding_window=sliding, sliding_window=window, max_window_layers=first_sliding)
    model, weights, cfg = hf_model(h, "Qwen3ForCausalLM", seed, **kw)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (hd,)
    check_windows_without_layer_types(model, cfg)
    compare(h, model, weights, cfg, *tokens(seed, 47, prompt_len), "qwen3")


def test_qwen3_qk_norm_matters(h):
    """Dropping the per-head Q/K norms moves the logits far beyond the tolerance."""
    from fuselm.models import llama

    model, weights, cfg = hf_model(h, "Qwen3ForCausalLM", 5, vocab_size=40, hidden_size=24,
                                   head_dim=8, intermediate_size=20, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    prompt, steps = tokens(5, 40, 6)
    compare(h, model, weights, cfg, prompt, steps, "qwen3")
    ours = h.ours_prefill_then_decode(cfg, weights, prompt, steps, graph=llama.build(cfg))
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    assert max(h.rel_err(o, t) for o, t in zip(ours, theirs)) > 100 * TOL


# ---- Gemma 2 ---------------------------------------------------------------------------------------

@given(shape=gqa(hds=(2, 4, 8)), layers=st.integers(1, 4), tied=st.sampled_from([True, True, False]),
       attn_cap=st.sampled_from([None, 50.0, 2.0]), final_cap=st.sampled_from([None, 30.0, 3.0]),
       qpas=st.sampled_from([None, 3, 32]), window=st.integers(2, 5), extra=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60)
def test_gemma2_vs_transformers(h, shape, layers, tied, attn_cap, final_cap, qpas, window, extra, seed):
    heads, kv, hd = shape
    kw = dict(vocab_size=61, hidden_size=heads * hd * 2, head_dim=hd, intermediate_size=29,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              tie_word_embeddings=tied, attn_logit_softcapping=attn_cap,
              final_logit_softcapping=final_cap, query_pre_attn_scalar=qpas or hd,
              sliding_window=window, rms_norm_eps=1e-6)
    model, weights, cfg = hf_model(h, "Gemma2ForCausalLM", seed, **kw)
    check_windows_without_layer_types(model, cfg)
    compare(h, model, weights, cfg, *tokens(seed, 61, window + extra), "gemma2")


def test_gemma2_each_feature_matters(h, monkeypatch):
    """Soft-capping, the window, the query scalar and the embedding scale each move the logits far
    beyond the tolerance when left out: the comparisons above see them."""
    from fuselm.models import gemma2, layers

    model, weights, cfg = hf_model(
        h, "Gemma2ForCausalLM", 11, vocab_size=50, hidden_size=32, head_dim=8, intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0, query_pre_attn_scalar=2, sliding_window=3)
    prompt, steps = tokens(11, 50, 7)
    compare(h, model, weights, cfg, prompt, steps, "gemma2")
    theirs = h.hf_prefill_then_decode(model, prompt, steps)

    def moved(c):
        ours = h.ours_prefill_then_decode(c, weights, prompt, steps, graph=gemma2.build(c))
        return max(h.rel_err(o, t) for o, t in zip(ours, theirs))

    for change in [dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                   dict(layer_types=["full_attention"] * 2), dict(query_pre_attn_scalar=8)]:
        assert moved(dataclasses.replace(cfg, extra={**cfg.extra, **change})) > 100 * TOL, change
    monkeypatch.setattr(layers, "embed_scale", lambda c: 1.0)
    assert moved(cfg) > 100 * TOL, "embedding scale"


def test_gemma_embed_scale_rounds_like_transformers():
    import torch

    from fuselm.models import DecoderConfig
    from fuselm.models.layers import embed_scale

    for d in (2304, 3584, 4608):
        base = DecoderConfig("Gemma2ForCausalLM", 10, d, 1, 1, 1, 1, 1)
        assert embed_scale(base) == np.float32(d ** 0.5)
        for name, dt in [("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
            for key in ("dtype", "torch_dtype"):
                got = embed_scale(dataclasses.replace(base, extra={key: name}))
                assert got == torch.tensor(d ** 0.5).to(dt).item(), (d, name, key)
    assert embed_scale(dataclasses.replace(base, hidden_size=3584, extra={"dtype": "bfloat16"})) == 59.75


# ---- Gemma 3 ---------------------------------------------------------------------------------------

@given(shape=gqa(hds=(2, 4, 8)), layers=st.integers(1, 4), pattern=st.integers(1, 3), listed=st.booleans(),
       tied=st.sampled_from([True, True, False]), final_cap=st.sampled_from([None, 3.0]),
       qpas=st.sampled_from([None, 3, 32]), scaling=st.sampled_from([None, 8.0]), window=st.integers(2, 5),
       extra=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_gemma3_vs_transformers(h, shape, layers, pattern, listed, tied, final_cap, qpas, scaling, window,
                                extra, seed):
    """Per-head (1 + w) Q/K norms, sliding layers from the pattern (or drawn layer_types), the local
    RoPE base on them and the linear scaling on the full ones. The config goes in the Hub's older
    form (rope_theta, rope_local_base_freq, rope_scaling) and comes out of transformers 5 nested
    by layer type: fuselm reads the latter here, the former in test_gemma3_reads_both_config_forms."""
    heads, kv, hd = shape
    types = None
    if listed:
        types = [("full_attention", "sliding_attention")[int(b)]
                 for b in np.random.default_rng(seed).integers(0, 2, layers)]
    kw = dict(vocab_size=61, hidden_size=heads * hd * 2, head_dim=hd, intermediate_size=29,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              tie_word_embeddings=tied, final_logit_softcapping=final_cap, query_pre_attn_scalar=qpas or hd,
              sliding_window=window, sliding_window_pattern=pattern, layer_types=types, rope_theta=1000.0,
              rope_local_base_freq=10.0, rope_scaling={"rope_type": "linear", "factor": scaling} if scaling else None)
    model, weights, cfg = hf_model(h, "Gemma3ForCausalLM", seed, **kw)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (hd,)
    if not listed:   # an older config.json: the pattern must give transformers' layer_types
        check_windows_without_layer_types(model, cfg)
    compare(h, model, weights, cfg, *tokens(seed, 61, window + extra), "gemma3")


def test_gemma3_reads_both_config_forms():
    """The Hub's config.json (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern)
    and transformers 5's (rope_parameters by layer type, layer_types) give the same graph."""
    import transformers

    from fuselm.models import DecoderConfig, build_graph

    old = dict(architectures=["Gemma3ForCausalLM"], vocab_size=40, hidden_size=32, head_dim=8,
               intermediate_size=24, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
               rope_theta=1000.0, rope_local_base_freq=10.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window=3, sliding_window_pattern=3, query_pre_attn_scalar=8)
    new = transformers.Gemma3TextConfig(**old).to_dict()
    assert "rope_local_base_freq" not in new and "full_attention" in new["rope_parameters"]
    graphs = [build_graph(DecoderConfig.from_hf(d)) for d in (old, new)]
    for name in ("rope.inv_freq", "rope.local_inv_freq"):
        np.testing.assert_array_equal(graphs[0].constants[name], graphs[1].constants[name])
    windows = [[n.attrs["window"] for n in g.sources("attention")] for g in graphs]
    assert windows[0] == windows[1] == [3, 3, 0, 3, 3, 0, 3]
    freq = graphs[0].constants
    assert np.allclose(freq["rope.inv_freq"] * 8, 1000.0 ** -(np.arange(0, 8, 2) / 8))
    assert np.allclose(freq["rope.local_inv_freq"], 10.0 ** -(np.arange(0, 8, 2) / 8))


def test_gemma3_each_feature_matters(h):
    """The Q/K norms' 1 + w, the local RoPE base and the global scaling each move the logits."""
    from fuselm.models import gemma3

    model, weights, cfg = hf_model(
        h, "Gemma3ForCausalLM", 13, vocab_size=50, hidden_size=32, head_dim=8, intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
        sliding_window_pattern=3, rope_theta=1000.0, rope_local_base_freq=10.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0})
    prompt, steps = tokens(13, 50, 7)
    compare(h, model, weights, cfg, prompt, steps, "gemma3")
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    rope = cfg.extra["rope_parameters"]

    def moved(c, graph=None):
        ours = h.ours_prefill_then_decode(c, weights, prompt, steps, graph=graph or gemma3.build(c))
        return max(h.rel_err(o, t) for o, t in zip(ours, theirs))

    for change in [dict(rope_parameters={**rope, "sliding_attention": rope["full_attention"]}),
                   dict(layer_types=["full_attention"] * 3)]:
        assert moved(dataclasses.replace(cfg, extra={**cfg.extra, **change})) > 100 * TOL, change
    assert moved(dataclasses.replace(cfg, rope_scaling=None)) > 100 * TOL, "global scaling"
    graph = gemma3.build(cfg)
    for n in graph.nodes.values():
        if n.op == "rmsnorm" and "q_norm" in n.inputs[1]:
            n.attrs["offset"] = 0.0
    assert moved(cfg, graph) > 100 * TOL, "q_norm offset"


# ---- Phi-3 / Phi-4-mini ----------------------------------------------------------------------------

def phi3_weights(cfg, weights):
    """The HF state dict as fuselm's graph reads it: the fused projections as their row views."""
    from fuselm.models import checkpoint_rows

    views = checkpoint_rows(cfg)
    fused = {src for src, _ in views.values()}
    return {**{k: v for k, v in weights.items() if k not in fused},
            **{name: weights[src][rows] for name, (src, rows) in views.items()}}


@given(shape=gqa(hds=(4, 8, 16)), layers=st.integers(1, 3), partial=st.sampled_from([1.0, 0.75, 0.5]),
       longrope=st.sampled_from([None, "short", "long"]), window=st.sampled_from([None, 3]),
       tied=st.booleans(), prompt_len=st.integers(3, 7), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_phi3_vs_transformers(h, shape, layers, partial, longrope, window, tied, prompt_len, seed):
    """Fused qkv / gate_up, partial rotary and LongRoPE. transformers picks LongRoPE's factors per
    forward pass (long once a sequence passes original_max_position_embeddings): "short" keeps every
    position within it, "long" sets it below the prompt so that every pass uses the long ones, and
    the graph is built for a context beyond it."""
    from fuselm.models import phi3

    heads, kv, hd = shape
    assume(int(hd * partial) % 2 == 0)
    rng = np.random.default_rng(seed)
    pairs = int(hd * partial) // 2
    kw = dict(vocab_size=57, hidden_size=heads * hd, intermediate_size=27, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, partial_rotary_factor=partial,
              sliding_window=window, tie_word_embeddings=tied, rope_theta=10000.0, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=None, eos_token_id=None)
    context = None
    if longrope:
        original = 2 if longrope == "long" else 16
        kw.update(original_max_position_embeddings=original,
                  rope_scaling={"type": "longrope", "short_factor": rng.uniform(1, 4, pairs).tolist(),
                                "long_factor": rng.uniform(1, 4, pairs).tolist()})
        context = 32 if longrope == "long" else None
    model, weights, cfg = hf_model(h, "Phi3ForCausalLM", seed, **kw)
    graph = phi3.build(cfg, context)
    compare(h, model, phi3_weights(cfg, weights), cfg, *tokens(seed, 57, prompt_len), "phi3", graph=graph)


def test_phi3_each_feature_matters(h):
    """The head reordering, the long factors and the attention factor each move the logits."""
    from fuselm.models import phi3

    factors = [1.0, 1.5, 2.0, 4.0, 3.0, 8.0]
    model, weights, cfg = hf_model(
        h, "Phi3ForCausalLM", 3, vocab_size=50, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.75, max_position_embeddings=64,
        original_max_position_embeddings=2, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        rope_scaling={"type": "longrope", "short_factor": factors[::-1], "long_factor": factors})
    prompt, steps = tokens(3, 50, 6)
    ours = phi3_weights(cfg, weights)
    compare(h, model, ours, cfg, prompt, steps, "phi3", graph=phi3.build(cfg, 32))
    theirs = h.hf_prefill_then_decode(model, prompt, steps)

    def moved(c, w=ours, context=32):
        got = h.ours_prefill_then_decode(c, w, prompt, steps, graph=phi3.build(c, context))
        return max(h.rel_err(o, t) for o, t in zip(got, theirs))

    assert moved(cfg, context=None) > 100 * TOL, "long factors"
    unordered = dict(ours)   # Q and K rows in the checkpoint's own order
    for i in range(2):
        qkv, p = weights[f"model.layers.{i}.self_attn.qkv_proj.weight"], f"model.layers.{i}.self_attn"
        unordered[f"{p}.q_proj.weight"], unordered[f"{p}.k_proj.weight"] = qkv[:32], qkv[32:48]
    assert moved(cfg, unordered) > 100 * TOL, "head order"
    plain = dataclasses.replace(cfg, rope_scaling={**cfg.rope_scaling, "attention_factor": 1.0})
    assert moved(plain) > 100 * TOL, "attention factor"


# ---- Mixtral ---------------------------------------------------------------------------------------

@given(shape=gqa(hds=(2, 4, 6)), layers=st.integers(1, 2), experts=st.integers(2, 5),
       top_k=st.integers(1, 3), window=st.sampled_from([None, 3]), prompt_len=st.integers(1, 7),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=50)
def test_mixtral_vs_transformers(h, shape, layers, experts, top_k, window, prompt_len, seed):
    heads, kv, hd = shape
    kw = dict(vocab_size=43, hidden_size=heads * hd, intermediate_size=13, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=experts,
              num_experts_per_tok=min(top_k, experts), sliding_window=window, rope_theta=1000000.0)
    model, weights, cfg = hf_model(h, "MixtralForCausalLM", seed, **kw)
    compare(h, model, weights, cfg, *tokens(seed, 43, prompt_len), "mixtral")


def test_moe_ffn_routes_to_top_k_only():
    """moe_ffn against a direct sum over the chosen experts, with the renormalised softmax weights."""
    from fuselm.dsl import get

    rng = np.random.default_rng(0)
    T, D, I, E, k = 3, 6, 5, 4, 2
    x, logits = rng.standard_normal((T, D)), np.array([[3., 1., 2., 0.], [0., 0.5, -1., 4.], [1., 2., 3., 4.]])
    wg, wu, wd = rng.standard_normal((E, I, D)), rng.standard_normal((E, I, D)), rng.standard_normal((E, D, I))
    out = get("moe_ffn").reference(x, logits, wg, wu, wd, top_k=k)
    silu = lambda a: a / (1 + np.exp(-a))   # noqa: E731
    for t, chosen in enumerate([(0, 2), (3, 1), (3, 2)]):
        w = np.exp(logits[t, list(chosen)])
        w /= w.sum()
        want = sum(we * wd[e] @ (silu(wg[e] @ x[t]) * (wu[e] @ x[t])) for e, we in zip(chosen, w))
        np.testing.assert_allclose(out[t], want, rtol=1e-5)


# ---- Qwen3-MoE -------------------------------------------------------------------------------------

@st.composite
def moe_layout(draw, layers):
    """(experts, top_k, decoder_sparse_step, mlp_only_layers) for a model of `layers` layers."""
    experts = draw(st.integers(2, 9))
    dense = sorted(draw(st.sets(st.integers(0, layers - 1), max_size=layers)))
    return experts, draw(st.integers(1, min(experts, 4))), draw(st.integers(1, 3)), dense


@given(shape=gqa(), per_head=st.integers(2, 9), layers=st.integers(1, 4), data=st.data(), norm=st.booleans(),
       bias=st.booleans(), tied=st.booleans(), sliding=st.booleans(), prompt_len=st.integers(1, 7),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_qwen3_moe_vs_transformers(h, shape, per_head, layers, data, norm, bias, tied, sliding, prompt_len, seed):
    """Routed and dense layers (decoder_sparse_step, mlp_only_layers), top-k weights renormalised
    or not (norm_topk_prob), experts narrower than the dense MLP (moe_intermediate_size)."""
    heads, kv, hd = shape
    experts, top_k, step, dense = data.draw(moe_layout(layers))
    kw = dict(vocab_size=47, hidden_size=heads * per_head, head_dim=hd, intermediate_size=31,
              moe_intermediate_size=11, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=step,
              mlp_only_layers=dense, norm_topk_prob=norm, attention_bias=bias, tie_word_embeddings=tied,
              rope_theta=1000000.0, use_sliding_window=sliding, sliding_window=3)
    model, weights, cfg = hf_model(h, "Qwen3MoeForCausalLM", seed, **kw)
    routed = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    assert [f"model.layers.{i}.mlp.gate.weight" in weights for i in range(layers)] == routed
    compare(h, model, weights, cfg, *tokens(seed, 47, prompt_len), "qwen3_moe")


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk", "plain_topk"])
def test_qwen3_moe_dense_layers_and_topk_weights(h, norm):
    """decoder_sparse_step 2 with mlp_only_layers [3]: layers 1 and 5 route (top 3 of 6), 0, 2, 3,
    4 keep the dense MLP; and flipping norm_topk_prob moves the logits far beyond the tolerance."""
    from fuselm.models import qwen3_moe

    model, weights, cfg = hf_model(
        h, "Qwen3MoeForCausalLM", 21, vocab_size=50, hidden_size=32, head_dim=8, intermediate_size=24,
        moe_intermediate_size=16, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=norm)
    graph = qwen3_moe.build(cfg)
    moe = [n for n in graph.nodes.values() if n.op == "moe_ffn"]
    assert [n.inputs[2] for n in moe] == [f"model.layers.{i}.mlp.experts.*.gate_proj.weight" for i in (1, 5)]
    assert all(n.attrs["norm_topk"] == norm and n.attrs["top_k"] == 3 for n in moe)
    assert graph.nodes["model.layers.1.mlp.experts.*.down_proj.weight"].shape == (6, 32, 16)
    assert graph.nodes["model.layers.3.mlp.down_proj.weight"].shape == (32, 24)
    prompt, steps = tokens(21, 50, 6)
    compare(h, model, weights, cfg, prompt, steps, "qwen3_moe", graph=graph)
    flipped = dataclasses.replace(cfg, extra={**cfg.extra, "norm_topk_prob": not norm})
    ours = h.ours_prefill_then_decode(flipped, weights, prompt, steps, graph=qwen3_moe.build(flipped))
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    assert max(h.rel_err(o, t) for o, t in zip(ours, theirs)) > 100 * TOL


def test_moe_ffn_plain_topk_weights_are_the_full_softmax():
    """norm_topk=False weighs each chosen expert by its probability in the softmax over all experts."""
    from fuselm.dsl import get

    rng = np.random.default_rng(1)
    T, D, I, E, k = 2, 5, 4, 6, 2
    x, logits = rng.standard_normal((T, D)), rng.standard_normal((T, E))
    wg, wu, wd = rng.standard_normal((E, I, D)), rng.standard_normal((E, I, D)), rng.standard_normal((E, D, I))
    out = get("moe_ffn").reference(x, logits, wg, wu, wd, top_k=k, norm_topk=False)
    silu = lambda a: a / (1 + np.exp(-a))   # noqa: E731
    for t in range(T):
        p = np.exp(logits[t]) / np.exp(logits[t]).sum()
        chosen = np.argsort(-p)[:k]
        want = sum(p[e] * wd[e] @ (silu(wg[e] @ x[t]) * (wu[e] @ x[t])) for e in chosen)
        np.testing.assert_allclose(out[t], want, rtol=1e-5)


# ---- OLMo 2 ----------------------------------------------------------------------------------------

@given(shape=gqa(), layers=st.integers(1, 3), bias=st.booleans(), tied=st.booleans(),
       prompt_len=st.integers(1, 7), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_olmo2_vs_transformers(h, shape, layers, bias, tied, prompt_len, seed):
    """Post-norms and the Q/K norms over the whole projection (weights [H * hd] and [KV * hd]:
    compare() checks every weight's shape against the graph's)."""
    heads, kv, hd = shape
    kw = dict(vocab_size=59, hidden_size=heads * hd, intermediate_size=33, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, attention_bias=bias,
              tie_word_embeddings=tied, rope_theta=500000.0, rms_norm_eps=1e-6)
    model, weights, cfg = hf_model(h, "Olmo2ForCausalLM", seed, **kw)
    assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (kv * hd,)
    assert "model.layers.0.input_layernorm.weight" not in weights
    compare(h, model, weights, cfg, *tokens(seed, 59, prompt_len), "olmo2")


# ---- SmolLM3 ---------------------------------------------------------------------------------------

@given(shape=gqa(), layers=st.integers(1, 6), interval=st.integers(1, 4), listed=st.booleans(),
       tied=st.booleans(), sliding=st.booleans(), window=st.integers(2, 4), extra=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
@settings(max_examples=50)
def test_smollm3_vs_transformers(h, shape, layers, interval, listed, tied, sliding, window, extra, seed):
    """NoPE layers from `no_rope_layers` (drawn) or `no_rope_layer_interval`; with
    `use_sliding_window`, transformers slides on the NoPE layers (its derived layer_types)."""
    heads, kv, hd = shape
    flags = np.random.default_rng(seed).integers(0, 2, layers).tolist() if listed else None
    kw = dict(vocab_size=51, hidden_size=heads * hd, intermediate_size=35, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
              no_rope_layers=flags, no_rope_layer_interval=interval, use_sliding_window=sliding,
              sliding_window=window if sliding else None, rope_theta=5000000.0, pad_token_id=0)
    model, weights, cfg = hf_model(h, "SmolLM3ForCausalLM", seed, **kw)
    def ropes(c):
        return sum(n.op == "rope" for n in build_graph_of(c).nodes.values())

    assert ropes(cfg) == 2 * sum(model.config.no_rope_layers)     # Q and K of each RoPE layer
    if not listed:   # a config.json with the interval alone: our rule gives transformers' list
        assert ropes(dataclasses.replace(cfg, extra={**cfg.extra, "no_rope_layers": None})) == ropes(cfg)
    check_windows_without_layer_types(model, cfg)
    compare(h, model, weights, cfg, *tokens(seed, 51, window + extra), "smollm3")


def test_smollm3_nope_layers_matter(h):
    """RoPE on every layer (no_rope_layers all 1) moves the logits far beyond the tolerance."""
    model, weights, cfg = hf_model(h, "SmolLM3ForCausalLM", 9, vocab_size=40, hidden_size=32,
                                   intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=0)
    assert model.config.no_rope_layers == [1, 0, 1, 0]
    prompt, steps = tokens(9, 40, 6)
    compare(h, model, weights, cfg, prompt, steps, "smollm3")
    rope_everywhere = dataclasses.replace(cfg, extra={**cfg.extra, "no_rope_layers": [1] * 4})
    ours = h.ours_prefill_then_decode(rope_everywhere, weights, prompt, steps, graph=build_graph_of(rope_everywhere))
    theirs = h.hf_prefill_then_decode(model, prompt, steps)
    assert max(h.rel_err(o, t) for o, t in zip(ours, theirs)) > 100 * TOL


@pytest.mark.parametrize("bad,match", [(dict(no_rope_layers=[1, 2]), "not a list of 0/1 flags"),
                                       (dict(no_rope_layers=[1]), "lists 1 layers, the model has 2"),
                                       (dict(no_rope_layer_interval=0), "must be a positive integer")])
def test_smollm3_bad_no_rope_settings_are_config_errors(bad, match):
    from fuselm.models import ConfigError, DecoderConfig, build_graph

    d = dict(architectures=["SmolLM3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
             num_hidden_layers=2, num_attention_heads=2, **bad)
    with pytest.raises(ConfigError, match=match):
        build_graph(DecoderConfig.from_hf(d, source="config.json"))


# ---- checkpoints saved by transformers, through fuselm.load ------------------------------------------

@pytest.mark.parametrize("arch,kw", [("Olmo2ForCausalLM", dict(attention_bias=True)),
                                     ("SmolLM3ForCausalLM", dict(no_rope_layer_interval=2)),
                                     ("Gemma3ForCausalLM", dict(head_dim=8, sliding_window=4, sliding_window_pattern=2)),
                                     ("Qwen3MoeForCausalLM", dict(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                                  moe_intermediate_size=12, mlp_only_layers=[1],
                                                                  norm_topk_prob=True)),
                                     ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75, original_max_position_embeddings=64,
                                                              rope_scaling={"type": "longrope", "short_factor": [2.0] * 3,
                                                                            "long_factor": [4.0] * 3})),
                                     ("GptOssForCausalLM", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                                                sliding_window=3,
                                                                layer_types=["sliding_attention", "full_attention", "sliding_attention"]))])
def test_saved_checkpoint_generates_transformers_greedy_tokens(h, tmp_path, arch, kw):
    """save_pretrained's folder (config.json, model.safetensors) loads through fuselm.load on the
    CPU engine, whose greedy tokens are transformers' (full recompute each step)."""
    import torch
    from tokenizers import Tokenizer, models

    import fuselm
    from fuselm import SamplingParams

    model, _, _ = hf_model(h, arch, 0, vocab_size=48, hidden_size=32, intermediate_size=40,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=None, **kw)
    with torch.no_grad():   # tied (SmolLM3): at N(0, 1) the last token's own row wins every step
        model.model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(tmp_path)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(48)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    engine = fuselm.load(tmp_path, device="cpu", progress=False).engine
    prompt, greedy = [3, 14, 15, 9, 2], SamplingParams()
    ours = [engine.prefill(prompt, greedy)]
    while len(ours) < 12:
        ours.append(engine.decode(ours[-1], greedy))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(prompt):] and len(set(ours)) > 1


# ---- Gemma 3 multimodal checkpoints, read as their text model ----------------------------------------

# A text_config as the Hub's Gemma 3 4B has it (sizes and window aside: tiny): Gemma3TextConfig's
# defaults fill the rest (vocabulary 262208, 8 heads / 4 KV heads of 256, RoPE bases 1e6 and 1e4,
# query_pre_attn_scalar 256, tied embeddings, every 6th layer full).
HUB_TEXT = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=7, model_type="gemma3_text",
                rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=4)
TINY_VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)


def test_gemma3_text_config_takes_gemma3_text_configs_defaults():
    """A Hub-style text_config gives the DecoderConfig of the config transformers fills in; the
    top level's dtype reaches the embedding's scale."""
    import transformers

    from fuselm.models import ConfigError, DecoderConfig, build_graph, language_model
    from fuselm.models.layers import embed_scale

    raw = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", torch_dtype="bfloat16",
               eos_token_id=[1, 106], text_config=HUB_TEXT, vision_config=TINY_VISION)
    text, rename = language_model(raw)
    ours = DecoderConfig.from_hf(text)
    full = transformers.Gemma3TextConfig(**HUB_TEXT)
    theirs = DecoderConfig.from_hf({**full.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    same = [dataclasses.replace(c, rope_scaling=None) for c in (ours, theirs)]   # theirs nests rope_theta in it
    assert same[0] == same[1] and ours.architecture == "Gemma3ForCausalLM"
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.rope_theta) == (262208, 8, 4, 256, 1e6)
    graphs = [build_graph(c) for c in (ours, theirs)]
    for name in ("rope.inv_freq", "rope.local_inv_freq"):
        np.testing.assert_array_equal(graphs[0].constants[name], graphs[1].constants[name])
    windows = [[n.attrs["window"] for n in g.sources("attention")] for g in graphs]
    assert windows[0] == windows[1] == [4] * 5 + [0, 4]
    scales = [[n.attrs["factor"] for n in g.nodes.values() if n.op == "scale"][0] for g in graphs]
    assert scales[0] == 5.65625 == embed_scale(ours) != scales[1]     # bf16(sqrt(32)); theirs has no dtype
    assert text["eos_token_id"] == [1, 106] and text["query_pre_attn_scalar"] == 256
    assert [rename(n) for n in ("language_model.model.norm.weight", "model.language_model.layers.0.mlp.up_proj.weight",
                                "vision_tower.vision_model.head.probe", "multi_modal_projector.mm_soft_emb_norm.weight",
                                "model.vision_tower.embeddings.patch_embedding.weight", "language_model.lm_head.weight")] == \
        ["model.norm.weight", "model.layers.0.mlp.up_proj.weight", None, None, None, "lm_head.weight"]
    with pytest.raises(ConfigError, match=r"^m/config.json: text_config = \[1\] is not an object$"):
        language_model({**raw, "text_config": [1]}, "m/config.json")


@pytest.mark.parametrize("names", ["language_model.model.", "model.language_model."])
@pytest.mark.parametrize("form", ["saved", "hub"])
def test_gemma3_multimodal_checkpoint_loads_as_its_text_model(h, tmp_path, form, names):
    """A Gemma3ForConditionalGeneration folder (save_pretrained's, tensors `language_model.model.*`,
    or renamed as newer transformers write them, `model.language_model.*`; vision tower included)
    loads through fuselm.load as the text model: the CPU engine's logits of a prompt longer than the
    window are transformers' multimodal model's on text. "saved": transformers' config.json (every
    key, RoPE nested by layer type); "hub": config.json rewritten as the Hub's 4B has it (HUB_TEXT,
    the rest Gemma3TextConfig's defaults). No final_logit_softcapping (none of the released models
    has one): transformers 5's multimodal class ignores it, its text model (and fuselm) apply it."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models

    import fuselm

    text = HUB_TEXT if form == "hub" else dict(
        vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=6,
        rope_theta=1000.0, rope_local_base_freq=10.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=64)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4,
                                    image_token_index=47, boi_token_index=45, eoi_token_index=46)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    h.randomize_(model, 0)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in tensors) and "language_model.model.norm.weight" in tensors
    if names == "model.language_model.":
        save_file({k.replace("language_model.model.", names): v for k, v in tensors.items()},
                  str(tmp_path / "model.safetensors"))
    if form == "hub":
        (tmp_path / "config.json").write_text(json.dumps(dict(
            architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", torch_dtype="float32",
            mm_tokens_per_image=4, image_token_index=47, boi_token_index=45, eoi_token_index=46,
            text_config=HUB_TEXT, vision_config=TINY_VISION)))
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    engine = fuselm.load(tmp_path, device="cpu", ctx=64, progress=False).engine
    prompt = [3, 14, 15, 9, 2, 26, 5, 35, 8, 7]
    ours = engine.logits_of(prompt)
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([prompt])).logits[0].numpy()
    assert float(np.std(theirs)) > 0.1 and ours.shape == theirs.shape
    rel = h.rel_err(ours, theirs)
    WORST["gemma3 multimodal"] = max(WORST.get("gemma3 multimodal", 0.0), rel)
    assert rel < TOL, rel


# ---- presets and the compiler ----------------------------------------------------------------------

NEW = ["qwen2.5-7b", "qwen3-8b", "gemma-2-9b", "mixtral-8x7b", "olmo-2-7b", "smollm3-3b", "gemma-3-12b",
       "gemma-3-27b", "phi-4-mini", "qwen3-30b-a3b"]


def test_presets_build_with_real_shapes():
    from fuselm.models import build_graph
    from fuselm.models.presets import PRESETS, preset

    assert set(NEW) <= set(PRESETS)
    counts = {}
    for name in NEW:
        g = build_graph(preset(name))
        att = [n for n in g.nodes.values() if n.op == "attention"]
        counts[name] = (len(att), sum(1 for n in att if n.attrs["window"]))
        assert all(n.shape[-1] for n in g.sources("weight"))
    assert counts == {"qwen2.5-7b": (28, 0), "qwen3-8b": (36, 0), "gemma-2-9b": (42, 21),
                      "mixtral-8x7b": (32, 0), "olmo-2-7b": (32, 0), "smollm3-3b": (36, 0),
                      "gemma-3-12b": (48, 40), "gemma-3-27b": (62, 52), "phi-4-mini": (32, 0),
                      "qwen3-30b-a3b": (48, 0)}
    moe = [n for n in build_graph(preset("qwen3-30b-a3b")).nodes.values() if n.op == "moe_ffn"]
    assert len(moe) == 48 and all(n.attrs["top_k"] == 8 and n.attrs["norm_topk"] for n in moe)
    assert moe[0].inputs[4] == "model.layers.0.mlp.experts.*.down_proj.weight"
    smol = build_graph(preset("smollm3-3b"))
    assert sum(n.op == "rope" for n in smol.nodes.values()) == 2 * 27 and "lm_head.weight" not in smol.nodes
    olmo = build_graph(preset("olmo-2-7b"))
    assert olmo.nodes["model.layers.0.self_attn.q_norm.weight"].shape == (4096,)
    gemma = build_graph(preset("gemma-2-9b"))
    att = [n for n in gemma.nodes.values() if n.op == "attention"]
    assert att[0].attrs["scale"] == 256 ** -0.5 and att[0].attrs["softcap"] == 50.0
    assert "lm_head.weight" not in gemma.nodes
    phi = build_graph(preset("phi-4-mini"))
    assert phi.nodes["model.layers.0.self_attn.q_proj.weight"].shape == (3072, 3072)
    assert np.count_nonzero(phi.constants["rope.inv_freq"]) == 48 and phi.constants["rope.inv_freq"].shape == (64,)
    assert phi.constants["rope.q_scale"].max() == pytest.approx(1 + np.log(32) / np.log(4096))
    g3 = build_graph(preset("gemma-3-27b"))
    att = [n for n in g3.nodes.values() if n.op == "attention"]
    assert att[0].attrs["scale"] == 168 ** -0.5 and att[0].attrs["softcap"] == 0.0 and att[5].attrs["window"] == 0
    assert g3.constants["rope.local_inv_freq"][1] == np.float32(10000.0 ** (-2 / 128))
    assert g3.constants["rope.inv_freq"][1] == np.float32(1e6 ** (-2 / 128) / 8)


def tiny_graph(arch):
    """One small config per architecture with every feature on (sliding and full layers, biases,
    soft-caps), built from the HF config class's to_dict as a config.json would give it."""
    import transformers

    from fuselm.models import DecoderConfig, build_graph

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
    kw = {"Qwen2ForCausalLM": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
          "Qwen3ForCausalLM": dict(head_dim=32, use_sliding_window=True, sliding_window=8,
                                   max_window_layers=2, attention_bias=True),
          "Gemma2ForCausalLM": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24),
          "Gemma3ForCausalLM": dict(head_dim=16, sliding_window=8, sliding_window_pattern=2,
                                    rope_scaling={"rope_type": "linear", "factor": 8.0}),
          "Phi3ForCausalLM": dict(partial_rotary_factor=0.75, original_max_position_embeddings=16,
                                  max_position_embeddings=64, sliding_window=8,
                                  rope_scaling={"type": "longrope", "short_factor": [1.5] * 6, "long_factor": [3.0] * 6}),
          "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
          "Qwen3MoeForCausalLM": dict(head_dim=16, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32,
                                      mlp_only_layers=[1], norm_topk_prob=False),
          "Olmo2ForCausalLM": dict(attention_bias=True),
          "SmolLM3ForCausalLM": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8)}[arch]
    d = hf_config_class(arch)(architectures=[arch], **common, **kw).to_dict()
    return build_graph(DecoderConfig.from_hf(d)), common["vocab_size"]


ARCHS = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM", "Olmo2ForCausalLM",
         "SmolLM3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_through_compiler_and_nvrtc(arch, fuse):
    import fuselm.codegen as cg
    from fuselm.codegen import nvrtc
    from fuselm.compiler import compile_graph

    pytest.importorskip("cupy")
    graph, vocab = tiny_graph(arch)
    G = compile_graph(graph, fuse=fuse)
    assert G.graph["schedule"]
    ks = cg.generate(G, ctx=64)
    cubin, log, cached = nvrtc.compile_cubin(cg.module_source(ks + [cg.sample.generate(vocab, cg.Tuning())]), cg.headers(),
                                             nvrtc.options("sm_90"), use_cache=False)
    assert len(cubin) > 1000 and not cached


@pytest.mark.parametrize("name", NEW)
def test_presets_compile(name):
    """The real shapes through the fused pipeline and the code generator (no NVRTC: the tiny graphs
    above compile the same templates)."""
    import fuselm.codegen as cg
    from fuselm.compiler import compile_graph
    from fuselm.models import build_graph
    from fuselm.models.presets import preset

    G = compile_graph(build_graph(preset(name)))
    assert cg.generate(G, ctx=64)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_moe_layers_run_as_their_own_kernel_family(arch):
    """moe_ffn (Kind.MOE) is one "moe" kernel per MoE layer; fused, it takes the norm before it
    (cloned: the router's gemv takes the other copy) and the residual add after it, so no
    row-wise kernel is left between attention's output and the next layer. The compiled schedule
    (fused or not, buffers reused, prompt and decode step) computes what the op-by-op reference
    computes."""
    from fuselm.compiler import compile_graph
    from fuselm.runtime.reference import new_state, run_graph
    from fuselm.runtime.schedule_reference import run_schedule

    graph, vocab = tiny_graph(arch)
    rng = np.random.default_rng(0)
    weights = {n.name: (0.2 * rng.standard_normal(n.shape)).astype(np.float32) for n in graph.sources("weight")}
    layers = 3 if arch == "MixtralForCausalLM" else 2           # Qwen3-MoE's layer 1 is dense
    for tokens in (3, 1):
        feeds = {"ids": np.array([3, 17, 5][:tokens], np.int32), "pos": np.arange(tokens, dtype=np.int32)}
        want = run_graph(graph, weights, feeds, new_state(graph, 8))["logits"]
        for fuse in (True, False):
            G = compile_graph(graph, fuse=fuse, tokens=tokens)
            moe = [l for l in G.graph["schedule"] if l.family == "moe"]
            ops = [[G.nodes[n]["op"] for n in l.nodes] for l in moe]
            assert ops == [["rmsnorm", "moe_ffn", "add"] if fuse else ["moe_ffn"]] * layers, ops
            if fuse:   # between a layer's O projection and the next layer's Q/K/V: router and experts
                after_o = [l.family for l in G.graph["schedule"] if l.layer == moe[0].layer][-2:]
                assert after_o == ["gemv", "moe"]
            got = run_schedule(G, weights, feeds, new_state(graph, 8))["logits"]
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


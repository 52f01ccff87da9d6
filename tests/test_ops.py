"""Every op's numpy reference (dsl/ops.py) against an independently written formula.

The independent versions are written differently on purpose: torch functions (silu, gelu, softmax,
rms_norm, scaled_dot_product_attention), explicit per-pair loops (RoPE), index assignment
(kv_write), np.take (embedding). Also: the C expressions of the elementwise ops, evaluated as
numpy, against their references; and `rope_inv_freq` against transformers' own RoPE init functions.
"""
from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from fuselm.dsl import REGISTRY, Kind, get
from fuselm.models import DecoderConfig, rope_inv_freq

TOL = 1e-5   # float32 relative error bound for every op

rows = st.integers(1, 7)
seeds = st.integers(0, 2**32 - 1)


def ref(name):
    return get(name).reference


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def t64(a):
    return torch.from_numpy(np.asarray(a)).double()


# ---- rows and widths -----------------------------------------------------------------------------

@given(t=rows, v=st.integers(1, 40), d=st.integers(1, 33), seed=seeds)
def test_embedding_is_take(h, t, v, d, seed):
    rng = np.random.default_rng(seed)
    table, ids = randn(rng, v, d), rng.integers(0, v, t).astype(np.int32)
    out = ref("embedding")(table, ids)
    assert out.dtype == np.float32 and out.shape == (t, d)
    np.testing.assert_array_equal(out, np.take(table, ids, axis=0))


@given(t=rows, k=st.integers(1, 70), n=st.integers(1, 70), seed=seeds)
def test_linear_vs_torch(h, t, k, n, seed):
    rng = np.random.default_rng(seed)
    x, w = randn(rng, t, k), randn(rng, n, k)
    out = ref("linear")(x, w)
    assert out.dtype == np.float32
    assert h.rel_err(out, F.linear(t64(x), t64(w)).numpy()) < TOL


@given(t=rows, groups=st.integers(1, 4), g=st.integers(1, 48), grouped=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-5, 1e-2]), offset=st.sampled_from([0.0, 1.0]),
       scale=st.sampled_from([1e-2, 1.0, 30.0]), seed=seeds)
def test_rmsnorm_vs_torch(h, t, groups, g, grouped, eps, offset, scale, seed):
    """Whole-row and grouped (per-head, as Qwen3's q/k norm) RMSNorm, with Gemma's 1 + w offset."""
    rng = np.random.default_rng(seed)
    if not grouped:
        g, groups = g * groups, 1
    x, w = randn(rng, t, groups * g, scale=scale), randn(rng, g)
    out = ref("rmsnorm")(x, w, eps, group=g if grouped else None, offset=offset)
    expect = F.rms_norm(t64(x).view(t, groups, g), (g,), weight=t64(w) + offset, eps=eps)
    assert out.dtype == np.float32
    assert h.rel_err(out, expect.reshape(t, groups * g).numpy()) < TOL


# ---- RoPE ----------------------------------------------------------------------------------------

def rope_by_pairs(x, pos, inv_freq, head_dim, interleaved):
    """Rotate each pair of each head by its own angle, one pair at a time."""
    out = np.array(x, np.float64)
    half = len(inv_freq)
    for t in range(x.shape[0]):
        for h0 in range(0, x.shape[1], head_dim):
            for i in range(half):
                ang = float(pos[t]) * float(inv_freq[i])
                c, s = math.cos(ang), math.sin(ang)
                j, k = (h0 + 2 * i, h0 + 2 * i + 1) if interleaved else (h0 + i, h0 + half + i)
                a, b = float(x[t, j]), float(x[t, k])
                out[t, j], out[t, k] = a * c - b * s, a * s + b * c
    return out


@st.composite
def rope_case(draw):
    hd = 2 * draw(st.integers(1, 12))
    half = draw(st.integers(1, hd // 2))            # < hd/2: partial rotary
    heads = draw(st.integers(1, 3))
    t = draw(st.integers(1, 5))
    pos = draw(st.lists(st.integers(0, 9000), min_size=t, max_size=t))
    theta = draw(st.sampled_from([100.0, 1e4, 5e5]))
    return hd, half, heads, np.array(pos, np.int32), theta


@given(case=rope_case(), interleaved=st.booleans(), seed=seeds)
def test_rope_vs_pair_loop(h, case, interleaved, seed):
    hd, half, heads, pos, theta = case
    rng = np.random.default_rng(seed)
    inv_freq = (1.0 / theta ** (np.arange(half) * 2.0 / hd)).astype(np.float32)
    x = randn(rng, len(pos), heads * hd)
    out = ref("rope")(x, pos, inv_freq, hd, interleaved=interleaved)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert h.rel_err(out, rope_by_pairs(x, pos, inv_freq, hd, interleaved)) < TOL
    if 2 * half < hd:   # the elements past the rotated span pass through unchanged
        tail = np.concatenate([np.arange(h0 + 2 * half, h0 + hd) for h0 in range(0, heads * hd, hd)])
        np.testing.assert_array_equal(out[:, tail], x[:, tail])


@given(hd=st.integers(1, 16).map(lambda n: 2 * n), heads=st.integers(1, 4), t=rows, seed=seeds)
def test_rope_matches_transformers_apply_rotary_pos_emb(h, hd, heads, t, seed):
    """The default layout is exactly Hugging Face's rotate_half layout."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rng = np.random.default_rng(seed)
    inv_freq = (1.0 / 1e4 ** (np.arange(hd // 2) * 2.0 / hd)).astype(np.float32)
    pos = rng.integers(0, 4000, t).astype(np.int32)
    x = randn(rng, t, heads * hd)
    freqs = t64(pos)[:, None] * t64(inv_freq)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)                                  # [T, hd]
    xh = t64(x).view(1, t, heads, hd).transpose(1, 2)                        # [1, H, T, hd]
    q, _ = apply_rotary_pos_emb(xh, xh, emb.cos()[None], emb.sin()[None])
    expect = q.transpose(1, 2).reshape(t, heads * hd).numpy()
    assert h.rel_err(ref("rope")(x, pos, inv_freq, hd), expect) < TOL


# ---- KV cache and attention ----------------------------------------------------------------------

@given(s=st.integers(1, 12), width=st.integers(1, 20), data=st.data(), seed=seeds)
def test_kv_write_is_row_assignment(h, s, width, data, seed):
    rng = np.random.default_rng(seed)
    rows_ = data.draw(st.lists(st.integers(0, s - 1), min_size=1, max_size=s, unique=True))
    cache, x = randn(rng, s, width), randn(rng, len(rows_), width)
    expect = cache.copy()
    for i, r in enumerate(rows_):
        expect[r, :] = x[i, :]
    out = ref("kv_write")(cache, x, np.array(rows_, np.int32))
    np.testing.assert_array_equal(out, expect)


def attention_torch(q, kc, vc, pos, n_heads, n_kv_heads, head_dim, scale, window, softcap, sinks=None):
    """SDPA with the KV heads repeated for GQA and an explicit causal / sliding-window mask;
    with `sinks` [H], each head's softmax over its scores and its sink logit, the sink's share
    dropped (gpt-oss, as transformers writes it)."""
    t, s = q.shape[0], kc.shape[0]
    qh = t64(q).view(t, n_heads, head_dim).transpose(0, 1)                       # [H, T, hd]
    rep = n_heads // n_kv_heads
    kh = t64(kc).view(s, n_kv_heads, head_dim).transpose(0, 1).repeat_interleave(rep, dim=0)
    vh = t64(vc).view(s, n_kv_heads, head_dim).transpose(0, 1).repeat_interleave(rep, dim=0)
    j = torch.arange(s)[None, :]
    p = torch.from_numpy(pos.astype(np.int64))[:, None]
    mask = j <= p
    if window:
        mask &= j > p - window
    if softcap or sinks is not None:   # SDPA has neither a logit softcap nor sinks: by hand
        scores = qh @ kh.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, -math.inf)
        if sinks is not None:
            sink = t64(sinks)[:, None, None].expand(-1, t, 1)
            out = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ vh
        else:
            out = torch.softmax(scores, dim=-1) @ vh
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(t, n_heads * head_dim).numpy()


@st.composite
def attention_case(draw):
    kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))      # 1: MHA; kv == 1: MQA
    hd = draw(st.integers(1, 12))
    s = draw(st.integers(1, 14))
    t = draw(st.integers(1, 5))
    pos = draw(st.lists(st.integers(0, s - 1), min_size=t, max_size=t))
    window = draw(st.sampled_from([0, 0, 1, 2, 3, 5]))
    softcap = draw(st.sampled_from([0.0, 0.0, 0.0, 5.0]))
    return kv * group, kv, hd, s, np.array(pos, np.int32), window, softcap


@given(case=attention_case(), sinks=st.booleans(), seed=seeds)
def test_attention_vs_sdpa(h, case, sinks, seed):
    n_heads, n_kv, hd, s, pos, window, softcap = case
    rng = np.random.default_rng(seed)
    q = randn(rng, len(pos), n_heads * hd, scale=2.0)
    kc, vc = randn(rng, s, n_kv * hd), randn(rng, s, n_kv * hd)
    sink = randn(rng, n_heads, scale=2.0) if sinks else None
    # rows past every query's position must not be read: make them poison
    last = int(pos.max())
    kc[last + 1:], vc[last + 1:] = np.nan, np.nan
    scale = hd ** -0.5
    out = ref("attention")(q, kc, vc, pos, *([sink] if sinks else []), n_heads=n_heads, n_kv_heads=n_kv,
                           head_dim=hd, scale=scale, window=window, softcap=softcap)
    kc[last + 1:], vc[last + 1:] = 0.0, 0.0   # SDPA multiplies masked NaNs by 0 -> NaN
    expect = attention_torch(q, kc, vc, pos, n_heads, n_kv, hd, scale, window, softcap, sink)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    assert h.rel_err(out, expect) < TOL


def test_attention_window_changes_the_result(h):
    """Guard for the test above: with a window shorter than the history, the output differs."""
    rng = np.random.default_rng(0)
    q, kc, vc = randn(rng, 1, 8), randn(rng, 6, 8), randn(rng, 6, 8)
    pos = np.array([5], np.int32)
    full = ref("attention")(q, kc, vc, pos, n_heads=2, n_kv_heads=2, head_dim=4, scale=0.5)
    windowed = ref("attention")(q, kc, vc, pos, n_heads=2, n_kv_heads=2, head_dim=4, scale=0.5, window=2)
    assert h.rel_err(windowed, full) > 1e-2
    assert h.rel_err(windowed, attention_torch(q, kc, vc, pos, 2, 2, 4, 0.5, 2, 0.0)) < TOL


# ---- reductions and elementwise ------------------------------------------------------------------

@given(t=rows, n=st.integers(1, 50), scale=st.sampled_from([1.0, 30.0]), seed=seeds)
def test_softmax_and_argmax_vs_torch(h, t, n, scale, seed):
    rng = np.random.default_rng(seed)
    x = randn(rng, t, n, scale=scale)
    assert h.rel_err(ref("softmax")(x), torch.softmax(t64(x), dim=-1).numpy()) < TOL
    am = ref("argmax")(x)
    assert am.dtype == np.int32
    np.testing.assert_array_equal(am, torch.argmax(torch.from_numpy(x), dim=-1).numpy())


UNARY_TORCH = {
    "silu": lambda a: F.silu(a),
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "softcap": lambda a, cap: cap * torch.tanh(a / cap),
    "scale": lambda a, factor: a * factor,
}


@pytest.mark.parametrize("name", sorted(UNARY_TORCH))
@given(t=rows, n=st.integers(1, 40), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=seeds)
def test_unary_elementwise_vs_torch(h, name, t, n, scale, seed):
    rng = np.random.default_rng(seed)
    x = randn(rng, t, n, scale=scale)
    attrs = {"softcap": {"cap": 3.0}, "scale": {"factor": -0.7}}.get(name, {})
    out = ref(name)(x, **attrs)
    assert out.dtype == np.float32
    # elementwise, so compare element by element; the absolute slack covers float32 cancellation
    # in gelu's 1 + tanh(..) for x << 0 (the result is ~1e-8 there, torch float32 does the same)
    np.testing.assert_allclose(out, UNARY_TORCH[name](t64(x), **attrs).numpy(), rtol=TOL, atol=1e-6)


@pytest.mark.parametrize("name,fn", [("add", np.add), ("mul", np.multiply)])
@given(t=rows, n=st.integers(1, 40), form=st.sampled_from(["full", "row", "scalar"]), seed=seeds)
def test_binary_elementwise_broadcast(h, name, fn, t, n, form, seed):
    rng = np.random.default_rng(seed)
    a = randn(rng, t, n)
    b = {"full": randn(rng, t, n), "row": randn(rng, n), "scalar": randn(rng)}[form]
    out = ref(name)(a, b)
    expect = np.empty((t, n))
    for i in range(t):
        for j in range(n):
            bij = b if form == "scalar" else b[j] if form == "row" else b[i, j]
            expect[i, j] = fn(float(a[i, j]), float(bij))
    assert out.dtype == np.float32 and out.shape == (t, n)
    assert h.rel_err(out, expect) < TOL


# ---- the C expressions of elementwise ops, evaluated as numpy -------------------------------------

_C_TO_NUMPY = [(r"__expf\(", "np.exp("), (r"\bexpf\(", "np.exp("), (r"\btanhf\(", "np.tanh("),
               (r"\bsqrtf\(", "np.sqrt("), (r"\bfabsf\(", "np.abs("), (r"\blogf\(", "np.log("),
               (r"\b(\d+\.\d*(?:[eE][-+]?\d+)?)f\b", r"\1")]


def c_expr_as_numpy(op, arrays, attrs):
    names = "abcdefgh"[:op.arity]
    src = op.c_expr.format(**{n: f"({n})" for n in names}, **{k: repr(float(v)) for k, v in attrs.items()})
    for pat, rep in _C_TO_NUMPY:
        src = re.sub(pat, rep, src)
    return eval(src, {"np": np}, dict(zip(names, arrays)))  # noqa: S307 (our own registry's text)


ELEMENTWISE = sorted(n for n, op in REGISTRY.items() if op.kind is Kind.ELEMENTWISE)


def test_all_elementwise_ops_have_c_expr():
    assert {"add", "mul", "silu"} <= set(ELEMENTWISE)
    for name in ELEMENTWISE:
        assert REGISTRY[name].c_expr, f"elementwise op '{name}' has no C expression"


@pytest.mark.parametrize("name", ELEMENTWISE)
@given(n=st.integers(1, 30), seed=seeds)
def test_c_expr_agrees_with_reference(h, name, n, seed):
    """What the code generator will emit computes what the numpy reference computes."""
    op = REGISTRY[name]
    rng = np.random.default_rng(seed)
    arrays = [randn(rng, 2, n, scale=2.0) for _ in range(op.arity)]
    params = list(inspect.signature(op.reference).parameters)[op.arity:]
    attrs = {p: op.attr_defaults.get(p) if op.attr_defaults.get(p) is not None
             else float(rng.uniform(0.5, 4.0)) for p in params}
    got = c_expr_as_numpy(op, [a.astype(np.float64) for a in arrays], attrs)
    np.testing.assert_allclose(op.reference(*arrays, **attrs), got, rtol=TOL, atol=1e-6)


# ---- RoPE inverse frequencies vs transformers ------------------------------------------------------

def our_inv_freq(hd, theta, scaling):
    cfg = DecoderConfig("LlamaForCausalLM", 10, 2 * hd, 8, 1, 2, 1, hd, rope_theta=theta,
                        rope_scaling=scaling)
    return rope_inv_freq(cfg)


def hf_inv_freq(hd, theta, scaling):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=2 * hd, num_attention_heads=2, head_dim=hd,
                                   rope_theta=theta, rope_scaling=scaling,
                                   max_position_embeddings=131072)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        inv, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config=cfg)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    assert factor == 1.0   # cos/sin are not rescaled for these types
    return inv.double().numpy()


@st.composite
def rope_scaling(draw):
    kind = draw(st.sampled_from(["default", "linear", "llama3", "llama3"]))
    if kind == "default":
        return None
    factor = draw(st.floats(1.5, 40.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    lo = draw(st.floats(0.5, 2.0))
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo,
            "high_freq_factor": lo + draw(st.floats(0.5, 6.0)),
            "original_max_position_embeddings": draw(st.sampled_from([16, 256, 2048, 8192]))}


@given(hd=st.integers(2, 64).map(lambda n: 2 * n), theta=st.sampled_from([1e4, 5e5, 1e6, 123.0]),
       scaling=rope_scaling())
def test_rope_inv_freq_vs_transformers(h, hd, theta, scaling):
    ours, theirs = our_inv_freq(hd, theta, scaling), hf_inv_freq(hd, theta, scaling)
    assert ours.dtype == np.float32 and ours.shape == (hd // 2,)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=0)


def test_llama31_8b_inv_freq_vs_transformers():
    """The real Llama-3.1 numbers: all three bands (kept, smoothed, divided by 8) are present."""
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    ours, theirs = our_inv_freq(128, 5e5, sc), hf_inv_freq(128, 5e5, sc)
    plain = our_inv_freq(128, 5e5, None)
    assert (ours == plain).any() and np.isclose(ours, plain / 8).any()
    assert (~np.isclose(ours, plain) & ~np.isclose(ours, plain / 8)).any()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)

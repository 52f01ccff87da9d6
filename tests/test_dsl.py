"""The graph builder (dsl/graph.py) and the reference executor's graph-level behaviour.

Shapes are inferred when a node is added; a bad shape fails there, with a one-line ShapeError that
names the node; arity, duplicate names, tied weights, user-registered ops, in-place KV state.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

from fuselm.dsl import REGISTRY, Graph, Kind, OpDef, ShapeError, get, register
from fuselm.dsl.ops import elementwise_shape
from fuselm.errors import FuselmError
from fuselm.runtime.reference import new_state, run_graph


# ---- shape inference ---------------------------------------------------------------------------

@given(v=st.integers(2, 50), d=st.integers(1, 40), n=st.integers(1, 40), heads=st.integers(1, 4),
       hd2=st.integers(1, 8))
def test_shapes_are_inferred_at_build_time(v, d, n, heads, hd2):
    hd = 2 * hd2
    g = Graph("shapes")
    ids, pos = g.input("ids", ("T",), "i32"), g.input("pos", ("T",), "i32")
    x = g.op("embedding", g.weight("emb", (v, d)), ids)
    assert x.shape == ("T", d)
    assert g.op("rmsnorm", x, g.weight("nw", (d,)), eps=1e-5).shape == ("T", d)
    y = g.op("linear", x, g.weight("w", (n, d)))
    assert y.shape == ("T", n)
    assert (y + g.weight("b", (n,))).shape == ("T", n)
    assert (g.op("silu", y) * y).shape == ("T", n)
    assert g.op("softmax", y).shape == ("T", n)
    am = g.op("argmax", y)
    assert am.shape == ("T",) and g.nodes[am.name].dtype == "i32"
    q = g.op("linear", x, g.weight("wq", (heads * hd, d)))
    inv = g.constant("inv", np.ones(hd2, np.float32))
    assert g.op("rope", q, pos, inv, head_dim=hd).shape == ("T", heads * hd)
    k = g.op("linear", x, g.weight("wk", (hd, d)))
    kc = g.op("kv_write", g.state("kc", ("S", hd)), k, pos)
    assert kc.shape == ("S", hd)
    a = g.op("attention", q, kc, kc, pos, n_heads=heads, n_kv_heads=1, head_dim=hd, scale=1.0)
    assert a.shape == ("T", heads * hd)
    # attribute defaults are filled in on the node
    assert g.nodes[a.name].attrs["window"] == 0 and g.nodes[a.name].attrs["softcap"] == 0.0


def test_node_names_inputs_and_outputs():
    g = Graph("names")
    x = g.input("x", ("T", 4))
    y = g.op("silu", x, name="act")
    z = g.op("mul", x, y)
    g.output(out=z)
    assert y.name == "act" and g.nodes["act"].inputs == ("x",)
    assert g.nodes[z.name].op == "mul" and g.nodes[z.name].inputs == ("x", "act")
    assert list(g.nodes) == ["x", "act", z.name]           # insertion = topological order
    assert g.outputs == {"out": z.name}
    assert [n.name for n in g.sources("input")] == ["x"]


# ---- shape errors: one line, naming the node -----------------------------------------------------

def _bad_linear(g):
    return g.op("linear", g.input("x", ("T", 8)), g.weight("w", (4, 7)), name="bad")


def _bad_broadcast_row(g):
    return g.op("add", g.input("x", ("T", 8)), g.weight("b", (7,)), name="bad")


def _bad_broadcast_rows(g):
    return g.op("mul", g.input("x", ("T", 8)), g.state("s", ("S", 8)), name="bad")


def _bad_norm_weight(g):
    return g.op("rmsnorm", g.input("x", ("T", 8)), g.weight("w", (7,)), eps=1e-6, name="bad")


def _bad_norm_group(g):
    return g.op("rmsnorm", g.input("x", ("T", 8)), g.weight("w", (3,)), eps=1e-6, group=3, name="bad")


def _bad_rope_width(g):
    return g.op("rope", g.input("x", ("T", 12)), g.input("p", ("T",), "i32"),
                g.constant("f", np.ones(4)), head_dim=8, name="bad")


def _bad_rope_freqs(g):
    return g.op("rope", g.input("x", ("T", 16)), g.input("p", ("T",), "i32"),
                g.constant("f", np.ones(5)), head_dim=8, name="bad")


def _bad_kv_write(g):
    return g.op("kv_write", g.state("c", ("S", 16)), g.input("k", ("T", 8)),
                g.input("p", ("T",), "i32"), name="bad")


def _bad_attention(which):
    """A valid call (4 heads, 2 KV heads of 8) with one thing wrong."""
    def build(g):
        q = {"q": ("T", 30), "ratio": ("T", 40)}.get(which, ("T", 32))
        kc = ("S", 12) if which == "kc" else ("S", 16)
        vc = ("S", 12) if which == "vc" else ("S", 16)
        heads = 5 if which == "ratio" else 4                 # 5 query heads over 2 KV heads
        return g.op("attention", g.input("q", q), g.state("kc", kc), g.state("vc", vc),
                    g.input("p", ("T",), "i32"), n_heads=heads, n_kv_heads=2, head_dim=8,
                    scale=1.0, name="bad")
    return build


def test_valid_attention_call_builds():
    """The baseline that _bad_attention breaks one piece at a time."""
    g = Graph("ok")
    a = g.op("attention", g.input("q", ("T", 32)), g.state("kc", ("S", 16)), g.state("vc", ("S", 16)),
             g.input("p", ("T",), "i32"), n_heads=4, n_kv_heads=2, head_dim=8, scale=1.0)
    assert a.shape == ("T", 32)


BAD = {
    "linear": _bad_linear, "add-row": _bad_broadcast_row, "mul-rows": _bad_broadcast_rows,
    "rmsnorm-weight": _bad_norm_weight, "rmsnorm-group": _bad_norm_group,
    "rope-width": _bad_rope_width, "rope-freqs": _bad_rope_freqs, "kv_write": _bad_kv_write,
    "attention-q": _bad_attention("q"), "attention-k": _bad_attention("kc"),
    "attention-v": _bad_attention("vc"), "attention-gqa-ratio": _bad_attention("ratio"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_shape_error_is_one_line_naming_the_node(case):
    g = Graph("bad")
    with pytest.raises(ShapeError) as info:
        BAD[case](g)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("bad: "), msg
    assert isinstance(info.value, FuselmError) and isinstance(info.value, ValueError)
    assert "bad" not in g.nodes                       # nothing half-added


def test_shape_error_names_generated_node_when_unnamed():
    g = Graph("bad")
    with pytest.raises(ShapeError, match=r"^linear #\d+: "):
        g.op("linear", g.input("x", ("T", 8)), g.weight("w", (4, 7)))


@pytest.mark.parametrize("case", ["linear-1d-input", "embedding-2d-ids"])
def test_rank_mismatch_is_a_shape_error(case):
    g = Graph("bad")
    with pytest.raises(ShapeError, match=r"^bad: "):
        if case == "linear-1d-input":
            g.op("linear", g.input("x", (8,)), g.weight("w", (4, 8)), name="bad")
        else:
            g.op("embedding", g.weight("e", (10, 8)), g.input("ids", ("T", 2), "i32"), name="bad")


@given(n=st.integers(1, 20), m=st.integers(1, 20))
def test_broadcast_rule(n, m):
    """[T, N] with [T, N], [N] or []: fine; any other width or row count: ShapeError."""
    assert elementwise_shape([("T", n), (n,)], {})[0] == ("T", n)
    assert elementwise_shape([(n,), ("T", n)], {})[0] == ("T", n)
    assert elementwise_shape([("T", n), ()], {})[0] == ("T", n)
    assert elementwise_shape([("T", n), ("T", n)], {})[0] == ("T", n)
    if n != m:
        for shapes in ([("T", n), (m,)], [("T", n), ("T", m)], [(m,), ("T", n)]):
            with pytest.raises(ShapeError):
                elementwise_shape(shapes, {})
    with pytest.raises(ShapeError):
        elementwise_shape([("T", n), ("S", n)], {})


# ---- builder errors ------------------------------------------------------------------------------

def test_arity_error():
    g = Graph("arity")
    x = g.input("x", ("T", 4))
    with pytest.raises(TypeError, match="add takes 2 operands, got 1"):
        g.op("add", x)
    with pytest.raises(TypeError, match="silu takes 1 operands, got 2"):
        g.op("silu", x, x)
    assert list(g.nodes) == ["x"]


def test_unknown_op_lists_known_ops():
    g = Graph("unknown")
    with pytest.raises(KeyError, match="unknown op 'frobnicate'.*linear"):
        g.op("frobnicate", g.input("x", ("T", 4)))


def test_duplicate_names_are_rejected():
    g = Graph("dup")
    x = g.input("x", ("T", 4))
    with pytest.raises(ValueError, match="already has a node named 'x'"):
        g.input("x", ("T", 4))
    g.op("silu", x, name="y")
    with pytest.raises(ValueError, match="'y'"):
        g.op("silu", x, name="y")
    with pytest.raises(ValueError):
        g.weight("x", ("T", 4))          # a weight may not take an input's name
    with pytest.raises(ValueError):
        g.state("y", ("S", 4))


def test_generated_names_do_not_collide():
    g = Graph("gen")
    x = g.input("x", ("T", 4))
    names = [g.op("silu", x).name for _ in range(5)] + [(x + x).name, (x * x).name]
    assert len(set(names)) == len(names)


def test_tied_weight_is_one_node():
    g = Graph("tied")
    ids = g.input("ids", ("T",), "i32")
    emb = g.weight("model.embed_tokens.weight", (10, 6))
    x = g.op("embedding", emb, ids)
    again = g.weight("model.embed_tokens.weight", (10, 6))
    logits = g.op("linear", x, again)
    assert again.name == emb.name
    assert len(g.sources("weight")) == 1
    assert g.nodes[logits.name].inputs[1] == "model.embed_tokens.weight"
    with pytest.raises(ValueError):      # the same name with another shape is a mistake
        g.weight("model.embed_tokens.weight", (6, 10))


def test_a_constant_may_be_any_array_like():
    """Graph.constant takes lists as well as arrays, stored as float32 of the array's shape."""
    g = Graph("c")
    c = g.constant("inv", [[1, 2, 3], [4, 5, 6]])
    assert c.shape == (2, 3) and g.constants["inv"].dtype == np.float32
    assert g.constants["inv"].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_tied_llama_graph_has_no_lm_head():
    from fuselm.models import DecoderConfig, build_graph

    cfg = DecoderConfig("LlamaForCausalLM", 11, 8, 12, 1, 2, 1, 4, tie_word_embeddings=True)
    names = {n.name for n in build_graph(cfg).sources("weight")}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    untied = {n.name for n in build_graph(DecoderConfig("LlamaForCausalLM", 11, 8, 12, 1, 2, 1, 4))
              .sources("weight")}
    assert untied == names | {"lm_head.weight"}


# ---- registering a new op ------------------------------------------------------------------------

@pytest.fixture
def extra_ops():
    """Register test ops; take them out of the registry again afterwards."""
    added = []

    def add(op):
        assert op.name not in REGISTRY
        added.append(op.name)
        return register(op)
    yield add
    for name in added:
        REGISTRY.pop(name, None)


def _broadcast_rule(shapes, attrs):
    return get("add").shape_rule(shapes, attrs)


def test_register_new_elementwise_ops_and_run_them(h, extra_ops):
    extra_ops(OpDef("test_square", Kind.ELEMENTWISE, 1, _broadcast_rule,
                    lambda a: (a * a).astype(np.float32), c_expr="{a} * {a}"))
    extra_ops(OpDef("test_capped_sub", Kind.ELEMENTWISE, 2, _broadcast_rule,
                    lambda a, b, cap: (cap * np.tanh((a - b) / cap)).astype(np.float32),
                    c_expr="{cap} * tanhf(({a} - {b}) / {cap})", attr_defaults={"cap": 2.0}))
    g = Graph("custom")
    x, b = g.input("x", ("T", 5)), g.weight("b", (5,))
    sq = g.op("test_square", x)
    y = g.op("test_capped_sub", sq, b)
    z = g.op("test_capped_sub", sq, b, cap=50.0)
    assert g.nodes[y.name].attrs == {"cap": 2.0} and g.nodes[z.name].attrs == {"cap": 50.0}
    with pytest.raises(ShapeError, match="^bad: "):
        g.op("test_capped_sub", x, g.weight("b6", (6,)), name="bad")
    g.output(y=y, z=z, sq=sq)

    rng = np.random.default_rng(0)
    xv, bv = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    out = run_graph(g, {"b": bv, "b6": np.zeros(6, np.float32)}, {"x": xv}, {})
    np.testing.assert_allclose(out["sq"], xv ** 2, rtol=1e-6)
    for key, cap in (("y", 2.0), ("z", 50.0)):
        expect = [[cap * np.tanh((xv[i, j] ** 2 - bv[j]) / cap) for j in range(5)] for i in range(3)]
        assert h.rel_err(out[key], expect) < 1e-6


def test_register_replaces_same_name(extra_ops):
    op = extra_ops(OpDef("test_twice", Kind.ELEMENTWISE, 1, _broadcast_rule,
                         lambda a: a * np.float32(2), c_expr="2.0f * {a}"))
    assert get("test_twice") is op
    op2 = register(OpDef("test_twice", Kind.ELEMENTWISE, 1, _broadcast_rule,
                         lambda a: a * np.float32(3), c_expr="3.0f * {a}"))
    assert get("test_twice") is op2
    g = Graph("twice")
    g.output(y=g.op("test_twice", g.input("x", ("T", 2))))
    np.testing.assert_array_equal(run_graph(g, {}, {"x": np.ones((1, 2), np.float32)}, {})["y"],
                                  [[3.0, 3.0]])


# ---- the reference executor: state, in place ---------------------------------------------------

def test_kv_write_updates_state_in_place():
    g = Graph("kv")
    k, pos = g.input("k", ("T", 3)), g.input("pos", ("T",), "i32")
    cache = g.op("kv_write", g.state("cache", ("S", 3)), k, pos)
    g.output(total=g.op("softmax", g.op("linear", k, cache)))   # uses the written cache
    state = new_state(g, 5)
    assert state["cache"].shape == (5, 3) and not state["cache"].any()
    buf = state["cache"]
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    run_graph(g, {}, {"k": rows, "pos": np.array([1, 3], np.int32)}, state)
    assert state["cache"] is buf                              # the same buffer, updated
    np.testing.assert_array_equal(buf[[1, 3]], rows)
    assert not buf[[0, 2, 4]].any()
    run_graph(g, {}, {"k": -rows[:1], "pos": np.array([4], np.int32)}, state)
    np.testing.assert_array_equal(buf[4], -rows[0])
    np.testing.assert_array_equal(buf[[1, 3]], rows)          # earlier rows kept


@given(t=st.integers(1, 6), split=st.integers(0, 5), seed=st.integers(0, 1000))
def test_prefill_then_decode_equals_one_prefill(h, t, split, seed):
    """Feeding a sequence in pieces through the KV cache gives the logits of one whole prompt."""
    from fuselm.models import DecoderConfig, build_graph

    split = min(split, t - 1) + 1
    cfg = DecoderConfig("LlamaForCausalLM", 13, 8, 10, 2, 4, 2, 2, sliding_window=3)
    g = build_graph(cfg)
    rng = np.random.default_rng(seed)
    weights = {n.name: rng.standard_normal(n.shape).astype(np.float32) * (0.5 if len(n.shape) == 2 else 1)
               for n in g.sources("weight")}
    ids = rng.integers(0, 13, t).astype(np.int32)
    whole = run_graph(g, weights, {"ids": ids, "pos": np.arange(t, dtype=np.int32)},
                      new_state(g, t))["logits"]
    state = new_state(g, t)
    pieces = [run_graph(g, weights, {"ids": ids[:split], "pos": np.arange(split, dtype=np.int32)},
                        state)["logits"]]
    for p in range(split, t):
        pieces.append(run_graph(g, weights, {"ids": ids[p:p + 1], "pos": np.array([p], np.int32)},
                                state)["logits"])
    assert h.rel_err(np.concatenate(pieces), whole) < 1e-5

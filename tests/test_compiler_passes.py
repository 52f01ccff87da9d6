"""Before/After tests of each compiler pass, their purity, validation, legality refusals and dumps.

Every test looks at which kernel a node lands in (the `kernel` label the passes set) and, where
the result could be wrong, also runs the compiled graph through runtime/schedule_reference against
run_graph.
"""
from __future__ import annotations

from dataclasses import replace

import copy
from functools import partial

import networkx as nx
import numpy as np
import pytest
from hypothesis import given

from fuselm.codegen import generate
from fuselm.compiler import compile_graph
from fuselm.compiler.dump import as_text
from fuselm.compiler.fuse_epilogue import fuse_epilogue
from fuselm.compiler.fuse_horizontal import fuse_horizontal
from fuselm.compiler.fuse_prologue import fuse_prologue
from fuselm.compiler.infer_shapes import infer_shapes
from fuselm.compiler.keep_state import keep_state
from fuselm.compiler.fuse_tail import fuse_tail
from fuselm.compiler.kernels import family, kernel_graph, members, split_tail
from fuselm.compiler.lower import to_networkx
from fuselm.compiler.pipeline import passes
from fuselm.compiler.plan_buffers import plan_buffers
from fuselm.compiler.schedule import schedule
from fuselm.compiler.validate import InvalidGraph, validate
from fuselm.dsl import REGISTRY, Graph, Kind, OpDef, register
from fuselm.dsl.ops import elementwise_shape
from fuselm.models import DecoderConfig, build_graph
from fuselm.runtime.reference import new_state, run_graph
from fuselm.runtime.schedule_reference import ScheduleError, run_schedule

from graph_strategies import model_weights, random_graphs

TAIL = [schedule]


def tiny_llama(layers=2, bias=False, arch="LlamaForCausalLM", **kw) -> Graph:
    return build_graph(DecoderConfig.from_hf(dict(
        architectures=[arch], vocab_size=29, hidden_size=12, intermediate_size=19,
        num_hidden_layers=layers, num_attention_heads=3, num_key_value_heads=1, head_dim=4,
        attention_bias=bias, **kw), source="tiny"))


def lin(G, weight: str) -> str:
    """The linear node reading `weight`."""
    return next(n for n, d in G.nodes(data=True) if d["op"] == "linear" and d["inputs"][1] == weight)


def kernel_of(G, node: str) -> str:
    return G.nodes[node]["kernel"]


def p(layer: int, what: str) -> str:
    return f"model.layers.{layer}.{what}.weight"


def run_both(h, graph, G, tokens=3, rows=5, seed=0):
    """run_schedule(G) vs run_graph(graph) on random inputs; returns the max relative error."""
    rng = np.random.default_rng(seed)
    weights = model_weights(graph, seed)
    feeds = {}
    for n in graph.sources("input"):
        if n.name == "ids":
            feeds[n.name] = rng.integers(0, 29, tokens).astype(np.int32)
        elif n.name == "pos":
            feeds[n.name] = np.arange(tokens, dtype=np.int32)
        else:
            feeds[n.name] = rng.standard_normal((tokens, *n.shape[1:])).astype(np.float32)
    ref = run_graph(graph, weights, feeds, new_state(graph, rows))
    out = run_schedule(G, weights, feeds, new_state(graph, rows))
    return max(h.rel_err(out[k], ref[k]) if ref[k].dtype.kind == "f" else
               float(not np.array_equal(out[k], ref[k])) for k in ref)


def compiled(graph, pass_list, tokens=3):
    return compile_graph(graph, tokens=tokens, pass_list=pass_list)


# ---- horizontal ----------------------------------------------------------------------------------

def test_horizontal_merges_qkv_and_gate_up():
    g = tiny_llama()
    before = compiled(g, [infer_shapes])
    after = compiled(g, [infer_shapes, fuse_horizontal])
    for i in range(2):
        q, k, v = (lin(after, p(i, f"self_attn.{x}_proj")) for x in "qkv")
        gate, up = lin(after, p(i, "mlp.gate_proj")), lin(after, p(i, "mlp.up_proj"))
        o, down = lin(after, p(i, "self_attn.o_proj")), lin(after, p(i, "mlp.down_proj"))
        assert len({kernel_of(before, n) for n in (q, k, v, gate, up)}) == 5       # Before: apart
        assert kernel_of(after, q) == kernel_of(after, k) == kernel_of(after, v)   # After: one
        assert kernel_of(after, gate) == kernel_of(after, up)
        assert len({kernel_of(after, n) for n in (q, gate, o, down)}) == 4
        assert sorted(members(after)[kernel_of(after, q)]) == sorted([q, k, v])
    assert len(members(before)) - len(members(after)) == 2 * 3


# ---- prologue ------------------------------------------------------------------------------------

def _norm_reading(G, weight):
    return [n for n, d in G.nodes(data=True) if d["kind"] is Kind.NORM and d["inputs"][1] == weight]


def test_prologue_puts_the_norm_inside_the_gemv(h):
    g = tiny_llama()
    before = compiled(g, [infer_shapes, fuse_horizontal])
    after = compiled(g, [infer_shapes, fuse_horizontal, fuse_prologue] + TAIL)
    for i in range(2):
        for norm_w, reader in ((p(i, "input_layernorm"), p(i, "self_attn.q_proj")),
                               (p(i, "post_attention_layernorm"), p(i, "mlp.gate_proj"))):
            [norm] = _norm_reading(after, norm_w)
            assert kernel_of(before, norm) != kernel_of(before, lin(before, reader))
            assert kernel_of(after, norm) == kernel_of(after, lin(after, reader))
            launch = next(l for l in after.graph["schedule"] if norm in l.nodes)
            assert launch.family == "gemv" and norm not in launch.writes + launch.scratch
    [final] = _norm_reading(after, "model.norm.weight")
    assert kernel_of(after, final) == kernel_of(after, lin(after, "lm_head.weight"))
    G = compile_graph(g, tokens=3, pass_list=[infer_shapes, fuse_horizontal, fuse_prologue,
                                              schedule, partial(plan_buffers, tokens=3)])
    assert run_both(h, g, G) < 1e-5


def test_prologue_clones_the_norm_per_gemv_kernel(h):
    """Without horizontal fusion Q, K and V sit in three kernels: each gets its own copy of the norm."""
    g = tiny_llama()
    G = compile_graph(g, tokens=3, pass_list=[infer_shapes, fuse_prologue, schedule,
                                              partial(plan_buffers, tokens=3)])
    print(as_text(G))
    for i in range(2):
        copies = _norm_reading(G, p(i, "input_layernorm"))
        assert len(copies) == 3
        kernels = {kernel_of(G, c) for c in copies}
        assert kernels == {kernel_of(G, lin(G, p(i, f"self_attn.{x}_proj"))) for x in "qkv"}
        attrs = [(G.nodes[c]["inputs"], G.nodes[c]["attrs"]) for c in copies]
        assert all(a == attrs[0] for a in attrs)
        for c in copies:   # each copy feeds only the linear of its own kernel
            assert {kernel_of(G, r) for r in G.successors(c)} == {kernel_of(G, c)}
    assert run_both(h, g, G) < 1e-5


# ---- epilogue ------------------------------------------------------------------------------------

def test_epilogue_takes_bias_rope_kv_write_silu_mul_and_residual_adds(h):
    g = tiny_llama(layers=2, bias=True)
    no_epi = compiled(g, [infer_shapes, fuse_horizontal, fuse_prologue])
    G = compile_graph(g, tokens=3)
    print(as_text(G))
    for i in range(2):
        qkv = kernel_of(G, lin(G, p(i, "self_attn.q_proj")))
        ops = [G.nodes[n]["op"] for n in members(G)[qkv]]
        assert ops.count("linear") == 3 and ops.count("add") == 3        # the biases
        assert ops.count("rope") == 2 and ops.count("kv_write") == 2
        biases = [n for n in members(G)[qkv] if G.nodes[n]["op"] == "add"]
        assert all(G.nodes[G.nodes[b]["inputs"][1]]["op"] == "weight" for b in biases)
        gu = kernel_of(G, lin(G, p(i, "mlp.gate_proj")))
        assert sorted(G.nodes[n]["op"] for n in members(G)[gu]) == \
            ["linear", "linear", "mul", "rmsnorm", "silu"]
        for w in ("self_attn.o_proj", "mlp.down_proj"):     # residual adds
            k = kernel_of(G, lin(G, p(i, w)))
            nodes = members(G)[k]                            # (o_proj has a bias too here)
            assert [G.nodes[n]["op"] for n in nodes] == ["linear"] + ["add"] * (len(nodes) - 1)
            assert all(G.nodes[i]["op"] != "weight" for i in G.nodes[nodes[-1]]["inputs"])
        for k in (qkv, gu):                                  # Before: each op its own kernel
            for n in members(G)[k]:
                if G.nodes[n]["kind"] in (Kind.ELEMENTWISE, Kind.ROW_LOCAL, Kind.CACHE_WRITE):
                    assert members(no_epi)[kernel_of(no_epi, n)] == [n]
        launch = next(l for l in G.graph["schedule"] if l.kernel == qkv)
        written = {G.nodes[n]["op"] for n in launch.writes}
        assert written == {"rope", "kv_write"}   # q after RoPE for attention; K, V into the cache
    assert run_both(h, g, G) < 1e-5


# ---- launches per layer --------------------------------------------------------------------------

@pytest.mark.parametrize("graph", [tiny_llama(3), tiny_llama(3, bias=True),
                                   tiny_llama(3, arch="MistralForCausalLM", sliding_window=2)],
                         ids=["llama", "llama-bias", "mistral"])
def test_launches_per_layer(h, graph):
    G = compile_graph(graph, tokens=1)
    sched = G.graph["schedule"]
    per_layer = {}
    for l in sched:
        per_layer.setdefault(l.layer, []).append(l.family)
    assert sorted(k for k in per_layer if k is not None) == [0, 1, 2]
    for i in range(3):
        assert len(per_layer[i]) <= 5
        assert per_layer[i].count("attention") == 1
        assert per_layer[i] == ["gemv", "attention", "gemv", "gemv", "gemv"]
    first, last = sched[0], sched[-1]
    assert per_layer[None] == ["rowwise", "gemv"]
    assert first.layer is None and [G.nodes[n]["op"] for n in first.nodes] == ["embedding"]
    assert last.layer is None and [G.nodes[n]["op"] for n in last.nodes] == ["rmsnorm", "linear"]
    assert len(sched) == 3 * 5 + 2
    assert run_both(h, graph, compile_graph(graph, tokens=1), tokens=1, rows=1) < 1e-5


# ---- state only (batched prefill) ----------------------------------------------------------------

def test_keep_state_drops_what_no_cache_write_needs():
    g = tiny_llama(2)
    before = to_networkx(g)
    after = keep_state(before)
    assert after.graph["outputs"] == {} and before.graph["outputs"]      # before is untouched
    dropped = set(before) - set(after)
    assert lin(before, "lm_head.weight" if "lm_head.weight" in before else "model.embed_tokens.weight") in dropped
    assert "model.norm.weight" in dropped                                    # the final norm's gain
    for w in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj", "self_attn.q_proj"):
        assert lin(before, p(1, w)) in dropped and lin(before, p(0, w)) in after   # the last layer's
    for w in ("self_attn.k_proj", "self_attn.v_proj"):
        assert lin(before, p(1, w)) in after
    writes = [n for n, d in after.nodes(data=True) if d["kind"] is Kind.CACHE_WRITE]
    assert len(writes) == 4
    for n, d in after.nodes(data=True):      # every compute node left feeds some cache write
        if d["kind"] is not Kind.SOURCE:
            assert n in writes or nx.descendants(after, n) & set(writes), n
    validate(after)


@pytest.mark.parametrize("graph", [tiny_llama(2), tiny_llama(2, bias=True),
                                   tiny_llama(2, arch="MistralForCausalLM", sliding_window=3)],
                         ids=["llama", "llama-bias", "mistral"])
def test_a_state_only_step_of_several_tokens_fills_the_caches_like_one_token_steps(h, graph):
    """The prefill graph (state_only, T tokens per step) leaves the KV caches the full graph
    leaves when fed the same tokens one step at a time."""
    tokens, rows = 6, 8
    G = compile_graph(graph, tokens=tokens, state_only=True)
    assert G.graph["outputs"] == {} and all(l.family != "moe" for l in G.graph["schedule"])
    weights = model_weights(graph, 1)
    ids = np.random.default_rng(1).integers(0, 29, tokens).astype(np.int32)
    batched = new_state(graph, rows)
    run_schedule(G, weights, {"ids": ids, "pos": np.arange(tokens, dtype=np.int32)}, batched)
    stepped = new_state(graph, rows)
    for t in range(tokens):
        run_graph(graph, weights, {"ids": ids[t:t + 1], "pos": np.array([t], np.int32)}, stepped)
    for name in stepped:
        assert np.abs(stepped[name][:tokens]).max() > 0
        assert h.rel_err(batched[name], stepped[name]) < 1e-5, name


# ---- purity --------------------------------------------------------------------------------------

def snapshot(G: nx.DiGraph):
    """Everything a pass could change, deep-copied into comparable form."""
    graph = {k: (sorted((c, a.tobytes()) for c, a in v.items()) if k == "constants" else copy.deepcopy(v))
             for k, v in G.graph.items()}
    return (repr(graph), [(n, repr(sorted(copy.deepcopy(dict(d)).items(), key=lambda kv: kv[0])))
                          for n, d in G.nodes(data=True)], sorted(G.edges))


def _assert_pure(G0, state_only=False):
    G = G0
    for pss in passes(fuse=True, tokens=2, state_only=state_only):
        before = snapshot(G)
        out = pss(G)
        assert out is not G
        assert snapshot(G) == before, f"{getattr(pss, 'func', pss).__name__} changed its input"
        validate(out)
        G = out


def test_every_pass_is_pure_on_a_model():
    _assert_pure(to_networkx(tiny_llama(2, bias=True)))
    _assert_pure(to_networkx(tiny_llama(2, bias=True)), state_only=True)


@given(case=random_graphs())
def test_every_pass_is_pure_on_random_graphs(case):
    compile_graph(case.graph, tokens=2, pass_list=passes(fuse=True, tokens=2))   # compiles at all
    _assert_pure(to_networkx(case.graph))


def test_the_purity_check_sees_an_in_place_change():
    def impure(G):
        n = next(iter(G))
        G.nodes[n]["attrs"]["touched"] = True     # the nested dict, shared by a shallow copy
        return G.copy()
    G = to_networkx(tiny_llama(1))
    before = snapshot(G)
    impure(G.copy())   # a copy's nested attrs are still the original's
    assert snapshot(G) != before


# ---- validation ----------------------------------------------------------------------------------

def _chain():
    """x -> linear -> silu -> linear: lowered and shaped."""
    g = Graph("chain")
    y = g.op("linear", g.input("x", ("T", 4)), g.weight("w1", (6, 4)))
    z = g.op("linear", g.op("silu", y), g.weight("w2", (3, 6)))
    g.output(z=z)
    return g, infer_shapes(to_networkx(g))


def test_validate_rejects_a_cycle_in_the_kernel_graph():
    g, G = _chain()
    validate(G)
    y, z = [n for n in G if G.nodes[n]["op"] == "linear"]
    G.nodes[z]["kernel"] = G.nodes[y]["kernel"]        # silu would run both after and before it
    assert not nx.is_directed_acyclic_graph(kernel_graph(G))
    with pytest.raises(InvalidGraph, match="kernel graph has a cycle"):
        validate(G)


def test_validate_rejects_reading_before_writing():
    g, _ = _chain()
    G = compile_graph(g, fuse=False)
    validate(G)
    G.graph["schedule"] = G.graph["schedule"][::-1]
    with pytest.raises(InvalidGraph, match="before anything writes them"):
        validate(G)


def test_validate_rejects_other_broken_graphs():
    g, G = _chain()
    a = G.copy()
    a.add_edge(next(n for n in a if a.nodes[n]["op"] == "silu"), "x")
    with pytest.raises(InvalidGraph, match="the graph has a cycle"):
        validate(a)
    b = G.copy()
    b.remove_edge("w1", next(n for n in b if b.nodes[n]["op"] == "linear"))
    with pytest.raises(InvalidGraph, match="differ from inputs"):
        validate(b)
    c = G.copy()
    c.nodes["x"]["kernel"] = "oops"
    with pytest.raises(InvalidGraph, match="sources have no kernel"):
        validate(c)
    d = G.copy()
    silu = next(n for n in d if d.nodes[n]["op"] == "silu")
    d.nodes[silu]["kind"] = Kind.REDUCTION                # a reduction cannot run in an epilogue
    d.nodes[silu]["kernel"] = d.nodes[next(n for n in d if d.nodes[n]["op"] == "linear")]["kernel"]
    with pytest.raises(InvalidGraph, match="cannot run in a GEMV epilogue"):
        validate(d)


def test_the_pipeline_validates_after_every_pass():
    g, _ = _chain()

    def breaks_it(G):
        G = G.copy()
        y, z = [n for n in G if G.nodes[n]["op"] == "linear"]
        G.nodes[z]["kernel"] = G.nodes[y]["kernel"]
        return G
    with pytest.raises(InvalidGraph, match="kernel graph has a cycle"):
        compile_graph(g, pass_list=[infer_shapes, breaks_it, schedule, plan_buffers])


# ---- trait-driven fusion: an op the compiler has never heard of ----------------------------------

@pytest.fixture
def mytest_op():
    op = register(OpDef("mytest_op", Kind.ELEMENTWISE, 1, elementwise_shape,
                        lambda a: (a * a + np.float32(0.1171875)).astype(np.float32),
                        c_expr="fmaf({a}, {a}, 0.1171875f)"))
    yield op
    REGISTRY.pop("mytest_op", None)


def test_a_new_elementwise_op_is_fused_into_a_gemv_epilogue(h, mytest_op):
    g = Graph("custom")
    x = g.input("x", ("T", 7))
    y = g.op("linear", g.op("rmsnorm", x, g.weight("nw", (7,)), eps=1e-5), g.weight("w", (5, 7)))
    z = g.op("mytest_op", y + g.weight("b", (5,)))
    g.output(z=g.op("mytest_op", z))
    G = compile_graph(g, tokens=2)
    print(as_text(G))
    [launch] = G.graph["schedule"]
    assert launch.family == "gemv"
    assert [G.nodes[n]["op"] for n in launch.nodes] == ["rmsnorm", "linear", "add", "mytest_op", "mytest_op"]
    assert launch.writes == [g.outputs["z"]]
    assert run_both(h, g, G, tokens=2) < 1e-5
    [src] = generate(G, ctx=4)
    assert src.source.count("fmaf(") == 2 and "0.1171875f" in src.source
    assert compile_graph(g, fuse=False, tokens=2).graph["schedule"][-1].family == "rowwise"


# ---- legality refusals ---------------------------------------------------------------------------

def test_softmax_after_a_linear_is_its_tail_not_its_epilogue(h):
    """A softmax needs the whole row: not an epilogue (fuse_epilogue takes only the silu), but the
    row-wise tail the last block runs (fuse_tail); without fuse_tail, a row-wise kernel."""
    g = Graph("sm")
    y = g.op("linear", g.input("x", ("T", 6)), g.weight("w", (9, 6)))
    silu = g.op("silu", y)
    s = g.op("softmax", silu)
    g.output(s=s)
    G = compile_graph(g, tokens=2)
    assert kernel_of(G, s.name) == kernel_of(G, silu.name) == kernel_of(G, y.name)
    body, tail = split_tail(G, members(G)[kernel_of(G, y.name)])
    assert tail == [s.name] and silu.name in body
    (launch,) = G.graph["schedule"]
    assert launch.scratch == [silu.name]                   # the tail reads it back from memory
    assert run_both(h, g, G, tokens=2) < 1e-5
    plist = [p for p in passes(tokens=2) if p is not fuse_tail]
    G = compile_graph(g, tokens=2, pass_list=plist)
    assert kernel_of(G, s.name) != kernel_of(G, y.name)
    assert family(G, members(G)[kernel_of(G, s.name)]) == "rowwise"


def test_norm_read_by_a_non_linear_stays_its_own_kernel_and_is_written(h):
    g = Graph("nn")
    n = g.op("rmsnorm", g.input("x", ("T", 6)), g.weight("nw", (6,)), eps=1e-5)
    y = g.op("linear", n, g.weight("w", (4, 6)))
    g.output(y=y, s=g.op("softcap", n, cap=2.0))
    G = compile_graph(g, tokens=2)
    print(as_text(G))
    assert kernel_of(G, n.name) != kernel_of(G, y.name)
    launch = next(l for l in G.graph["schedule"] if n.name in l.nodes)
    assert launch.family == "rowwise" and n.name in launch.writes
    assert run_both(h, g, G, tokens=2) < 1e-5


def test_an_epilogue_value_read_by_a_later_kernel_is_written(h):
    g = Graph("ep")
    y = g.op("linear", g.input("x", ("T", 6)), g.weight("w", (5, 6)))
    b = y + g.weight("b", (5,))
    z = g.op("linear", b, g.weight("w2", (3, 5)))
    sm = g.op("softmax", b)
    g.output(z=z, s=sm)
    G = compile_graph(g, tokens=2)
    launch = next(l for l in G.graph["schedule"] if y.name in l.nodes)
    assert b.name in launch.nodes and launch.writes == [b.name, sm.name]   # the softmax: its tail
    assert run_both(h, g, G, tokens=2) < 1e-5


def test_an_operand_computed_after_the_gemv_does_not_make_a_cycle(h):
    """y = linear(x); z = y + linear(silu(y)): z cannot join y's kernel (it needs a later GEMV)."""
    g = Graph("cyc")
    y = g.op("linear", g.input("x", ("T", 6)), g.weight("w", (6, 6)))
    y2 = g.op("linear", g.op("silu", y), g.weight("w2", (6, 6)))
    z = y + y2
    g.output(z=z)
    for plist in (None, [infer_shapes, fuse_epilogue, schedule, partial(plan_buffers, tokens=2)]):
        G = compile_graph(g, tokens=2, pass_list=plist)
        print(as_text(G))
        assert nx.is_directed_acyclic_graph(kernel_graph(G))
        assert kernel_of(G, z.name) != kernel_of(G, y.name)
        assert kernel_of(G, z.name) == kernel_of(G, y2.name)
        assert run_both(h, g, G, tokens=2) < 1e-5


def test_norm_output_is_not_a_gemv_prologue():
    g = Graph("nout")
    n = g.op("rmsnorm", g.input("x", ("T", 8)), g.weight("nw", (8,)), eps=1e-5)
    y = g.op("linear", n, g.weight("w", (6, 8)))
    g.output(n=n, y=y)
    G = compile_graph(g)
    launch = next(l for l in G.graph["schedule"] if n.name in l.nodes)
    assert launch.family != "gemv"          # else the norm is a prologue and never stored


# ---- dumps ---------------------------------------------------------------------------------------

def test_dump_writes_every_pass(tmp_path):
    g = tiny_llama(1)
    compile_graph(g, tokens=2, dump=tmp_path)
    names = ["lower"] + [getattr(q, "func", q).__name__ for q in passes(True, 2)]
    expected = {f"{i:02d}_{n}.{ext}" for i, n in enumerate(names) for ext in ("txt", "dot")}
    assert {f.name for f in tmp_path.iterdir()} == expected
    assert "plan_buffers" in names and "fuse_epilogue" in names
    last = (tmp_path / f"{len(names) - 1:02d}_plan_buffers.txt").read_text()
    assert "arena_bytes = " in last and "kernel " in last
    assert (tmp_path / "00_lower.dot").read_text().startswith("digraph G {")
    # the dumps differ where the passes did something
    assert (tmp_path / "01_infer_shapes.txt").read_text() != (tmp_path / "02_fuse_horizontal.txt").read_text()


def epilogue_cycle_graph() -> Graph:
    """Found by hypothesis (test_fusion_equivalence): a legal graph that fuse_epilogue makes cyclic.

    Kernel A = norm -> linears a, q, k, v (+ kv_writes) absorbs s = rope(y) + a, reading rope(y)
    from y's kernel B, so B -> A. Then B absorbs out = attention(q, ...) + rope(y): no node of B
    is an ancestor of the attention node, so the node-level check passes, yet the attention kernel
    reads A, which reads B: a cycle between kernels.
    """
    g = Graph("epilogue_cycle")
    x, pos = g.input("x", ("T", 2)), g.input("pos", ("T",), "i32")
    n = g.op("rmsnorm", x, g.weight("nw", (2,)), eps=1e-5)
    a = g.op("linear", n, g.weight("wa", (12, 2)))
    q = g.op("linear", n, g.weight("wq", (12, 2)))
    kc = g.op("kv_write", g.state("kc", ("S", 6)), g.op("linear", n, g.weight("wk", (6, 2))), pos)
    vc = g.op("kv_write", g.state("vc", ("S", 6)), g.op("linear", n, g.weight("wv", (6, 2))), pos)
    att = g.op("attention", q, kc, vc, pos, n_heads=2, n_kv_heads=1, head_dim=6, scale=0.4)
    r = g.op("rope", g.op("linear", x, g.weight("wy", (12, 2))), pos,
             g.constant("inv", np.ones(1, np.float32)), head_dim=4)
    g.output(s=r + a, out=att + r)
    return g


def test_epilogue_fusion_keeps_the_kernel_graph_acyclic_across_kernels(h):
    g = epilogue_cycle_graph()
    G = compile_graph(g, tokens=1)
    assert nx.is_directed_acyclic_graph(kernel_graph(G))
    assert run_both(h, g, G, tokens=1, rows=1) < 1e-5


def test_epilogue_cycle_graph_compiles_without_epilogue_fusion(h):
    """The graph above is legal without fuse_epilogue too: it compiles and runs right."""
    g = epilogue_cycle_graph()
    G = compile_graph(g, tokens=1, pass_list=[q for q in passes(True, 1) if q is not fuse_epilogue])
    assert run_both(h, g, G, tokens=1, rows=1) < 1e-5


def test_grouped_norm_is_not_a_gemv_prologue():
    """A norm with one statistic per group (per head) needs its whole row first: the GEMV prologue
    takes one statistic per row, so such a norm stays a row-wise kernel, its output written."""
    g = Graph("grouped")
    n = g.op("rmsnorm", g.input("x", ("T", 8)), g.weight("nw", (4,)), eps=1e-6, group=4)
    y = g.op("linear", n, g.weight("w", (3, 8)))
    g.output(y=y)
    G = compile_graph(g)
    launch = next(l for l in G.graph["schedule"] if n.name in l.nodes)
    assert launch.family == "rowwise" and n.name in launch.writes


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_compile_graphs_equals_compile_graph_per_step_size(fuse):
    """compile_graphs runs the size-independent passes once: each size's graph has the schedule,
    the buffer plan and the text of compile_graph for that size."""
    from fuselm.compiler import compile_graphs
    graph = build_graph(DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64,
                                                   hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2)))
    shared = compile_graphs(graph, [64, 32], fuse=fuse, state_only=True)
    assert list(shared) == [64, 32]
    for tokens, G in shared.items():
        alone = compile_graph(graph, fuse=fuse, tokens=tokens, state_only=True)
        assert G.graph["buffers"] == alone.graph["buffers"] and G.graph["arena_bytes"] == alone.graph["arena_bytes"]
        assert G.graph["schedule"] == alone.graph["schedule"] and as_text(G) == as_text(alone)
    assert shared[64].graph["arena_bytes"] == 2 * shared[32].graph["arena_bytes"]


def test_plan_early_reads_lets_a_gemv_read_early_only_what_kernels_before_the_last_gemv_wrote():
    """A two-layer Llama: the O and down projections may read their residual before the wait (its
    writer lies before the GEMV ahead of them: the previous layer's down or O, the embedding),
    never the vector the kernel right before them wrote; the position, a graph input, only where a
    GEMV lies ahead in the step (layer 1's Q/K/V, not layer 0's); weights and constants always, the
    KV caches never; row-wise and attention launches are left as they were."""
    from fuselm.compiler.plan_early_reads import plan_early_reads
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64,
                                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2))
    G = compile_graph(build_graph(cfg))
    before = compile_graph(build_graph(cfg), pass_list=passes()[:-2])   # through the schedule
    assert [replace(la, early=[]) for la in plan_early_reads(before).graph["schedule"]] == before.graph["schedule"]
    fixed = {n for n, d in G.nodes(data=True) if d["op"] in ("weight", "constant")}
    got = [(la.family, [r for r in la.early if r not in fixed]) for la in G.graph["schedule"]]
    residuals = ["embedding_1", "add_12", "add_19", "add_30"]
    assert got == [("rowwise", []), ("gemv", []), ("attention", []), ("gemv", [residuals[0]]), ("gemv", []),
                   ("gemv", [residuals[1]]), ("gemv", ["pos"]), ("attention", []), ("gemv", [residuals[2]]),
                   ("gemv", []), ("gemv", [residuals[3]]), ("gemv", [])], got
    qkv0 = G.graph["schedule"][1]
    assert "rope.inv_freq" in qkv0.early and not {"pos", "cache.0.k", "cache.0.v"} & set(qkv0.early)
    for la in G.graph["schedule"]:
        assert la.early or la.family != "gemv"        # a GEMV may read its weights early at least
        assert set(la.early) <= set(la.reads)
    lm_head = G.graph["schedule"][-1]
    assert "lm_head.weight" in lm_head.early and "add_37" not in lm_head.early


# ---- row-wise tails (fuse_tail) ------------------------------------------------------------------

def _qwen3(layers: int = 2):
    return build_graph(DecoderConfig.from_hf(dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=29, hidden_size=16, intermediate_size=24,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8)))


@pytest.mark.parametrize("tokens", [1, 3])
def test_qwen3_qk_norms_run_in_the_qkv_kernels_tail(h, tokens):
    """Qwen3's per-head Q/K norms, their RoPE and the K cache write need whole heads, which many
    blocks compute: they become the Q/K/V kernel's tail, and a layer is 5 kernels as Llama's."""
    graph = _qwen3()
    G = compile_graph(graph, tokens=tokens)
    qkv = [l for l in G.graph["schedule"] if l.family == "gemv" and l.layer == 0][0]
    body, tail = split_tail(G, qkv.nodes)
    assert [G.nodes[n]["op"] for n in tail] == ["rmsnorm", "rmsnorm", "rope", "rope", "kv_write"]
    assert [l.family for l in G.graph["schedule"] if l.layer == 0] == ["gemv", "attention", "gemv", "gemv", "gemv"]
    q, k = (G.nodes[n]["inputs"][0] for n in tail[:2])
    assert {q, k} <= set(qkv.scratch) and {q, k} <= set(body)    # stored for the tail to read back
    assert run_both(h, graph, G, tokens=tokens) < 1e-5


def test_a_tail_reads_the_gemvs_results_from_memory(h):
    """The executor runs a tail as the last block does: from the stored values. A plan that does
    not store what the tail reads fails there."""
    graph = _qwen3(1)
    G = compile_graph(graph, tokens=1)
    qkv = next(l for l in G.graph["schedule"] if split_tail(G, l.nodes)[1])
    lost = qkv.scratch[0]
    bad = G.copy()
    bad.graph["schedule"] = [replace(l, scratch=l.scratch[1:]) if l is qkv else l for l in G.graph["schedule"]]
    bad.graph["buffers"] = {v: b for v, b in G.graph["buffers"].items() if v != lost}
    with pytest.raises(ScheduleError, match=f"{lost} is read from memory but has no buffer"):
        run_both(h, graph, bad, tokens=1)


def test_tails_generate_a_last_block_for_a_token_and_a_launch_for_a_step():
    graph = _qwen3(1)
    [qkv] = [k for k in generate(compile_graph(graph, tokens=1), ctx=8) if "_tail" in k.name]
    assert "last_block_arrives(" in qkv.source and "RowFromL2{" in qkv.source
    step = generate(compile_graph(graph, tokens=32, state_only=True), ctx=64, tokens=32)
    families = [k.family for k in step]
    i = next(i for i, k in enumerate(step) if k.family == "gemm")
    assert families[i + 1] == "rowwise" and "last_block_arrives(" not in step[i].source
    assert "rmsnorm_row(" in step[i + 1].source

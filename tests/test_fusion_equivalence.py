"""Fused vs unfused vs the op-by-op oracle, through the schedule executor (runtime/schedule_reference).

For random DSL graphs and random tiny Llama/Mistral configs, every compilation (all fusion passes,
each fusion pass left out in turn, no fusion at all) is run launch by launch through one
NaN-poisoned arena and compared with run_graph on the original DSL graph. A fusion that changes
the math, a value no kernel stores, a buffer plan that overlaps live values, or a launch order
that reads before writing all show up as a difference or a NaN. The KV caches (state) must also
end up equal.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, note, settings, strategies as st

from fuselm.compiler import FUSION_PASSES, compile_graph
from fuselm.compiler.dump import as_text
from fuselm.compiler.kernels import kernel_graph
from fuselm.compiler.pipeline import passes
from fuselm.models import DecoderConfig, build_graph
from fuselm.runtime.reference import new_state, run_graph
from fuselm.runtime.schedule_reference import ScheduleError, run_schedule

from graph_strategies import model_weights, random_graphs, tiny_llama_configs

import networkx as nx

RTOL = 1e-5


def variants(tokens: int) -> dict[str, list]:
    """Pass lists: everything, each fusion pass dropped in turn, and no fusion."""
    full = passes(fuse=True, tokens=tokens)
    out = {"all": full, "unfused": passes(fuse=False, tokens=tokens)}
    for p in FUSION_PASSES:
        out[f"without_{p.__name__}"] = [q for q in full if q is not p]
    return out


def assert_close(out: dict, ref: dict, what: str, rel_err) -> None:
    assert out.keys() == ref.keys()
    for k in ref:
        o, r = np.asarray(out[k]), np.asarray(ref[k])
        assert o.shape == r.shape, f"{what}: output {k} has shape {o.shape}, expected {r.shape}"
        if r.dtype.kind == "i":
            np.testing.assert_array_equal(o, r, err_msg=f"{what}: output {k}")
        elif np.linalg.norm(r) == 0:
            np.testing.assert_array_equal(o, r, err_msg=f"{what}: output {k}")
        else:
            err = rel_err(o, r)
            assert err < RTOL, f"{what}: output {k} differs from run_graph, rel err {err}"


@settings(max_examples=3 * settings.default.max_examples)   # the backbone: 60 in CI
@given(case=random_graphs())
def test_random_graphs_every_pass_list_matches_run_graph(h, case):
    ref_state = case.fresh_state()
    ref = run_graph(case.graph, case.weights, case.feeds, ref_state)
    for name, plist in variants(case.tokens).items():
        G = compile_graph(case.graph, tokens=case.tokens, pass_list=plist)
        note(f"--- {name} (T={case.tokens})\n{as_text(G)}")
        assert nx.is_directed_acyclic_graph(kernel_graph(G))
        state = case.fresh_state()
        out = run_schedule(G, case.weights, case.feeds, state)
        assert_close(out, ref, name, h.rel_err)
        for k in ref_state:
            np.testing.assert_array_equal(state[k], ref_state[k], err_msg=f"{name}: state {k}")


@given(case=random_graphs(max_blocks=10), fuse=st.booleans())
def test_fuse_flag_and_repeated_runs(h, case, fuse):
    """The pass lists of compile_graph(fuse=True/False), on graphs of up to 10 blocks."""
    G = compile_graph(case.graph, tokens=case.tokens, pass_list=passes(fuse=fuse, tokens=case.tokens))
    note(as_text(G))
    ref = run_graph(case.graph, case.weights, case.feeds, case.fresh_state())
    assert_close(run_schedule(G, case.weights, case.feeds, case.fresh_state()), ref, "fuse", h.rel_err)


def _decode(run, graphs, weights, prompt, steps, rows, graph):
    state, outs, pos = new_state(graph, rows), [], 0
    for chunk in [prompt] + [[t] for t in steps]:
        feeds = {"ids": np.array(chunk, np.int32), "pos": np.arange(pos, pos + len(chunk), dtype=np.int32)}
        outs.append(run(graphs[len(chunk)], weights, feeds, state)["logits"])
        pos += len(chunk)
    return outs, state


@settings(max_examples=12)
@given(cfg=tiny_llama_configs(), data=st.data())
def test_tiny_models_fused_unfused_and_oracle_agree(h, cfg, data):
    dc = DecoderConfig.from_hf(cfg, source="tiny")
    graph = build_graph(dc)
    weights = model_weights(graph, data.draw(st.integers(0, 999), label="seed"))
    T = data.draw(st.integers(1, 4), label="prompt length")
    prompt = data.draw(st.lists(st.integers(0, dc.vocab_size - 1), min_size=T, max_size=T), label="prompt")
    steps = data.draw(st.lists(st.integers(0, dc.vocab_size - 1), min_size=1, max_size=3), label="steps")
    rows = T + len(steps)
    note(f"config {cfg}")
    ref, ref_state = _decode(run_graph, {T: graph, 1: graph}, weights, prompt, steps, rows, graph)
    for fuse in (True, False):
        compiled = {t: compile_graph(graph, fuse=fuse, tokens=t) for t in {T, 1}}
        note(as_text(compiled[1]))
        outs, state = _decode(run_schedule, compiled, weights, prompt, steps, rows, graph)
        for i, (o, r) in enumerate(zip(outs, ref)):
            assert_close({"logits": o}, {"logits": r}, f"fuse={fuse} call {i}", h.rel_err)
        for k in ref_state:
            np.testing.assert_array_equal(state[k], ref_state[k], err_msg=f"fuse={fuse} state {k}")


# ---- the executor itself: it must catch what it exists to catch ----------------------------------

def _tiny():
    cfg = DecoderConfig.from_hf(dict(architectures=["LlamaForCausalLM"], vocab_size=23, hidden_size=12,
                                     intermediate_size=19, num_hidden_layers=2, num_attention_heads=3,
                                     num_key_value_heads=1, head_dim=4), source="tiny")
    graph = build_graph(cfg)
    feeds = {"ids": np.array([3, 1, 4], np.int32), "pos": np.arange(3, dtype=np.int32)}
    return graph, model_weights(graph, 0), feeds


@pytest.mark.parametrize("fuse", [True, False])
def test_executor_catches_overlapping_buffers(h, fuse):
    graph, weights, feeds = _tiny()
    G = compile_graph(graph, fuse=fuse, tokens=3)
    ref = run_graph(graph, weights, feeds, new_state(graph, 3))["logits"]
    assert h.rel_err(run_schedule(G, weights, feeds, new_state(graph, 3))["logits"], ref) < RTOL
    bad = G.copy()
    bad.graph["buffers"] = {v: (0, n) for v, (o, n) in G.graph["buffers"].items()}   # all at 0
    out = run_schedule(bad, weights, feeds, new_state(graph, 3))["logits"]
    assert not h.rel_err(out, ref) < RTOL


def test_executor_catches_a_missing_write_and_a_wrong_order():
    graph, weights, feeds = _tiny()
    G = compile_graph(graph, tokens=3)
    unwritten = G.copy()
    victim = next(l for l in G.graph["schedule"] if l.family == "attention")
    unwritten.graph["schedule"] = [replace(l, writes=[]) if l is victim else l   # nobody stores
                                   for l in G.graph["schedule"]]                 # the attention output
    out = run_schedule(unwritten, weights, feeds, new_state(graph, 3))["logits"]
    assert np.isnan(out).all()                            # poisoned, and so visible
    swapped = G.copy()
    s = list(G.graph["schedule"])
    s[3], s[4] = s[4], s[3]
    swapped.graph["schedule"] = s
    out = run_schedule(swapped, weights, feeds, new_state(graph, 3))["logits"]
    ref = run_graph(graph, weights, feeds, new_state(graph, 3))["logits"]
    assert not np.allclose(out, ref, rtol=RTOL, atol=0)
    nobuf = G.copy()
    nobuf.graph["buffers"] = {k: v for k, v in G.graph["buffers"].items()
                              if k != victim.nodes[0]}
    with pytest.raises(ScheduleError, match="no buffer"):
        run_schedule(nobuf, weights, feeds, new_state(graph, 3))

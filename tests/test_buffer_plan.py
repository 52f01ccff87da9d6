"""The buffer plan (compiler/plan_buffers.py), checked against liveness recomputed here.

Liveness is derived independently of plan_buffers' own `buffer_life`: from the schedule's node
lists and the graph's edges, a value is born at the launch that computes it and stores it, and
dies at the last launch that has a node reading it (graph outputs live to the end). Then:
- every value some launch reads from another kernel (not a source, not in-place state) has a
  buffer, written by an earlier launch;
- every buffer lies inside the arena and is exactly as large as its value;
- no two buffers alive at one launch share a byte;
- reuse strictly shrinks the arena on every preset model and on random graphs in which some two
  buffers are never alive together.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, note

from fuselm.compiler import compile_graph
from fuselm.compiler.dump import as_text
from fuselm.compiler.pipeline import passes
from fuselm.dsl import Graph, Kind, get
from fuselm.models import DecoderConfig, build_graph
from fuselm.models.presets import PRESETS

from graph_strategies import random_graphs


def _in_place(G, v) -> bool:
    return G.nodes[v]["kind"] is not Kind.SOURCE and get(G.nodes[v]["op"]).inplace_of is not None


def liveness(G) -> dict[str, tuple[int, int]]:
    """value -> (launch that stores it, last launch that reads it) for every arena value."""
    sched = G.graph["schedule"]
    where = {n: i for i, l in enumerate(sched) for n in l.nodes}
    life = {}
    for i, l in enumerate(sched):
        for v in l.writes + l.scratch:
            if not _in_place(G, v):
                assert v not in life, f"{v} stored by two launches"
                life[v] = [i, i]
    for v in list(life):
        readers = [where[r] for r in G.successors(v) if where[r] != where[v]]
        life[v][1] = max(readers + [life[v][0]])
    for v in G.graph["outputs"].values():
        if v in life:
            life[v][1] = len(sched)
    return {v: tuple(t) for v, t in life.items()}


def check_plan(G, tokens: int) -> dict[str, tuple[int, int]]:
    sched, buffers, arena = G.graph["schedule"], G.graph["buffers"], G.graph["arena_bytes"]
    life = liveness(G)
    assert set(buffers) == set(life), (set(buffers) ^ set(life))
    # every cross-kernel read is stored by an earlier launch
    where = {n: i for i, l in enumerate(sched) for n in l.nodes}
    for i, l in enumerate(sched):
        for n in l.nodes:
            for src in G.nodes[n]["inputs"]:
                if src in l.nodes or G.nodes[src]["kind"] is Kind.SOURCE or _in_place(G, src):
                    continue
                assert src in buffers, f"launch {i} reads {src}, which has no buffer"
                assert life[src][0] < i, f"launch {i} reads {src} before launch {life[src][0]} stores it"
    for v in G.graph["outputs"].values():
        assert v in buffers or _in_place(G, v) or G.nodes[v]["kind"] is Kind.SOURCE
    # inside the arena, of the right size
    for v, (off, nbytes) in buffers.items():
        shape = [tokens if d == "T" else d for d in G.nodes[v]["shape"]]
        assert nbytes == 4 * int(np.prod(shape)), v
        assert 0 <= off and off + nbytes <= arena, (v, off, nbytes, arena)
    # no two live buffers overlap
    for (a, (fa, la)), (b, (fb, lb)) in itertools.combinations(life.items(), 2):
        if fa <= lb and fb <= la:
            (oa, na), (ob, nb) = buffers[a], buffers[b]
            assert oa + na <= ob or ob + nb <= oa, \
                f"{a} [{oa}, {oa + na}) live {fa}..{la} overlaps {b} [{ob}, {ob + nb}) live {fb}..{lb}"
    return life


def _preset_graph(name: str, layers: int | None = None):
    d = dict(PRESETS[name])
    if layers:
        d["num_hidden_layers"] = layers
    return build_graph(DecoderConfig.from_hf(d, source=f"preset {name}"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_plan_is_sound_and_reuse_shrinks_the_arena(name):
    """Every preset's structure at 3 layers (full depth is below for two of them: CI time)."""
    G = compile_graph(_preset_graph(name, 3), tokens=1)
    check_plan(G, 1)
    assert G.graph["arena_bytes"] < G.graph["arena_bytes_no_reuse"]
    # one layer's worth of activations, not one per layer: the arena does not grow with depth
    assert G.graph["arena_bytes"] == compile_graph(_preset_graph(name, 2), tokens=1).graph["arena_bytes"]


@pytest.mark.parametrize("name, arena, no_reuse", [("llama-3.2-1b", 521216, 1569792),
                                                   ("llama-3.1-8b", 529408, 4461568)])
def test_full_depth_presets(name, arena, no_reuse):
    """The figures at tokens=1 (the LM head's logits, vocab 128256 x 4 bytes, dominate the arena)."""
    G = compile_graph(_preset_graph(name), tokens=1)
    check_plan(G, 1)
    assert G.graph["arena_bytes_no_reuse"] == no_reuse
    assert G.graph["arena_bytes"] <= arena < no_reuse
    assert G.graph["arena_bytes"] == compile_graph(_preset_graph(name, 2), tokens=1).graph["arena_bytes"]


@pytest.mark.parametrize("fuse", [True, False])
@given(case=random_graphs())
def test_random_graph_plans_are_sound(case, fuse):
    G = compile_graph(case.graph, tokens=case.tokens, pass_list=passes(fuse=fuse, tokens=case.tokens))
    note(as_text(G))
    check_plan(G, case.tokens)


@given(case=random_graphs(min_blocks=3))
def test_reuse_shrinks_the_arena_when_lifetimes_allow(case):
    G = compile_graph(case.graph, fuse=False, tokens=case.tokens)
    note(as_text(G))
    life = check_plan(G, case.tokens)
    assume(len(life) >= 3 and len(set(life.values())) >= 3)
    disjoint = any(la < fb or lb < fa for (fa, la), (fb, lb) in itertools.combinations(life.values(), 2))
    assume(disjoint)
    assert G.graph["arena_bytes"] < G.graph["arena_bytes_no_reuse"]


def test_chain_reuses_exactly():
    """x -> linear -> silu -> scale -> softcap, unfused: a chain needs only two live buffers."""
    g = Graph("chain")
    y = g.op("linear", g.input("x", ("T", 8)), g.weight("w", (64, 8)))    # 256 bytes per token
    for op, attrs in (("silu", {}), ("scale", {"factor": 2.0}), ("softcap", {"cap": 3.0}),
                      ("silu", {})):
        y = g.op(op, y, **attrs)
    g.output(y=y)
    G = compile_graph(g, fuse=False, tokens=1)
    check_plan(G, 1)
    assert G.graph["arena_bytes_no_reuse"] == 5 * 256
    assert G.graph["arena_bytes"] == 2 * 256


def test_check_plan_catches_an_overlap():
    """The checker itself: moving one live buffer onto another must be caught."""
    G = compile_graph(_preset_graph("smollm2-135m", 3), tokens=1)
    life = check_plan(G, 1)
    a, b = next((a, b) for (a, (fa, la)), (b, (fb, lb)) in itertools.combinations(life.items(), 2)
                if fa <= lb and fb <= la)
    bad = G.copy()
    bad.graph["buffers"] = dict(G.graph["buffers"])
    bad.graph["buffers"][b] = (G.graph["buffers"][a][0], G.graph["buffers"][b][1])
    with pytest.raises(AssertionError, match="overlaps"):
        check_plan(bad, 1)

"""The block timeline (tools/trace.py, kernels built with trace=True) without a GPU: every kernel of a traced
module records its own id, the traced module compiles with NVRTC, and block events made up here
are read back into the launch rows and the per-layer pattern they describe."""
from __future__ import annotations

import re

import numpy as np
import pytest

from fuselm.codegen import Tuning, generate, headers, module_source
from fuselm.codegen import sample
from fuselm.codegen.build import trace_ids
from fuselm.codegen.nvrtc import compile_cubin, options
from fuselm.compiler import compile_graph
from fuselm.errors import FuselmError
from fuselm.models import DecoderConfig, build_graph
from fuselm.tools import trace

CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def kernels():
    G = compile_graph(build_graph(DecoderConfig.from_hf(CONFIG, source="trace test")), tokens=1)
    return generate(G, ctx=512) + [sample.generate(CONFIG["vocab_size"], Tuning())]


def test_traced_module_numbers_its_kernels_in_order_and_compiles(kernels):
    source = module_source(kernels, trace=True)
    assert source.startswith("#define FUSELM_TRACE 1")
    names = trace_ids(kernels)
    # the functions as the module defines them, each followed by the id it records
    defined = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\([^{]*\{\s*'
                         r'TRACE_BLOCK_AS\((\d+)\);', source)
    assert defined == [(name, str(i)) for i, name in enumerate(names)] and len(set(names)) == len(names)
    launched = {launch.function for k in kernels for launch in k.all_launches()}
    assert launched == set(names)
    cubin, _, _ = compile_cubin(source, headers(), options("sm_90"), use_cache=False)
    assert cubin[:4] == b"\x7fELF"


def test_untraced_module_has_no_timeline(kernels):
    source = module_source(kernels)
    assert "TRACE_BLOCK_AS" not in source and "FUSELM_TRACE 1" not in source


class FakeEngine:
    """What trace.launches reads of an engine: its kernels and the schedule of a step at a position."""

    def __init__(self, kernels, position):
        self.kernels = kernels
        self.entries = self.schedule_at(position)

    def schedule_at(self, position):
        return [(k, launch, None) for k in self.kernels for launch in k.launches_at(position)]


def made_up_events(engine, steps, position=300, gap_ns=500, run_ns=1000, stagger_ns=10, wait_ns=200):
    """Each launch's blocks start `stagger_ns` apart, wait `wait_ns` and run `run_ns`; the next
    launch starts `gap_ns` after the last block's end. Returned shuffled, as the GPU's atomics would."""
    names = trace_ids(engine.kernels)
    rows, t = [], 10**9
    for step in range(steps):
        for _, launch, _ in engine.schedule_at(position + step):
            blocks = int(np.prod([1 if g == "T" else g for g in launch.grid]))
            for b in range(blocks):
                start = t + b * stagger_ns
                rows.append([names.index(launch.function) << 48 | (b % 7) << 32 | b,
                             start, start + wait_ns, start + run_ns])
            t += run_ns + (blocks - 1) * stagger_ns + gap_ns
    events = np.array(rows, np.uint64)
    return events[np.random.default_rng(0).permutation(len(events))]


def test_launch_rows_and_layer_pattern_from_block_events(kernels):
    engine = FakeEngine(kernels, position=300)
    rows = trace.launches(engine, made_up_events(engine, steps=2), 300, 2)
    assert len(rows) == 2 * len(engine.entries)
    assert [r["function"] for r in rows[:len(engine.entries)]] == [l.function for _, l, _ in engine.entries]
    first = rows[0]
    assert first["first_start"] == 0 and first["median_waited"] is not None
    for r in rows:
        assert r["last_start"] - r["first_start"] == pytest.approx((r["blocks"] - 1) * 0.01)
        assert r["last_end"] - r["last_start"] == pytest.approx(1.0)
        assert r["sms"] == min(7, r["blocks"])
    pattern = trace.layer_pattern(rows)
    per_layer = [k for k, _, _ in engine.entries if k.layer == 1]
    assert [p["function"] for p in pattern] == [l.function for k, l, _ in engine.entries if k.layer == 1]
    assert len(pattern) == len(per_layer)
    for p in pattern:
        assert p["first_start"] == pytest.approx(0.5)
        assert p["median_waited"] - p["median_start"] == pytest.approx(0.2)
        assert p["last_end"] == pytest.approx(0.5 + 1.0 + (p["blocks"] - 1) * 0.01)


def test_the_printed_pattern_names_every_launch_and_sums_the_layer(kernels, capsys):
    engine = FakeEngine(kernels, position=300)
    pattern = trace.layer_pattern(trace.launches(engine, made_up_events(engine, steps=1), 300, 1))
    trace._print(pattern, "300", 123.4)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("position 300: step 123.4 us")
    assert [line.split()[0] for line in out[2:-1]] == [p["function"][:44] for p in pattern]
    assert out[-1] == f"layer: {sum(p['last_end'] for p in pattern):.2f} us"   # one kernel per slot here


def test_missing_or_extra_block_events_are_named(kernels):
    engine = FakeEngine(kernels, position=300)
    events = made_up_events(engine, steps=1)
    with pytest.raises(FuselmError, match=r"block events where \d+ were launched"):
        trace.launches(engine, events[1:], 300, 1)
    with pytest.raises(FuselmError, match=r"^1 block events belong to no launch"):
        trace.launches(engine, np.concatenate([events, events[:1]]), 300, 1)


def test_steps_that_cross_a_variant_boundary_use_each_positions_schedule(kernels):
    """The one-launch attention up to `until`, split + combine from there: a trace whose steps
    cross it groups each step's events by that step's own launches."""
    (until,) = {v.until for k in kernels for v in k.variants}
    engine = FakeEngine(kernels, position=until - 1)
    rows = trace.launches(engine, made_up_events(engine, steps=2, position=until - 1), until - 1, 2)
    attention = [(r["step"], r["function"].rsplit("_", 1)[1]) for r in rows if r["family"] == "attention"]
    layers = len({k.layer for k in kernels if k.family == "attention"})
    assert attention == [(0, "single")] * layers + [(1, "split"), (1, "combine")] * layers
    groups = trace.by_schedule(rows)
    assert [steps for steps, _ in groups] == [[0], [1]]
    assert all({r["step"] for r in mine} == set(steps) for steps, mine in groups)


def test_record_refuses_an_untraced_build():
    class Untraced:
        traced = False
    with pytest.raises(FuselmError, match="no block timeline.*trace=True"):
        trace.record(Untraced(), position=0, steps=1)


def test_fuselm_trace_without_a_gpu_is_one_error_line(capsys, monkeypatch):
    import fuselm.runtime.cuda_engine as cuda_engine
    from fuselm import cli

    monkeypatch.setattr(cuda_engine, "gpu_available", lambda: False)
    rc = cli.main(["trace", "llama-3.2-1b"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and err.strip() == "error: fuselm trace needs an NVIDIA GPU (none found)"


def test_fuselm_trace_arguments_are_wired():
    from fuselm import cli

    args = cli.build_parser().parse_args(["trace", "smollm2-135m", "--positions", "10", "4000", "--steps", "2",
                                          "--events", "e.npz"])
    assert (args.model, args.positions, args.steps, args.events, args.json) == ("smollm2-135m", [10, 4000], 2,
                                                                                "e.npz", None)


@pytest.mark.parametrize("steps,positions,message", [(0, [100], "--steps 0: at least 1"),
                                                     (2, [-1], "--positions -1: positions are not negative")])
def test_bad_steps_or_positions_are_named_before_any_gpu_work(steps, positions, message):
    import argparse

    args = argparse.Namespace(model="llama-3.2-1b", positions=positions, steps=steps, json=None, events=None,
                              tune="")
    with pytest.raises(FuselmError, match=message):
        trace.main(args)


def test_bad_tuning_is_named_before_any_gpu_work():
    import argparse

    args = argparse.Namespace(model="llama-3.2-1b", positions=[100], steps=1, json=None, events=None,
                              tune="gemv_warps=3")
    with pytest.raises(FuselmError, match="--tune: tuning gemv_warps=3: warps per GEMV block must be a power of 2"):
        trace.main(args)


def test_a_slot_with_two_kernels_counts_once_in_the_layer_time():
    """Layers whose kernels differ in one slot (Gemma-2's alternating windows) average there."""
    pattern = [{"slot": 0, "last_end": 3.0, "launches": 2}, {"slot": 0, "last_end": 6.0, "launches": 1},
               {"slot": 1, "last_end": 1.5, "launches": 3}]
    assert trace.layer_us(pattern) == pytest.approx(4.0 + 1.5)

"""Built programs kept on disk (codegen/program_cache.py): a second load takes the first one's
program, a source change or other arguments build anew, and a damaged file is rebuilt."""
from __future__ import annotations

import pytest

from fuselm.codegen import program_cache
from fuselm.codegen.build import build_batch, build_program
from fuselm.codegen.tuning import Target, Tuning
from fuselm.models import build_graph
from fuselm.models.presets import preset


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSELM_CACHE", str(tmp_path))
    return tmp_path / "programs"


def sources(program) -> list[str]:
    return [s.source for s in program.steps()]


def test_a_cached_program_is_the_program_built_without_the_cache(cache, monkeypatch):
    graph = build_graph(preset("smollm2-135m"), 256)
    built = build_program(graph, 256, Target(), Tuning(), compile=False)
    first = build_program(graph, 256, Target(), Tuning(), compile=False, cache=True)
    assert len(list(cache.glob("program-*.pickle"))) == 1
    calls = []
    monkeypatch.setattr("fuselm.codegen.build._build_program", lambda *a: calls.append(a))
    again = build_program(graph, 256, Target(), Tuning(), compile=False, cache=True)
    assert not calls, "the second build ran the compiler instead of reading the cache"
    assert sources(again) == sources(first) == sources(built)
    assert [s.tokens for s in again.prefill] == [s.tokens for s in built.prefill]


def test_other_arguments_or_other_source_build_anew(cache, monkeypatch):
    graph = build_graph(preset("smollm2-135m"), 256)
    build_program(graph, 256, Target(), Tuning(), compile=False, cache=True)
    build_program(graph, 256, Target(sms=66), Tuning(), compile=False, cache=True)
    build_program(graph, 128, Target(), Tuning(), compile=False, cache=True)
    assert len(list(cache.glob("program-*.pickle"))) == 3
    monkeypatch.setattr(program_cache, "source_digest", lambda: "an edited checkout")
    build_program(graph, 256, Target(), Tuning(), compile=False, cache=True)
    assert len(list(cache.glob("program-*.pickle"))) == 4


def test_a_damaged_cache_file_is_built_again(cache):
    graph = build_graph(preset("smollm2-135m"), 256)
    first = build_batch(graph, 256, Target(), Tuning(), compile=False, cache=True)
    (path,) = cache.glob("batch-*.pickle")
    path.write_bytes(path.read_bytes()[:100])     # a process that died mid-write would leave less
    again = build_batch(graph, 256, Target(), Tuning(), compile=False, cache=True)
    assert [s.source for s in again] == [s.source for s in first]
    assert path.stat().st_size > 100

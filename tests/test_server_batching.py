"""Continuous batching in `fuselm serve` on the CPU (server/batcher.py): concurrent requests give
each the answer it gets alone, prompts share KV pages, a full pool preempts and recovers, and
every page returns once the clients are gone, disconnects included."""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fuselm.loading.default_model import find_default
from fuselm.server import create_app

from http_server import serving
from test_server import NAME, NO_MODEL, metric

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived", "2 + 2 =", "Water boils at"]


@pytest.fixture(scope="module")
def small_model():
    """SmolLM2 with a context of 96 tokens: a pool of 6 pages of 16 rows holds one sequence."""
    if find_default() is None:
        pytest.skip(NO_MODEL)
    import fuselm
    return fuselm.load(device="cpu", ctx=96, progress=False)


def complete(url: str, prompt: str, tokens: int, **fields) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": tokens, **fields}
    reply = httpx.post(url + "/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def answers_alone_then_together(url: str, requests: list[tuple[str, int, dict]]) -> tuple[list, list]:
    """Each request's text and usage sent alone, one after another; then all at once."""
    def one(r):
        reply = complete(url, r[0], r[1], **r[2])
        return reply["choices"][0]["text"], reply["usage"]["completion_tokens"]
    alone = [one(r) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(one, requests))
    return alone, together


def test_concurrent_requests_each_get_their_own_answer(small_model):
    requests = [(p, 12 + 3 * i, {"temperature": 0.8, "seed": i} if i % 2 else {}) for i, p in enumerate(PROMPTS)]
    with serving(create_app(small_model, max_seqs=4)) as url:
        alone, together = answers_alone_then_together(url, requests)
        assert together == alone
        assert metric(url, "fuselm_kv_pages_used") == 0 and metric(url, "fuselm_requests_running") == 0


def test_steps_are_queued_ahead_on_the_engines_own_picks(small_model):
    """Greedy and seeded sampled requests: steps are planned before the running step's picks are
    back (their tokens fed from its picks on the engine, the draws made where the logits are)
    and every answer is still the alone one; logprobs' and penalized ones too (the penalties
    count the pick still on the engine); a request under a grammar never is."""
    requests = [(p, 10, {"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {}) for i, p in enumerate(PROMPTS[:4])]
    app = create_app(small_model, max_seqs=4)
    engine = app.state.scheduler.engine
    launches, real = [], engine.launch

    def launch(chunks, picks=None, draws=None):
        launches.append(len(picks[1]) if picks else 0)
        return real(chunks, picks, draws)
    engine.launch = launch
    with serving(app) as url:
        alone, together = answers_alone_then_together(url, requests)
        assert together == alone
        assert sum(launches) >= 4 * 5, launches          # most decode tokens of the concurrent answers
        for fields, ahead in (({"temperature": 0.8, "seed": 1, "frequency_penalty": 0.5, "presence_penalty": 0.3}, True),
                              ({"repetition_penalty": 1.3}, True),
                              ({"response_format": {"type": "json_object"}}, False), ({"logprobs": 2}, True)):
            launches.clear()
            once = complete(url, PROMPTS[0], 8, **fields)["choices"][0]
            assert (sum(launches) > 0) == ahead, fields
            assert once == complete(url, PROMPTS[0], 8, **fields)["choices"][0]


def test_a_full_pool_preempts_and_every_answer_is_still_its_own(small_model):
    """6 pages of 16 rows: three sequences of up to 46 tokens cannot all stay in the pool."""
    requests = [(p, 40, {}) for p in PROMPTS[:3]]
    with serving(create_app(small_model, max_seqs=3, kv_pages=6)) as url:
        alone, together = answers_alone_then_together(url, requests)
        assert together == alone
        assert metric(url, "fuselm_preemptions_total") >= 1 and metric(url, "fuselm_kv_pages_used") == 0


def test_a_shared_prompt_prefix_is_prefilled_once(small_model):
    system = "You are a helpful assistant who answers briefly and politely. " * 4
    with serving(create_app(small_model, max_seqs=2)) as url:
        first = complete(url, system + "Name a fruit.", 4)
        fed = metric(url, "fuselm_prompt_tokens_total")
        second = complete(url, system + "Name a tree.", 4)
        again = metric(url, "fuselm_prompt_tokens_total") - fed
        prompt = second["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens"] == fed >= 32
        assert again <= prompt - 16          # at least a page of the prefix came from the pool
        assert metric(url, "fuselm_kv_pages_used") == 0


def test_a_model_without_batch_kernels_is_served_one_at_a_time(small_model, monkeypatch):
    """Where the compiler makes no batch steps (codegen/build.py: NoBatchSteps), the server falls
    back to the one-at-a-time scheduler and refuses what only batching serves, by name."""
    from fuselm.codegen.build import NoBatchSteps
    from fuselm.server import app as app_module
    from fuselm.server.scheduler import Scheduler

    def no_steps(*args, **kwargs):
        raise NoBatchSteps("graph 'x' has no batch steps: a test")
    monkeypatch.setattr(app_module, "BatchScheduler", no_steps)
    app = create_app(small_model)
    assert type(app.state.scheduler) is Scheduler
    with serving(app) as url:
        assert complete(url, PROMPTS[0], 3)["usage"]["completion_tokens"] == 3
        reply = httpx.post(url + "/completions", timeout=60, json={"model": NAME, "prompt": "x", "n": 2})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"


def test_n_choices_prefill_their_prompt_once(small_model):
    """Choices after the first wait for its prompt, then take its full pages from the pool."""
    prompt = "You are a helpful assistant who answers briefly and politely. " * 4 + "Name a fruit."
    with serving(create_app(small_model, max_seqs=4)) as url:
        reply = complete(url, prompt, 4, n=3, temperature=1.0, seed=3)
        fed, tokens = metric(url, "fuselm_prompt_tokens_total"), reply["usage"]["prompt_tokens"]
        assert sorted(c["index"] for c in reply["choices"]) == [0, 1, 2] and tokens >= 48
        assert fed <= tokens + 2 * 16            # the others fed at most a page and the last token each
        assert metric(url, "fuselm_kv_pages_used") == 0


def test_random_load_with_disconnects_keeps_the_server_whole(small_model):
    """64 clients with random prompts, lengths and sampling (greedy, seeded draws, a penalty),
    some leaving early: the rest get their alone answers, the server stays up, and every page
    and slot is free at the end."""
    rng = random.Random(0)
    kinds = [{}, {"temperature": 0.9, "top_p": 0.9, "seed": 4}, {"temperature": 0.7, "presence_penalty": 0.5, "seed": 2}]
    requests = [(" ".join(rng.sample(PROMPTS, rng.randint(1, 2))), rng.randint(2, 12), rng.random() < 0.3,
                 rng.choice(kinds)) for _ in range(64)]
    with serving(create_app(small_model, max_seqs=8, kv_pages=18, max_waiting=64)) as url:
        alone = {i: complete(url, p, n, **f)["choices"][0]["text"] for i, (p, n, leaves, f) in enumerate(requests)
                 if not leaves}

        def one(i):
            prompt, n, leaves, fields = requests[i]
            body = {"model": NAME, "prompt": prompt, "max_tokens": n, **fields}
            if leaves:
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(url + "/completions", json=body, timeout=httpx.Timeout(300, read=0.05))
                return None
            return httpx.post(url + "/completions", json=body, timeout=300).json()["choices"][0]["text"]
        with ThreadPoolExecutor(64) as pool:
            got = list(pool.map(one, range(len(requests))))
        assert {i: t for i, t in enumerate(got) if t is not None} == alone
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
        deadline = time.monotonic() + 30
        while metric(url, "fuselm_requests_running") or metric(url, "fuselm_kv_pages_used"):
            assert time.monotonic() < deadline, "pages or slots were not returned"
            time.sleep(0.05)
        assert metric(url, "fuselm_requests_finished_total", {"finish_reason": "cancelled"}) >= 1


@pytest.mark.parametrize("argv, message", [
    (["--max-seqs", "0"], "--max-seqs must be at least 1, got 0"),
    (["--kv-memory", "-1"], "--kv-memory must be a positive number of GiB, got -1.0"),
    (["--kv-memory", "nan"], "--kv-memory must be a positive number of GiB, got nan"),
])
def test_serve_refuses_bad_batch_options_in_one_line(capsys, argv, message):
    from test_hostile_cli import one_error
    assert one_error(capsys, "serve", *argv) == f"error: {message}"


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "--temperature must be at least 0, got -1.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
])
def test_bench_serve_refuses_bad_sampling_in_one_line(capsys, argv, message):
    from test_hostile_cli import one_error
    assert one_error(capsys, "bench-serve", "http://127.0.0.1:9/v1", "--model", "m", *argv) == f"error: {message}"


def test_a_kv_memory_below_one_context_is_refused(small_model):
    from fuselm.errors import FuselmError
    from fuselm.server.batcher import pages_in
    assert pages_in(small_model, 1.0) >= 6
    with pytest.raises(FuselmError, match=r"^--kv-memory 0.001 GiB holds \d+ KV pages of 16 rows; one sequence of "
                                          r"the context \(96 tokens\) needs 6: raise it or lower --ctx$"):
        pages_in(small_model, 0.001)


def test_bench_serve_loads_the_server_and_records_its_figures(small_model, tmp_path, capsys):
    """`fuselm bench-serve` against the CPU server: every answer runs to --output-tokens
    (ignore_eos), and the record holds the issue's fields with figures that add up."""
    from fuselm import cli
    out = tmp_path / "serve.json"
    with serving(create_app(small_model, max_seqs=4)) as url:
        assert cli.main(["bench-serve", url, "--clients", "1,3", "--requests", "3", "--prompt-words", "12",
                         "--output-tokens", "6", "--temperature", "0.8", "--top-p", "0.95", "--json", str(out)]) == 0
        assert metric(url, "fuselm_kv_pages_used") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "output tok/s" in lines[0]
    records = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in records] == [1, 3]
    for r in records:
        assert {"model", "dtype", "concurrency", "output_tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
                "tpot_p95_ms"} <= set(r)
        assert r["model"] == NAME and r["requests"] == 3 and r["output_tokens"] == 18
        assert (r["temperature"], r["top_p"]) == (0.8, 0.95)
        assert abs(r["output_tok_s"] - 18 / r["wall_s"]) < 0.2 and 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"]
        assert 0 < r["tpot_p50_ms"] <= r["tpot_p95_ms"] and r["prompt_tokens_mean"] > 12


def test_ignore_eos_runs_to_max_tokens(small_model):
    """Greedy: the answer that stops at the stop token goes on past it with ignore_eos."""
    with serving(create_app(small_model, max_seqs=2)) as url:
        normal, forced = complete(url, "Say hi.", 40), complete(url, "Say hi.", 40, ignore_eos=True)
    assert normal["choices"][0]["finish_reason"] == "stop" and normal["usage"]["completion_tokens"] < 40
    assert forced["usage"]["completion_tokens"] == 40 and forced["choices"][0]["finish_reason"] == "length"
    assert forced["choices"][0]["text"].startswith(normal["choices"][0]["text"])


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_parses_and_follows_the_schema(small_model, stream):
    """The answer, sampled with a temperature, is JSON of the schema's shape (llguidance's mask)."""
    openai = pytest.importorskip("openai")
    with serving(create_app(small_model, max_seqs=2)) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        request = dict(model=NAME, max_tokens=60, temperature=0.9, seed=5,
                       messages=[{"role": "user", "content": "Describe a person as JSON."}],
                       response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        if stream:
            chunks = list(client.chat.completions.create(**request, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            reply = client.chat.completions.create(**request)
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop", text
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150


def test_json_object_output_is_an_object_and_penalties_are_taken(small_model):
    with serving(create_app(small_model, max_seqs=2)) as url:
        reply = httpx.post(url + "/chat/completions", timeout=300, json={
            "model": NAME, "max_tokens": 50, "messages": [{"role": "user", "content": "Give me a JSON object."}],
            "response_format": {"type": "json_object"}, "presence_penalty": 0.5, "frequency_penalty": 0.5}).json()
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:     # cut by max_tokens: still the start of an object
        assert choice["message"]["content"].lstrip().startswith("{")


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "the schema is not"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "cannot be combined"),
])
def test_a_bad_response_format_gets_a_400_naming_it(small_model, body, message):
    with serving(create_app(small_model, max_seqs=2)) as url:
        response = httpx.post(url + "/completions", timeout=60, json={"model": NAME, "prompt": "x", **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["param"].split(".")[0] in ("response_format", "ignore_eos")
        assert complete(url, "2 + 2 =", 2)["usage"]["completion_tokens"] == 2    # still serving

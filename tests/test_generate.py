"""The CPU engine on a tiny random Llama, and the generation loop (stops, limits, streaming, stats)."""
import codecs

import numpy as np
import pytest

from fuselm.errors import FuselmError
from fuselm.models import DecoderConfig, build_graph
from fuselm.runtime.cpu_engine import CpuEngine
from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.generate import GenerationStats, generate
from fuselm.runtime.reference import new_state, run_graph

VOCAB = 300      # byte tokens 0..255, then specials
STOP = 256


def tiny_llama(vocab=VOCAB, seed=0):
    """A 2-layer GQA Llama with random weights: (graph, weights)."""
    cfg = DecoderConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64})
    graph = build_graph(cfg)
    rng = np.random.default_rng(seed)
    weights = {}
    for node in graph.sources("weight"):
        if node.name.endswith("norm.weight"):
            weights[node.name] = (1 + 0.1 * rng.standard_normal(node.shape)).astype(np.float32)
        else:
            weights[node.name] = (0.3 * rng.standard_normal(node.shape)).astype(np.float32)
    return graph, weights


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes, so one character can span several tokens; id 256 stops."""
    stop_ids = frozenset({STOP})
    bos_id = None
    has_chat_template = True
    vocab_size = STOP + 1

    def encode(self, text, add_special_tokens=True, parse_special=True):
        return list(text.encode("utf-8"))

    def encode_chat(self, messages, add_generation_prompt=True):
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def stream(self):
        return ByteStream()

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>" * add_generation_prompt


class ByteStream:
    def __init__(self):
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        return self.utf8.decode(bytes([token_id])) if token_id < 256 else ""

    def flush(self):
        return self.utf8.decode(b"", final=True)


class ScriptedEngine:
    """An engine that answers with a fixed list of ids, recording what it was fed."""
    device = "cpu"

    def __init__(self, script, max_context=1000):
        self.script, self.max_context, self.position, self.fed = list(script), max_context, 0, []

    def reset(self):
        self.position, self.fed = 0, []

    def prefill(self, ids, sampling):
        self.fed += list(ids)
        self.position += len(ids)
        return self.script.pop(0)

    def decode(self, token, sampling):
        self.fed.append(token)
        self.position += 1
        return self.script.pop(0)


# ---- the CPU engine -------------------------------------------------------------------------------

def test_prefill_then_decode_matches_one_long_prefill(model):
    graph, weights = model
    ids = [5, 17, 200, 3, 99, 42, 7, 150]
    full = run_graph(graph, weights, {"ids": np.array(ids, np.int32),
                                      "pos": np.arange(len(ids), dtype=np.int32)}, new_state(graph, 16))["logits"]
    engine = CpuEngine(graph, weights, ctx=16)
    engine.prefill(ids[:3], SamplingParams())
    rows = [engine.last_logits]
    for t in ids[3:]:
        engine.decode(t, SamplingParams())
        rows.append(engine.last_logits)
    np.testing.assert_allclose(np.stack(rows), full[2:], rtol=1e-4, atol=1e-4)
    assert engine.position == len(ids) and engine.tokens == ids


def test_greedy_generation_equals_argmax_of_recomputed_logits(model):
    graph, weights = model
    prompt, n = [1, 2, 3, 4], 6
    expected = list(prompt)
    for _ in range(n):          # recompute from scratch every step: no cache involved
        feeds = {"ids": np.array(expected, np.int32), "pos": np.arange(len(expected), dtype=np.int32)}
        logits = run_graph(graph, weights, feeds, new_state(graph, 32))["logits"][-1]
        expected.append(int(np.argmax(logits)))
    engine = CpuEngine(graph, weights, ctx=32)
    got = [engine.prefill(prompt, SamplingParams())]
    for _ in range(n - 1):
        got.append(engine.decode(got[-1], SamplingParams()))
    assert got == expected[len(prompt):]


def test_reset_restarts_the_conversation(model):
    graph, weights = model
    engine = CpuEngine(graph, weights, ctx=16)
    first = engine.prefill([9, 8, 7], SamplingParams())
    logits = engine.last_logits.copy()
    engine.decode(first, SamplingParams())
    engine.reset()
    assert engine.position == 0 and engine.tokens == []
    assert engine.prefill([9, 8, 7], SamplingParams()) == first
    np.testing.assert_allclose(engine.last_logits, logits, rtol=1e-6)


def test_seeded_sampling_is_reproducible(model):
    graph, weights = model
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    runs = []
    for _ in range(2):
        engine = CpuEngine(graph, weights, ctx=16)
        ids = [engine.prefill([1, 2], params)]
        for _ in range(5):
            ids.append(engine.decode(ids[-1], params))
        runs.append(ids)
    assert runs[0] == runs[1]


def test_engine_rejects_what_does_not_fit_the_context(model):
    graph, weights = model
    engine = CpuEngine(graph, weights, ctx=4)
    with pytest.raises(FuselmError, match="^prompt of 5 tokens at position 0 does not fit the context of 4$"):
        engine.prefill([1, 2, 3, 4, 5], SamplingParams())
    assert engine.position == 0
    engine.prefill([1, 2], SamplingParams())
    with pytest.raises(FuselmError, match="^prompt of 3 tokens at position 2 does not fit the context of 4$"):
        engine.prefill([3, 4, 5], SamplingParams())
    assert engine.position == 2
    token = engine.prefill([3, 4], SamplingParams())
    with pytest.raises(FuselmError, match="^prompt of 1 token at position 4 does not fit the context of 4$"):
        engine.prefill([token], SamplingParams())
    with pytest.raises(FuselmError, match="^the conversation reached the context of 4 tokens$"):
        engine.decode(token, SamplingParams())


# ---- the generation loop --------------------------------------------------------------------------

def test_stop_id_ends_generation_and_is_not_printed():
    engine = ScriptedEngine([ord("h"), ord("i"), STOP, ord("x")])
    stats = GenerationStats()
    text = "".join(generate(engine, ByteTokenizer(), "prompt", 10, stats=stats))
    assert text == "hi"
    assert stats.generated_tokens == 2 and stats.decode_steps == 2 and stats.prompt_tokens == 6
    assert stats.stopped and stats.summary().startswith("answer: 2 tokens (stop token) | prefill: 6 tokens")
    assert engine.fed == list(b"prompt") + [ord("h"), ord("i")]   # the stop id is never fed


def test_a_prompt_of_token_ids_is_fed_as_it_is():
    engine = ScriptedEngine([ord("h"), STOP])
    assert "".join(generate(engine, ByteTokenizer(), [7, STOP, 9], 10)) == "h"   # ids, specials included
    assert engine.fed == [7, STOP, 9, ord("h")]   # then the answer; the stop id never


def test_ignore_eos_feeds_the_stop_id_and_runs_to_the_limit():
    engine = ScriptedEngine([ord("h"), STOP, ord("x")])
    stats = GenerationStats()
    assert "".join(generate(engine, ByteTokenizer(), "p", 3, stats=stats, ignore_eos=True)) == "hx"
    assert stats.generated_tokens == 3 and not stats.stopped and engine.fed[-2:] == [ord("h"), STOP]


def test_max_new_tokens_is_respected():
    engine = ScriptedEngine([ord(c) for c in "abcdefgh"])
    stats = GenerationStats()
    assert "".join(generate(engine, ByteTokenizer(), "p", 3, stats=stats)) == "abc"
    assert stats.generated_tokens == 3 and stats.decode_steps == 2


def test_streaming_never_splits_a_character():
    answer = "né 日本 🙂!"
    engine = ScriptedEngine(list(answer.encode("utf-8")) + [STOP])
    pieces = list(generate(engine, ByteTokenizer(), "p", 100))
    assert "".join(pieces) == answer
    assert len(pieces) == len(answer) and all("\ufffd" not in p for p in pieces)


def test_unfinished_character_at_the_limit_is_flushed():
    engine = ScriptedEngine(list("日".encode("utf-8")))
    assert "".join(generate(engine, ByteTokenizer(), "p", 2)) == "\ufffd"


def test_stats_are_recorded():
    engine = ScriptedEngine([ord("a")] * 5)
    stats = GenerationStats()
    list(generate(engine, ByteTokenizer(), "xyz", 5, stats=stats))
    assert stats.prompt_tokens == 3 and stats.generated_tokens == 5 and stats.decode_steps == 4
    assert stats.ttft_s >= stats.prefill_s > 0 and stats.decode_s > 0
    assert stats.decode_tok_s == pytest.approx(4 / stats.decode_s)
    assert stats.ms_per_token == pytest.approx(1000 / stats.decode_tok_s)
    assert "tok/s" in stats.summary() and "TTFT" in stats.summary()


def test_chat_messages_go_through_the_template_and_reuse_the_cache():
    tok, cache = ByteTokenizer(), []
    engine = ScriptedEngine([ord("o"), ord("k"), STOP, ord("!"), STOP])
    turn = [{"role": "user", "content": "hi"}]
    assert "".join(generate(engine, tok, turn, 10, cache_ids=cache)) == "ok"
    assert cache == list(b"<user>hi<assistant>ok") and engine.position == len(cache)
    turn2 = turn + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    stats = GenerationStats()
    assert "".join(generate(engine, tok, turn2, 10, stats=stats, cache_ids=cache)) == "!"
    assert stats.prompt_tokens == len(b"<assistant>ok<user>more<assistant>") - len(b"<assistant>ok")
    assert engine.fed == list(tok.encode(tok.apply_chat_template(turn2))) + [ord("!")]


def test_a_prompt_that_does_not_extend_the_cache_resets_the_engine():
    tok, cache = ByteTokenizer(), []
    engine = ScriptedEngine([ord("a"), STOP, ord("b"), STOP])
    list(generate(engine, tok, [{"role": "user", "content": "one"}], 5, cache_ids=cache))
    list(generate(engine, tok, [{"role": "user", "content": "two"}], 5, cache_ids=cache))
    assert engine.fed == list(b"<user>two<assistant>b") and cache == engine.fed


@pytest.mark.parametrize("prompt,n,sampling,message", [
    ("hello", 0, SamplingParams(), "max_new_tokens must be > 0"),
    ("hello", -3, SamplingParams(), "max_new_tokens must be > 0"),
    ("   ", 5, SamplingParams(), "prompt is empty"),
    ([], 5, SamplingParams(), "no messages"),
    ("x" * 20, 5, SamplingParams(), "prompt of 20 tokens does not fit the context of 16"),
    ("x" * 12, 5, SamplingParams(), "plus 5 new tokens does not fit the context of 16"),
    ("hello", 5, SamplingParams(top_p=1.5), "top_p"),
    ("hello", 5, SamplingParams(temperature=-0.1), "temperature"),
    ([104, 257], 5, SamplingParams(), "token id 257 is not in the vocabulary of 257 tokens"),
    ([104, -1], 5, SamplingParams(), "token id -1 is not in the vocabulary"),
])
def test_bad_input_is_a_one_line_error_before_any_work(prompt, n, sampling, message):
    engine = ScriptedEngine([1, 2, 3], max_context=16)
    with pytest.raises(FuselmError, match=message) as err:
        generate(engine, ByteTokenizer(), prompt, n, sampling)   # raises on the call, not on iteration
    assert "\n" not in str(err.value) and engine.fed == []


def test_cpu_engine_with_the_generation_loop(model):
    graph, weights = model
    engine = CpuEngine(graph, weights, ctx=32)
    stats = GenerationStats()
    pieces = list(generate(engine, ByteTokenizer(), "ab", 8, SamplingParams(), stats))
    assert stats.generated_tokens <= 8 and engine.position == 2 + stats.decode_steps
    assert engine.tokens[:2] == [ord("a"), ord("b")]
    assert all(isinstance(p, str) for p in pieces)


def test_summary_counts_the_answer_apart_from_the_decode_steps():
    """One token from the prefill and a stop: "answer: 1 token", and no decode rate over no steps
    (it used to say "decode: 2 tokens ... 0.0 tok/s" here, counting the first and the stop token)."""
    stats = GenerationStats()
    assert "".join(generate(ScriptedEngine([ord("a"), STOP]), ByteTokenizer(), "xy", 10, stats=stats)) == "a"
    assert (stats.generated_tokens, stats.decode_steps, stats.stopped) == (1, 1, True)
    stats = GenerationStats()
    list(generate(ScriptedEngine([ord("a"), ord("b")]), ByteTokenizer(), "xy", 1, stats=stats))
    line = stats.summary()
    assert line.startswith("answer: 1 token (token limit) | prefill: 2 tokens, ") and "decode" not in line, line

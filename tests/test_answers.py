"""Answers split into reasoning, content and tool calls (loading/answers.py): gpt-oss's harmony
channels and <think> / <tool_call> tags, streamed in any pieces, nothing lost; found from the
vocabulary; served as reasoning_content and tool_calls; tools in requests."""
from __future__ import annotations

import json

from hypothesis import given, strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from fuselm.loading.answers import (CONTENT, REASONING, TOOL_CALL, HarmonySplitter, TagSplitter, split,
                                   splitter_for, whole)
from fuselm.loading.tokenizer import TextTokenizer
from fuselm.server.replies import Answer, ChatReply
from fuselm.server.scheduler import Finished

HARMONY = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
THINK = "<think>\nThe capital of France.\n</think>\n\nParis."


def streamed(make, text: str, cuts: list[int]) -> tuple[str, str]:
    """(reasoning, content) of `text` pushed in pieces cut at `cuts`."""
    s, parts, at = make(), [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        parts += s.push(text[at:c])
        at = c
    parts += s.flush()
    return "".join(t for k, t in parts if k == REASONING), "".join(t for k, t in parts if k == CONTENT)


def test_harmony_channels():
    assert split(HARMONY, HarmonySplitter) == ("The user greets; answer briefly.", "Hello! How can I help?")
    # commentary (a preamble) is content; an answer that never opens a message is content whole
    assert split("<|channel|>commentary<|message|>Checking.<|end|>", HarmonySplitter) == ("", "Checking.")
    assert split("no channels at all", HarmonySplitter) == ("", "no channels at all")


def test_think_tags():
    assert split(THINK, TagSplitter) == ("The capital of France.\n", "Paris.")
    assert split("Paris.", TagSplitter) == ("", "Paris.")
    # a template that opens <think> in the prompt: the answer starts in the reasoning
    assert split("Hmm.</think>Paris.", lambda: TagSplitter(thinking=True)) == ("Hmm.", "Paris.")


@given(st.lists(st.integers(0, len(HARMONY)), max_size=12), st.lists(st.integers(0, len(THINK)), max_size=8))
def test_any_pieces_give_the_whole_texts_split(harmony_cuts, think_cuts):
    """Markers split over pieces (as stop strings may hold text back) are held until whole."""
    assert streamed(HarmonySplitter, HARMONY, harmony_cuts) == split(HARMONY, HarmonySplitter)
    assert streamed(TagSplitter, THINK, think_cuts) == split(THINK, TagSplitter)


def _tokenizer(specials: list[str]) -> TextTokenizer:
    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world"] + specials)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return TextTokenizer(backend)


def test_the_format_comes_from_the_vocabulary():
    assert splitter_for(_tokenizer([])) is None
    assert isinstance(splitter_for(_tokenizer(["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]))(),
                      HarmonySplitter)
    think = _tokenizer(["<think>", "</think>"])
    assert split("<think>a</think>b", splitter_for(think)) == ("a", "b")
    assert split("a</think>b", splitter_for(think, "<|im_start|>assistant\n<think>\n")) == ("a", "b")


def _done(index=0):
    return Finished(index=index, finish_reason="stop", prompt_tokens=3, completion_tokens=9)


def test_chat_replies_carry_reasoning_content():
    reply = ChatReply("m", splitter=HarmonySplitter)
    whole = json.loads(reply.whole([Answer(HARMONY, _done())]).model_dump_json())
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello! How can I help?",
                                              "reasoning_content": "The user greets; answer briefly."}
    deltas = [json.loads(reply.chunk(p).model_dump_json())["choices"][0]["delta"]
              for p in ("<|channel|>", "analysis", "<|message|>", "Hmm", "<|end|><|start|>assistant",
                        "<|channel|>final<|message|>", "Hi")]
    deltas.append(json.loads(reply.closing(_done()).model_dump_json())["choices"][0]["delta"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm"
    assert "".join(d.get("content", "") for d in deltas) == "Hi"
    plain = ChatReply("m")            # a model without a format: the text as it is, no extra field
    message = json.loads(plain.whole([Answer(HARMONY, _done())]).model_dump_json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": HARMONY}


def test_the_cli_prints_the_answer_and_sends_the_reasoning_to_stderr(capsys):
    from fuselm.cli import _stream

    reply = _stream(iter(["<think>", "\nweigh it", "</think>", "\n\nParis", "."]), TagSplitter())
    out, err = capsys.readouterr()
    assert reply == "Paris." and out == "Paris.\n" and err == "weigh it"   # the answer is what history keeps
    assert _stream(iter(["<think>a", "</think>b"])) == "<think>a</think>b"    # no format: as it came


# ---- tool calls ----------------------------------------------------------------------------------

HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
TAGGED_CALLS = ('<think>\nweather twice\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def calls(parts) -> list[dict]:
    return [json.loads(t) for k, t in parts if k == TOOL_CALL]


def test_harmony_calls_are_messages_to_functions():
    parts = whole(HARMONY_CALL, lambda: HarmonySplitter(tools=True))
    assert calls(parts) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert [k for k, _ in parts] == [REASONING, TOOL_CALL]
    # generation stops on <|call|> (a stop token, not streamed): the call is complete at the end
    assert calls(whole(HARMONY_CALL.removesuffix("<|call|>"), lambda: HarmonySplitter(tools=True))) == calls(parts)
    # without tools in the request, the message is content
    assert split(HARMONY_CALL, HarmonySplitter) == ("Need the weather.", '{"city": "Paris"}')


def test_tagged_calls_and_what_is_not_a_call():
    make = lambda: TagSplitter(tools=True)   # noqa: E731
    parts = whole(TAGGED_CALLS, make)
    assert [k for k, _ in parts] == [REASONING, CONTENT, TOOL_CALL, TOOL_CALL]
    assert calls(parts) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                            {"name": "get_time", "arguments": "{}"}]
    assert whole("<tool_call>not json</tool_call>", make) == [(CONTENT, "<tool_call>not json</tool_call>")]
    assert whole('<tool_call>{"name": "f", "argu', make) == [(CONTENT, '<tool_call>{"name": "f", "argu')]  # cut off


@given(st.lists(st.integers(0, len(TAGGED_CALLS)), max_size=10), st.lists(st.integers(0, len(HARMONY_CALL)), max_size=10))
def test_calls_in_any_pieces(tag_cuts, harmony_cuts):
    for text, make, cuts in ((TAGGED_CALLS, lambda: TagSplitter(tools=True), tag_cuts),
                             (HARMONY_CALL, lambda: HarmonySplitter(tools=True), harmony_cuts)):
        s, parts, at = make(), [], 0
        for c in sorted(set(cuts)) + [len(text)]:
            parts += s.push(text[at:c])
            at = c
        parts += s.flush()
        assert calls(parts) == calls(whole(text, make))


def test_chat_replies_carry_tool_calls():
    make = lambda: TagSplitter(tools=True)   # noqa: E731
    body = json.loads(ChatReply("m", splitter=make).whole([Answer(TAGGED_CALLS, _done())]).model_dump_json())
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "weather twice\n" and choice["message"]["content"] == "Checking.\n"
    got = [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert got == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert all(c["id"].startswith("call_") for c in choice["message"]["tool_calls"])
    reply = ChatReply("m", splitter=make)
    deltas = [json.loads(reply.chunk(p).model_dump_json())["choices"][0]["delta"] for p in TAGGED_CALLS.split("\n")]
    closing = json.loads(reply.closing(_done()).model_dump_json())["choices"][0]
    streamed = [c for d in deltas + [closing["delta"]] for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in streamed] == [(0, "get_weather"), (1, "get_time")]
    assert closing["finish_reason"] == "tool_calls"


TOOLS_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}{% for m in messages %}"
                  "<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
                  "{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


class _Model:
    """What build_jobs reads of a model: tokenizer, context, sampling defaults."""
    def __init__(self, template):
        from fuselm.runtime.engine import SamplingParams
        specials = ["<tool_call>", "</tool_call>"]
        alphabet = pre_tokenizers.ByteLevel.alphabet()     # a byte a token: any text round-trips
        backend = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
        self.tokenizer = TextTokenizer(backend, template)
        self.engine = type("E", (), {"max_context": 4096})()
        self.defaults = SamplingParams()


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _request(**kw):
    from fuselm.server.schemas import ChatCompletionRequest
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_requests_with_tools_render_them_and_parse_the_calls():
    from fuselm.server.jobs import build_jobs
    model = _Model(TOOLS_TEMPLATE)
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    (job,) = build_jobs(model, _request(tools=[WEATHER], messages=history), batching=True)
    text = model.tokenizer.decode(list(job.prompt))   # the ids the engine is fed: tools rendered in
    assert '"get_weather"' in text and '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert isinstance(job.splitter(), TagSplitter) and job.splitter().markers == ("<tool_call>", "</tool_call>")
    assert build_jobs(model, _request(tools=[WEATHER], tool_choice="none"), batching=True)[0].splitter is None


def test_tool_requests_the_server_cannot_serve_name_their_field():
    import pytest
    from pydantic import ValidationError

    from fuselm.server.errors import APIError
    from fuselm.server.jobs import build_jobs
    model = _Model(TOOLS_TEMPLATE)
    cases = [(dict(tools=[WEATHER], tool_choice="required"), "tool_choice"),
             (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
             (dict(tool_choice="auto"), "tool_choice"),
             (dict(tools=[WEATHER], parallel_tool_calls=False), "parallel_tool_calls")]
    for kw, field in cases:
        with pytest.raises(APIError) as e:
            build_jobs(model, _request(**kw), batching=True)
        assert e.value.param == field, kw
    with pytest.raises(APIError, match="does not render tools") as e:
        build_jobs(_Model("{% for m in messages %}{{ m.content }}{% endfor %}"), _request(tools=[WEATHER]), batching=True)
    assert e.value.param == "tools"
    bad_history = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]
    for messages in (bad_history, [{"role": "tool", "content": "x"}], [{"role": "user", "tool_calls": bad_history[0]["tool_calls"]}]):
        with pytest.raises(ValidationError):
            _request(messages=messages)

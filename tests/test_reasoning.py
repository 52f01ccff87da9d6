"""Reasoning split from content (loading/reasoning.py): gpt-oss's harmony channels and think tags,
streamed in any pieces, nothing lost; found from the vocabulary; served as reasoning_content."""
from __future__ import annotations

import json

from hypothesis import given, strategies as st
from tokenizers import AddedToken, Tokenizer, models

from fuselm.loading.reasoning import CONTENT, REASONING, HarmonySplitter, ThinkSplitter, split, splitter_for
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
    assert split(THINK, ThinkSplitter) == ("The capital of France.\n", "Paris.")
    assert split("Paris.", ThinkSplitter) == ("", "Paris.")
    # a template that opens <think> in the prompt: the answer starts in the reasoning
    assert split("Hmm.</think>Paris.", lambda: ThinkSplitter(thinking=True)) == ("Hmm.", "Paris.")


@given(st.lists(st.integers(0, len(HARMONY)), max_size=12), st.lists(st.integers(0, len(THINK)), max_size=8))
def test_any_pieces_give_the_whole_texts_split(harmony_cuts, think_cuts):
    """Markers split over pieces (as stop strings may hold text back) are held until whole."""
    assert streamed(HarmonySplitter, HARMONY, harmony_cuts) == split(HARMONY, HarmonySplitter)
    assert streamed(ThinkSplitter, THINK, think_cuts) == split(THINK, ThinkSplitter)


def _tokenizer(specials: list[str]) -> TextTokenizer:
    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world"] + specials)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return TextTokenizer(backend)


def test_the_format_comes_from_the_vocabulary():
    assert splitter_for(_tokenizer([])) is None
    assert splitter_for(_tokenizer(["<|start|>", "<|channel|>", "<|message|>", "<|end|>"])) is HarmonySplitter
    think = _tokenizer(["<think>", "</think>"])
    assert split("<think>a</think>b", splitter_for(think)) == ("a", "b")
    assert split("a</think>b", splitter_for(think, "<|im_start|>assistant\n<think>\n")) == ("a", "b")


def _done(index=0):
    return Finished(index=index, finish_reason="stop", prompt_tokens=3, completion_tokens=9)


def test_chat_replies_carry_reasoning_content():
    reply = ChatReply("m", reasoning=HarmonySplitter)
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

    reply = _stream(iter(["<think>", "\nweigh it", "</think>", "\n\nParis", "."]), ThinkSplitter())
    out, err = capsys.readouterr()
    assert reply == "Paris." and out == "Paris.\n" and err == "weigh it"   # the answer is what history keeps
    assert _stream(iter(["<think>a", "</think>b"])) == "<think>a</think>b"    # no format: as it came

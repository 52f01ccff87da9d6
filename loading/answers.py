"""A chat answer split into its reasoning, its content and its tool calls, as the text streams.

Two families of formats, told apart by the vocabulary:
- harmony (gpt-oss): messages `<|channel|>NAME<|message|>TEXT<|end|>`, the next one opened by
  `<|start|>assistant`; the "analysis" channel is reasoning, a message addressed to a function
  (`to=functions.NAME` in its header) is a call of it with TEXT its JSON arguments, ended by
  `<|call|>`; the other channels are content; `<|return|>` ends the answer. The generation
  prompt already opened the first message (`<|start|>assistant`).
- tags: `<think>TEXT</think>` before the answer (Qwen3, SmolLM3, DeepSeek-R1 distills; when the
  prompt itself ends inside `<think>`, the answer starts there), and
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes).
Tool calls are parsed only when the request offered tools. The markers are special tokens, so
each arrives whole in one streamed piece; a piece may still end in the first characters of one
(stop strings hold text back and join pieces), which is held until the next piece decides it. A
call is handed on whole, once it ends. Nothing is dropped: text the format does not place
(a call that is not JSON, a header never closed) is content.
"""
from __future__ import annotations

import json
import re
from typing import Callable

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool_call"
Parts = list[tuple[str, str]]     # (kind, text) in order; a TOOL_CALL's text: {"name", "arguments"} as JSON


class _Splitter:
    """The state both formats share: the text held back and how pieces are cut."""
    markers: tuple[str, ...] = ()

    def __init__(self):
        self._held = ""

    def push(self, piece: str) -> Parts:
        """The parts of the answer that `piece` completes."""
        text = self._held + piece
        keep = max((n for m in self.markers for n in range(min(len(m) - 1, len(text)), 0, -1)
                    if text.endswith(m[:n])), default=0)
        self._held = text[len(text) - keep:]
        return _merged(self._cut(text[:len(text) - keep]))

    def flush(self) -> Parts:
        """What is held back, at the end of the answer."""
        text, self._held = self._held, ""
        return _merged(self._cut(text) + self._end())

    def _cut(self, text: str) -> Parts:
        raise NotImplementedError

    def _end(self) -> Parts:
        return []


def tool_call(name: str, arguments: str) -> tuple[str, str]:
    """A TOOL_CALL part: the function's name and its arguments as the JSON text the model wrote."""
    return TOOL_CALL, json.dumps({"name": name, "arguments": arguments})


class HarmonySplitter(_Splitter):
    """gpt-oss's messages: the analysis channel as reasoning, messages to functions as calls (with
    `tools`), the rest as content."""
    markers = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
    _token = re.compile("|".join(re.escape(m) for m in markers))

    def __init__(self, tools: bool = False):
        super().__init__()
        self.tools = tools
        self._in_header, self._header, self._kind = True, "", CONTENT
        self._function, self._arguments = None, ""     # the call whose arguments are being written

    def _cut(self, text: str) -> Parts:
        out, at = [], 0
        for m in self._token.finditer(text):
            out += self._text(text[at:m.start()])
            at = m.end()
            marker = m.group()
            if marker == "<|message|>" and self._in_header:
                self._open(self._header)
            elif marker in ("<|end|>", "<|return|>", "<|call|>"):
                out += self._close()
            elif self._in_header:
                self._header += marker
        return out + self._text(text[at:])

    def _open(self, header: str) -> None:
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        function = re.search(r"to=functions\.([\w.-]+)", header)
        self._kind = REASONING if channel and channel[1] == "analysis" else CONTENT
        self._function = function[1] if function and self.tools else None
        self._in_header, self._header = False, ""

    def _close(self) -> Parts:
        out = [tool_call(self._function, self._arguments.strip())] if self._function else []
        self._in_header, self._header, self._function, self._arguments = True, "", None, ""
        return out

    def _text(self, text: str) -> Parts:
        if not text:
            return []
        if self._in_header:
            self._header += text
            return []
        if self._function:
            self._arguments += text
            return []
        return [(self._kind, text)]

    def _end(self) -> Parts:
        """A call ended by its stop token (<|call|>, not streamed) is complete; a header never
        closed by <|message|> is not harmony after all: its text is content."""
        if self._function:
            return self._close()
        header = self._token.sub("", self._header).removeprefix("assistant")
        self._header = ""
        return [(CONTENT, header)] if header.strip() else []


class TagSplitter(_Splitter):
    """<think>reasoning</think> before the content (`think`); <tool_call>JSON</tool_call> calls
    (`tools`). `thinking`: the prompt opened <think> already."""

    def __init__(self, think: bool = True, tools: bool = False, thinking: bool = False):
        super().__init__()
        self.markers = (("<think>", "</think>") if think else ()) + (("<tool_call>", "</tool_call>") if tools else ())
        self._split = re.compile("(" + "|".join(re.escape(m) for m in self.markers) + ")") if self.markers else None
        self._kind = REASONING if thinking else CONTENT
        self._fresh = True          # at the start of a section: its leading newlines are layout
        self._call: str | None = None   # the text of an open <tool_call>

    def _cut(self, text: str) -> Parts:
        if self._split is None:
            return [(CONTENT, text)] if text else []
        out = []
        for part in self._split.split(text):
            if part in ("<think>", "</think>"):
                self._kind, self._fresh = (REASONING if part == "<think>" else CONTENT), True
            elif part == "<tool_call>":
                self._call = ""
            elif part == "</tool_call>":
                out.append(self._parsed(self._call or ""))
                self._call, self._fresh = None, True
            elif self._call is not None:
                self._call += part
            elif part:
                if self._fresh:
                    part = part.lstrip("\n")
                    self._fresh = not part
                if part:
                    out.append((self._kind, part))
        return out

    @staticmethod
    def _parsed(body: str) -> tuple[str, str]:
        """A call's JSON {"name", "arguments"} as a TOOL_CALL part; as content when it is not one."""
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, TypeError, KeyError, AttributeError):
            return CONTENT, f"<tool_call>{body}</tool_call>"
        return tool_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments))

    def _end(self) -> Parts:
        """A call cut off by the token limit is content, as written."""
        if self._call is None:
            return []
        body, self._call = self._call, None
        return [(CONTENT, f"<tool_call>{body}")]


def splitter_for(tokenizer, prompt: str = "", tools: bool = False) -> Callable[[], _Splitter] | None:
    """A factory of splitters for the answers of `tokenizer`'s model to the rendered chat
    `prompt` (`tools`: the request offered tools), or None where its vocabulary has no reasoning
    format and no tool call format the request needs."""
    has = lambda t: tokenizer.token_id(t) is not None   # noqa: E731
    if has("<|channel|>") and has("<|message|>"):
        return lambda: HarmonySplitter(tools=tools)
    think = has("<think>") and has("</think>")
    calls = tools and has("<tool_call>") and has("</tool_call>")
    if think or calls:
        opened = think and prompt.rstrip().endswith("<think>")
        return lambda: TagSplitter(think=think, tools=calls, thinking=opened)
    return None


def calls_format(tokenizer) -> str | None:
    """The tool call format the model's vocabulary has ("harmony" or "tags"), or None."""
    if tokenizer.token_id("<|channel|>") is not None and tokenizer.token_id("<|call|>") is not None:
        return "harmony"
    if tokenizer.token_id("<tool_call>") is not None and tokenizer.token_id("</tool_call>") is not None:
        return "tags"
    return None


def split(text: str, make: Callable[[], _Splitter]) -> tuple[str, str]:
    """A whole answer's (reasoning, content); its calls, if any: parts() of the same."""
    parts = whole(text, make)
    return "".join(t for k, t in parts if k == REASONING), "".join(t for k, t in parts if k == CONTENT)


def whole(text: str, make: Callable[[], _Splitter]) -> Parts:
    """The parts of a whole answer."""
    s = make()
    return _merged(s.push(text) + s.flush())


def _merged(parts: Parts) -> Parts:
    out: Parts = []
    for kind, text in parts:
        if out and out[-1][0] == kind and kind != TOOL_CALL:
            out[-1] = (kind, out[-1][1] + text)
        elif text:
            out.append((kind, text))
    return out

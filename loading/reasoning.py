"""A reasoning model's answer split into its reasoning and its content, as the text streams.

Two formats, told apart by the vocabulary:
- harmony (gpt-oss): messages `<|channel|>NAME<|message|>TEXT<|end|>`, the next one opened by
  `<|start|>assistant`; the "analysis" channel is reasoning, the others ("final", "commentary")
  are content; `<|return|>` / `<|call|>` end the answer. The generation prompt already opened
  the first message (`<|start|>assistant`).
- think tags (Qwen3, SmolLM3, DeepSeek-R1 distills): `<think>TEXT</think>` before the answer; when
  the prompt itself ends inside `<think>` (templates that open it), the answer starts there.
The markers are special tokens, so each arrives whole in one streamed piece; a piece may still
end in the first characters of one (stop strings hold text back and join pieces), which is held
until the next piece decides it. Nothing is dropped: text the format does not place is content.
"""
from __future__ import annotations

import re
from typing import Callable

REASONING, CONTENT = "reasoning", "content"
Parts = list[tuple[str, str]]     # (REASONING or CONTENT, text), in order


class _Splitter:
    """The state shared by both formats: the text held back and how pieces are cut."""
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


class HarmonySplitter(_Splitter):
    """gpt-oss's messages: the analysis channel as reasoning, the rest as content."""
    markers = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
    _token = re.compile("|".join(re.escape(m) for m in markers))

    def __init__(self):
        super().__init__()
        self._in_header, self._header, self._kind = True, "", CONTENT

    def _cut(self, text: str) -> Parts:
        out, at = [], 0
        for m in self._token.finditer(text):
            out += self._text(text[at:m.start()])
            at = m.end()
            marker = m.group()
            if marker == "<|message|>" and self._in_header:
                channel = re.search(r"<\|channel\|>\s*(\w+)", self._header)
                self._kind = REASONING if channel and channel[1] == "analysis" else CONTENT
                self._in_header, self._header = False, ""
            elif marker in ("<|end|>", "<|return|>", "<|call|>"):
                self._in_header, self._header = True, ""
            elif self._in_header:
                self._header += marker
        return out + self._text(text[at:])

    def _text(self, text: str) -> Parts:
        if not text:
            return []
        if self._in_header:
            self._header += text
            return []
        return [(self._kind, text)]

    def _end(self) -> Parts:
        """A header never closed by <|message|> is not harmony after all: its text is content."""
        header = self._token.sub("", self._header).removeprefix("assistant")
        self._header = ""
        return [(CONTENT, header)] if header.strip() else []


class ThinkSplitter(_Splitter):
    """<think>reasoning</think> before the answer's content."""
    markers = ("<think>", "</think>")

    def __init__(self, thinking: bool = False):
        super().__init__()
        self._kind = REASONING if thinking else CONTENT
        self._fresh = True          # at the start of a section: its leading newlines are layout

    def _cut(self, text: str) -> Parts:
        out = []
        for part in re.split(r"(<think>|</think>)", text):
            if part in ("<think>", "</think>"):
                self._kind, self._fresh = (REASONING if part == "<think>" else CONTENT), True
                continue
            if self._fresh:
                part = part.lstrip("\n")
                self._fresh = not part
            if part:
                out.append((self._kind, part))
        return out


def splitter_for(tokenizer, prompt: str = "") -> Callable[[], _Splitter] | None:
    """A factory of splitters for the answers of `tokenizer`'s model to the rendered chat
    `prompt`, or None where its vocabulary has no reasoning format."""
    has = lambda t: tokenizer.token_id(t) is not None   # noqa: E731
    if has("<|channel|>") and has("<|message|>"):
        return HarmonySplitter
    if has("<think>") and has("</think>"):
        opened = prompt.rstrip().endswith("<think>")
        return lambda: ThinkSplitter(thinking=opened)
    return None


def split(text: str, make: Callable[[], _Splitter]) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    s = make()
    parts = s.push(text) + s.flush()
    return "".join(t for k, t in parts if k == REASONING), "".join(t for k, t in parts if k == CONTENT)


def _merged(parts: Parts) -> Parts:
    out: Parts = []
    for kind, text in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        elif text:
            out.append((kind, text))
    return out

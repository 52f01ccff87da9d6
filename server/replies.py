"""OpenAI's response objects for one request: the whole answer, or the chunks of a stream.

`ChatReply` and `CompletionReply` share the request's id, creation time and model name; each
knows how its endpoint shapes text, logprobs, the finish reason and the usage.
"""
from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel

from ..loading.reasoning import CONTENT, REASONING, split
from .logprobs import TokenLogprob
from .scheduler import Finished
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                      ChatLogprobs, Completion, CompletionChoice, CompletionLogprobs, ContentLogprob, Delta,
                      TopLogprob, Usage)


@dataclass
class Answer:
    """One choice of a whole (non-streamed) response: its text, end and token logprobs."""
    text: str
    done: Finished
    logprobs: Sequence[TokenLogprob] = ()


def usage_of(dones: Sequence[Finished]) -> Usage:
    """The token counts of a finished request: its prompt once, every choice's answer."""
    prompt, completion = dones[0].prompt_tokens, sum(d.completion_tokens for d in dones)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class Reply(ABC):
    """What the replies of one request have in common."""
    id_prefix = ""

    def __init__(self, model_name: str, with_logprobs: bool = False):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.with_logprobs = model_name, with_logprobs

    def _head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def opening(self, index: int = 0) -> BaseModel | None:
        """The chunk that starts choice `index` of a stream, if the endpoint has one."""
        return None

    @abstractmethod
    def whole(self, answers: Sequence[Answer]) -> BaseModel:
        """The non-streamed response, a choice per answer (in index order)."""

    @abstractmethod
    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0) -> BaseModel:
        """A chunk adding `text` to choice `index` (and the logprobs of the tokens it completes)."""

    @abstractmethod
    def closing(self, done: Finished) -> BaseModel:
        """The chunk that gives a choice's finish reason."""

    @abstractmethod
    def usage_chunk(self, dones: Sequence[Finished]) -> BaseModel:
        """The last chunk with stream_options.include_usage: no choices, the usage."""


class ChatReply(Reply):
    """`chat.completion` and `chat.completion.chunk` objects. `reasoning`: a splitter factory
    (loading/reasoning.py) where the model reasons; its reasoning then goes to reasoning_content."""
    id_prefix = "chatcmpl"

    def __init__(self, model_name: str, with_logprobs: bool = False, reasoning=None):
        super().__init__(model_name, with_logprobs)
        self.reasoning, self._splitters = reasoning, {}

    def _delta(self, parts) -> Delta:
        reasoning, content = ("".join(t for k, t in parts if k == kind) for kind in (REASONING, CONTENT))
        return Delta(content=content or (None if reasoning else ""), reasoning_content=reasoning or None)

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if not self.with_logprobs:
            return None
        return ChatLogprobs(content=[
            ContentLogprob(token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
                           top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top])
            for e in logprobs])

    def whole(self, answers: Sequence[Answer]) -> ChatCompletion:
        choices = [ChatChoice(index=a.done.index, message=self._message(a.text),
                              finish_reason=a.done.finish_reason, logprobs=self._logprobs(a.logprobs)) for a in answers]
        return ChatCompletion(**self._head(), choices=choices, usage=usage_of([a.done for a in answers]))

    def _chunk(self, delta: Delta, index: int, finish_reason: str | None = None, logprobs=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(index=index, delta=delta,
                                                                            finish_reason=finish_reason,
                                                                            logprobs=logprobs)])

    def opening(self, index: int = 0) -> ChatCompletionChunk:
        return self._chunk(Delta(role="assistant", content=""), index)

    def _message(self, text: str) -> AssistantMessage:
        if self.reasoning is None:
            return AssistantMessage(content=text)
        reasoning, content = split(text, self.reasoning)
        return AssistantMessage(content=content, reasoning_content=reasoning or None)

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0) -> ChatCompletionChunk:
        if self.reasoning is None:
            return self._chunk(Delta(content=text), index, logprobs=self._logprobs(logprobs))
        splitter = self._splitters.setdefault(index, self.reasoning())
        return self._chunk(self._delta(splitter.push(text)), index, logprobs=self._logprobs(logprobs))

    def closing(self, done: Finished) -> ChatCompletionChunk:
        splitter = self._splitters.pop(done.index, None)
        held = splitter.flush() if splitter else []
        return self._chunk(self._delta(held) if held else Delta(), done.index, done.finish_reason)

    def usage_chunk(self, dones: Sequence[Finished]) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[], usage=usage_of(dones))


class CompletionReply(Reply):
    """`text_completion` objects, whole or as chunks."""
    id_prefix = "cmpl"

    def __init__(self, model_name: str, with_logprobs: bool = False, reasoning=None):
        super().__init__(model_name, with_logprobs)     # (a completion is text as it is: no reasoning split)
        self.offsets: dict[int, int] = {}   # choice -> characters of its answer so far (text_offset)

    def _logprobs(self, logprobs: Sequence[TokenLogprob], index: int) -> CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        offsets = []
        for e in logprobs:
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = offsets[-1] + len(e.token)
        return CompletionLogprobs(tokens=[e.token for e in logprobs], token_logprobs=[e.logprob for e in logprobs],
                                  top_logprobs=[dict(e.top) for e in logprobs], text_offset=offsets)

    def whole(self, answers: Sequence[Answer]) -> Completion:
        choices = [CompletionChoice(index=a.done.index, text=a.text, finish_reason=a.done.finish_reason,
                                    logprobs=self._logprobs(a.logprobs, a.done.index)) for a in answers]
        return Completion(**self._head(), choices=choices, usage=usage_of([a.done for a in answers]))

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0) -> Completion:
        return Completion(**self._head(), choices=[CompletionChoice(index=index, text=text,
                                                                    logprobs=self._logprobs(logprobs, index))])

    def closing(self, done: Finished) -> Completion:
        return Completion(**self._head(), choices=[CompletionChoice(index=done.index, text="",
                                                                    finish_reason=done.finish_reason)])

    def usage_chunk(self, dones: Sequence[Finished]) -> Completion:
        return Completion(**self._head(), choices=[], usage=usage_of(dones))

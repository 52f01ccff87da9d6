"""OpenAI's response objects for one request: the whole answer, or the chunks of a stream.

`ChatReply` and `CompletionReply` share the request's id, creation time and model name; each
knows how its endpoint shapes text, logprobs, the finish reason and the usage.
"""
from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel

from ..loading.answers import CONTENT, REASONING, TOOL_CALL, whole
from .logprobs import TokenLogprob
from .scheduler import Finished
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                      ChatLogprobs, Completion, CompletionChoice, CompletionLogprobs, ContentLogprob, Delta,
                      FunctionCall, ToolCall, ToolCallDelta, TopLogprob, Usage)


@dataclass
class Answer:
    """One choice of a whole (non-streamed) response: its text, end and token logprobs."""
    text: str
    done: Finished
    logprobs: Sequence[TokenLogprob] = ()


def usage_of(dones: Sequence[Finished], per_prompt: int = 1) -> Usage:
    """The token counts of a finished request: each prompt once (choices p * per_prompt ..
    (p + 1) * per_prompt - 1 answer prompt p), every choice's answer."""
    prompt = sum(d.prompt_tokens for d in dones if d.index % per_prompt == 0)
    completion = sum(d.completion_tokens for d in dones)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class Reply(ABC):
    """What the replies of one request have in common."""
    id_prefix = ""

    def __init__(self, model_name: str, with_logprobs: bool = False, per_prompt: int = 1):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.with_logprobs = model_name, with_logprobs
        self.per_prompt = per_prompt      # choices a prompt (usage counts each prompt once)

    def usage(self, dones: Sequence[Finished]) -> Usage:
        return usage_of(dones, self.per_prompt)

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
    """`chat.completion` and `chat.completion.chunk` objects. `splitter`: a splitter factory
    (loading/answers.py) where the model reasons or may call tools; its reasoning then goes to
    reasoning_content, its calls to tool_calls (finish reason "tool_calls")."""
    id_prefix = "chatcmpl"

    def __init__(self, model_name: str, with_logprobs: bool = False, splitter=None, per_prompt: int = 1):
        super().__init__(model_name, with_logprobs, per_prompt)
        self.splitter, self._splitters = splitter, {}
        self._calls: dict[int, int] = {}        # choice -> tool calls sent so far

    def _delta(self, parts, index: int) -> Delta:
        reasoning, content = ("".join(t for k, t in parts if k == kind) for kind in (REASONING, CONTENT))
        calls = [ToolCallDelta(index=self._calls.get(index, 0) + i, **_call(t).model_dump())
                 for i, t in enumerate(t for k, t in parts if k == TOOL_CALL)]
        if calls:
            self._calls[index] = self._calls.get(index, 0) + len(calls)
        return Delta(content=content or (None if reasoning or calls else ""), reasoning_content=reasoning or None,
                     tool_calls=calls or None)

    def _finish_reason(self, done: Finished, called: bool) -> str:
        """OpenAI's "tool_calls" where the answer ended (not cut by the limit) on its calls."""
        return "tool_calls" if called and done.finish_reason == "stop" else done.finish_reason

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if not self.with_logprobs:
            return None
        return ChatLogprobs(content=[
            ContentLogprob(token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
                           top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top])
            for e in logprobs])

    def whole(self, answers: Sequence[Answer]) -> ChatCompletion:
        choices = []
        for a in answers:
            message = self._message(a.text)
            choices.append(ChatChoice(index=a.done.index, message=message,
                                      finish_reason=self._finish_reason(a.done, bool(message.tool_calls)),
                                      logprobs=self._logprobs(a.logprobs)))
        return ChatCompletion(**self._head(), choices=choices, usage=self.usage([a.done for a in answers]))

    def _chunk(self, delta: Delta, index: int, finish_reason: str | None = None, logprobs=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(index=index, delta=delta,
                                                                            finish_reason=finish_reason,
                                                                            logprobs=logprobs)])

    def opening(self, index: int = 0) -> ChatCompletionChunk:
        return self._chunk(Delta(role="assistant", content=""), index)

    def _message(self, text: str) -> AssistantMessage:
        if self.splitter is None:
            return AssistantMessage(content=text)
        parts = whole(text, self.splitter)
        reasoning, content = ("".join(t for k, t in parts if k == kind) for kind in (REASONING, CONTENT))
        calls = [_call(t) for k, t in parts if k == TOOL_CALL]
        return AssistantMessage(content=content if content or not calls else None,
                                reasoning_content=reasoning or None, tool_calls=calls or None)

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0) -> ChatCompletionChunk:
        if self.splitter is None:
            return self._chunk(Delta(content=text), index, logprobs=self._logprobs(logprobs))
        splitter = self._splitters.setdefault(index, self.splitter())
        return self._chunk(self._delta(splitter.push(text), index), index, logprobs=self._logprobs(logprobs))

    def closing(self, done: Finished) -> ChatCompletionChunk:
        splitter = self._splitters.pop(done.index, None)
        held = splitter.flush() if splitter else []
        delta = self._delta(held, done.index) if held else Delta()
        return self._chunk(delta, done.index, self._finish_reason(done, self._calls.pop(done.index, 0) > 0))

    def usage_chunk(self, dones: Sequence[Finished]) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[], usage=self.usage(dones))


def _call(part: str) -> ToolCall:
    """A TOOL_CALL part (loading/answers.py) as OpenAI's tool call, with an id of its own."""
    call = json.loads(part)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=call["name"],
                                                                               arguments=call["arguments"]))


class CompletionReply(Reply):
    """`text_completion` objects, whole or as chunks."""
    id_prefix = "cmpl"

    def __init__(self, model_name: str, with_logprobs: bool = False, splitter=None, per_prompt: int = 1):
        super().__init__(model_name, with_logprobs, per_prompt)   # (a completion is text as it is: no splitting)
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
        return Completion(**self._head(), choices=choices, usage=self.usage([a.done for a in answers]))

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0) -> Completion:
        return Completion(**self._head(), choices=[CompletionChoice(index=index, text=text,
                                                                    logprobs=self._logprobs(logprobs, index))])

    def closing(self, done: Finished) -> Completion:
        return Completion(**self._head(), choices=[CompletionChoice(index=done.index, text="",
                                                                    finish_reason=done.finish_reason)])

    def usage_chunk(self, dones: Sequence[Finished]) -> Completion:
        return Completion(**self._head(), choices=[], usage=self.usage(dones))

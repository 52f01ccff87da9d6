"""OpenAI's response objects for one request: the whole answer, or the chunks of a stream.

`ChatReply` and `CompletionReply` share the request's id, creation time and model name; each
knows how its endpoint shapes text, the finish reason and the usage.
"""
from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod

from pydantic import BaseModel

from .scheduler import Finished
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                      Completion, CompletionChoice, Delta, Usage)


def usage_of(done: Finished) -> Usage:
    """The token counts of a finished request."""
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens)


class Reply(ABC):
    """What the replies of one request have in common."""
    id_prefix = ""

    def __init__(self, model_name: str):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name

    def _head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def opening(self) -> BaseModel | None:
        """The chunk that starts a stream, if the endpoint has one."""
        return None

    @abstractmethod
    def whole(self, text: str, done: Finished) -> BaseModel:
        """The non-streamed response."""

    @abstractmethod
    def chunk(self, text: str) -> BaseModel:
        """A chunk adding `text`."""

    @abstractmethod
    def closing(self, done: Finished) -> BaseModel:
        """The chunk that gives the finish reason."""

    @abstractmethod
    def usage_chunk(self, done: Finished) -> BaseModel:
        """The last chunk with stream_options.include_usage: no choices, the usage."""


class ChatReply(Reply):
    """`chat.completion` and `chat.completion.chunk` objects."""
    id_prefix = "chatcmpl"

    def whole(self, text: str, done: Finished) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=done.finish_reason)
        return ChatCompletion(**self._head(), choices=[choice], usage=usage_of(done))

    def _chunk(self, delta: Delta, finish_reason: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

    def opening(self) -> ChatCompletionChunk:
        return self._chunk(Delta(role="assistant", content=""))

    def chunk(self, text: str) -> ChatCompletionChunk:
        return self._chunk(Delta(content=text))

    def closing(self, done: Finished) -> ChatCompletionChunk:
        return self._chunk(Delta(), done.finish_reason)

    def usage_chunk(self, done: Finished) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[], usage=usage_of(done))


class CompletionReply(Reply):
    """`text_completion` objects, whole or as chunks."""
    id_prefix = "cmpl"

    def _completion(self, text: str, finish_reason: str | None = None, usage: Usage | None = None) -> Completion:
        return Completion(**self._head(), choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
                          usage=usage)

    def whole(self, text: str, done: Finished) -> Completion:
        return self._completion(text, done.finish_reason, usage_of(done))

    def chunk(self, text: str) -> Completion:
        return self._completion(text)

    def closing(self, done: Finished) -> Completion:
        return self._completion("", done.finish_reason)

    def usage_chunk(self, done: Finished) -> Completion:
        return Completion(**self._head(), choices=[], usage=usage_of(done))

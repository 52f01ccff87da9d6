"""OpenAI's response objects for one request: the whole answer, or the chunks of a stream.

`ChatReply` and `CompletionReply` share the request's id, creation time and model name; each
knows how its endpoint shapes text, logprobs, the finish reason and the usage.
"""
from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Sequence

from pydantic import BaseModel

from .logprobs import TokenLogprob
from .scheduler import Finished
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                      ChatLogprobs, Completion, CompletionChoice, CompletionLogprobs, ContentLogprob, Delta,
                      TopLogprob, Usage)


def usage_of(done: Finished) -> Usage:
    """The token counts of a finished request."""
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens)


class Reply(ABC):
    """What the replies of one request have in common."""
    id_prefix = ""

    def __init__(self, model_name: str, with_logprobs: bool = False):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.with_logprobs = model_name, with_logprobs

    def _head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model}

    def opening(self) -> BaseModel | None:
        """The chunk that starts a stream, if the endpoint has one."""
        return None

    @abstractmethod
    def whole(self, text: str, done: Finished, logprobs: Sequence[TokenLogprob] = ()) -> BaseModel:
        """The non-streamed response; `logprobs` those of every token, where asked for."""

    @abstractmethod
    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> BaseModel:
        """A chunk adding `text` (and the logprobs of the tokens it completes)."""

    @abstractmethod
    def closing(self, done: Finished) -> BaseModel:
        """The chunk that gives the finish reason."""

    @abstractmethod
    def usage_chunk(self, done: Finished) -> BaseModel:
        """The last chunk with stream_options.include_usage: no choices, the usage."""


class ChatReply(Reply):
    """`chat.completion` and `chat.completion.chunk` objects."""
    id_prefix = "chatcmpl"

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if not self.with_logprobs:
            return None
        return ChatLogprobs(content=[
            ContentLogprob(token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
                           top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top])
            for e in logprobs])

    def whole(self, text: str, done: Finished, logprobs: Sequence[TokenLogprob] = ()) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=done.finish_reason,
                            logprobs=self._logprobs(logprobs))
        return ChatCompletion(**self._head(), choices=[choice], usage=usage_of(done))

    def _chunk(self, delta: Delta, finish_reason: str | None = None, logprobs=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                                                            logprobs=logprobs)])

    def opening(self) -> ChatCompletionChunk:
        return self._chunk(Delta(role="assistant", content=""))

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> ChatCompletionChunk:
        return self._chunk(Delta(content=text), logprobs=self._logprobs(logprobs))

    def closing(self, done: Finished) -> ChatCompletionChunk:
        return self._chunk(Delta(), done.finish_reason)

    def usage_chunk(self, done: Finished) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self._head(), choices=[], usage=usage_of(done))


class CompletionReply(Reply):
    """`text_completion` objects, whole or as chunks."""
    id_prefix = "cmpl"

    offset = 0   # characters of the answer before the next token (text_offset), over a stream's chunks

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        offsets = []
        for e in logprobs:
            offsets.append(self.offset)
            self.offset += len(e.token)
        return CompletionLogprobs(tokens=[e.token for e in logprobs], token_logprobs=[e.logprob for e in logprobs],
                                  top_logprobs=[dict(e.top) for e in logprobs], text_offset=offsets)

    def _completion(self, text: str, finish_reason: str | None = None, usage: Usage | None = None,
                    logprobs=None) -> Completion:
        return Completion(**self._head(), choices=[CompletionChoice(text=text, finish_reason=finish_reason,
                                                                    logprobs=logprobs)], usage=usage)

    def whole(self, text: str, done: Finished, logprobs: Sequence[TokenLogprob] = ()) -> Completion:
        return self._completion(text, done.finish_reason, usage_of(done), self._logprobs(logprobs))

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> Completion:
        return self._completion(text, logprobs=self._logprobs(logprobs))

    def closing(self, done: Finished) -> Completion:
        return self._completion("", done.finish_reason)

    def usage_chunk(self, done: Finished) -> Completion:
        return Completion(**self._head(), choices=[], usage=usage_of(done))

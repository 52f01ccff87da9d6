"""Request and response bodies of the OpenAI API, as far as this server implements it.

Requests are strict (a string is never taken for a number) and refuse unknown fields, so nothing a
client asks for is silently ignored. Fields the one-at-a-time scheduler cannot serve (`n` > 1,
penalties, logprobs, response_format: continuous batching has them) are declared, so
`jobs.reject_unsupported` can name them.
"""
from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator

MAX_STOP_STRINGS = 4   # as OpenAI's API


def _stop_list(value):
    """`stop` as OpenAI allows it, a string or a list of strings, always as a list."""
    if isinstance(value, str):
        return [value]
    if value is not None and not isinstance(value, list):
        raise ValueError("must be a string or a list of strings")
    return value


def _text_parts(value):
    """A message's content as OpenAI allows it, a string or a list of text parts, always as parts."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of text parts")
    return value


def _one_prompt(value) -> bool:
    return isinstance(value, str) or isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompt(value):
    """A completion's prompt as OpenAI allows it: a string or a non-empty list of token ids, or a
    non-empty list of such prompts (a batch, each answered apart); always as a list of prompts."""
    if _one_prompt(value):
        return [value]
    if isinstance(value, list) and value and all(_one_prompt(p) for p in value):
        return value
    raise ValueError("must be a string, a non-empty list of token ids, or a non-empty list of those")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    """`stream_options`: whether the stream ends with a chunk holding the usage."""
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema the answer must follow, and its name."""
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    schema_: dict = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`response_format`: plain text, any JSON object, or JSON following a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(_Strict):
    """The fields both endpoints share: the model, the length, sampling, stops and streaming."""
    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: Annotated[list[Annotated[str, Field(min_length=1)]] | None,
                    BeforeValidator(_stop_list), Field(max_length=MAX_STOP_STRINGS)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None   # OpenAI's end-user id; accepted, used for nothing
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False  # not OpenAI's (vLLM's and llama-server's): run to max_tokens past stop tokens

    @property
    def length_field(self) -> str:
        """The field that set the answer's length, for messages about it."""
        return "max_tokens"

    @property
    def length(self) -> int | None:
        """Tokens to generate at most, as the request gave it (None: the endpoint's default)."""
        return self.max_tokens


class TextPart(_Strict):
    """One part of a message's content; only text is supported."""
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """A call's function: its name and its arguments as a JSON text."""
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(_Strict):
    """A function call an assistant message made (OpenAI's `tool_calls` items)."""
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One chat message. `developer` is OpenAI's newer name for `system`; an assistant message may
    hold the tool calls it made (its content then optional), a `tool` message the result of one."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[list[TextPart] | None, BeforeValidator(lambda v: v if v is None else _text_parts(v))] = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)
    tool_call_id: str | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        """The message as the chat template takes it: role and content as strings, a call's
        arguments as the object they encode (as Hugging Face templates expect them)."""
        role = "system" if self.role == "developer" else self.role
        out = {"role": role, "content": "".join(part.text for part in self.content or [])}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @model_validator(mode="after")
    def _consistent(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (only an assistant's tool calls may stand without it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages hold tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        for call in self.tool_calls or []:
            try:
                json.loads(call.function.arguments)
            except ValueError:
                raise ValueError(f"tool call {call.id}: arguments are not JSON") from None
        return self


class FunctionDefinition(_Strict):
    """A function the model may call: its name, what it does, its parameters' JSON schema."""
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One of `tools`: a function."""
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    """`tool_choice` naming the function to call."""
    type: Literal["function"]
    function: dict


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them, or None where the answer may call none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def length_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def length(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`: prompts continued, each a string or token ids (one, or a batch)."""
    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompt)]
    logprobs: int | None = None


class Usage(BaseModel):
    """Token counts of one request."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    """The reply of a chat completion; a reasoning model's reasoning apart (reasoning_content, as
    vLLM and llama-server name it) and the calls it made, each present only where there are some
    (content is null beside calls with no text)."""
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer
    def _given_fields(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ToolCallDelta(BaseModel):
    """A streamed tool call: sent whole, in one chunk, once the model finished writing it."""
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Delta(BaseModel):
    """What a chat chunk adds: the role (first chunk), then content (and reasoning_content, tool
    calls)."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer
    def _given_fields(self) -> dict:
        """Only the fields set, as OpenAI sends them (the closing chunk's delta is {})."""
        out = {k: v for k, v in (("role", self.role), ("content", self.content),
                                 ("reasoning_content", self.reasoning_content)) if v is not None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class TopLogprob(BaseModel):
    """A token's text, its log probability and its UTF-8 bytes (chat logprobs)."""
    token: str
    logprob: float
    bytes: list[int]


class ContentLogprob(TopLogprob):
    """A generated token of a chat answer, with the likeliest alternatives."""
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """`choices[].logprobs` of a chat completion or chunk."""
    content: list[ContentLogprob]


class CompletionLogprobs(BaseModel):
    """`choices[].logprobs` of a completion or chunk: per token its text, log probability, the
    likeliest alternatives (text -> log probability) and its offset in the answer's text."""
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class _Choice(BaseModel):
    """What every choice holds besides its content: its index; logprobs where asked for."""
    index: int = 0
    logprobs: ChatLogprobs | CompletionLogprobs | None = None


class ChatChoice(_Choice):
    """The choice of a whole chat completion."""
    message: AssistantMessage
    finish_reason: str


class ChatChunkChoice(_Choice):
    """The choice of a chat chunk; finish_reason is set on the last."""
    delta: Delta
    finish_reason: str | None = None


class CompletionChoice(_Choice):
    """The choice of a completion, or of one of its chunks."""
    text: str
    finish_reason: str | None = None


class _Answer(BaseModel):
    """What every response object and chunk holds: the request's id, creation time and model."""
    id: str
    created: int
    model: str


class ChatCompletion(_Answer):
    """A whole chat completion."""
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Answer):
    """One server-sent event of a streamed chat completion."""
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Completion(_Answer):
    """A whole completion, or one chunk of a streamed one (OpenAI uses the same object for both)."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`."""
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fuselm"


class ModelList(BaseModel):
    """`GET /v1/models`: the one model this server runs."""
    object: Literal["list"] = "list"
    data: list[ModelCard]

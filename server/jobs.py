"""A validated request checked against what this engine supports and turned into a generation Job.

Every refusal is an APIError naming the request field: unsupported options, sampling values out of
range (SamplingParams' own checks, which name the parameter), a prompt the tokenizer or chat
template refuses, and a prompt plus answer longer than the context.
"""
from __future__ import annotations

import dataclasses

from ..errors import FuselmError
from ..loading.answers import calls_format, splitter_for
from ..runtime.engine import SamplingError, SamplingParams
from ..runtime.generate import encode_prompt
from .batcher import batches
from .errors import APIError
from .logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETION
from .scheduler import Job
from .schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest

COMPLETION_DEFAULT_TOKENS = 16   # OpenAI's default max_tokens of /v1/completions
MAX_CHOICES = 128                # OpenAI's bound on n
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


def reject_unsupported(body: GenerationRequest, batching: bool) -> None:
    """APIError 400 for an option OpenAI has that this server does not implement, or a conflict;
    `batching`: whether the batch scheduler runs the request, which samples on the host and so
    has the penalties and structured output (the one-at-a-time GPU scheduler samples on the GPU)."""
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n must be from 1 to {MAX_CHOICES}, got {body.n}", "n")
    if (body.n or 1) > 1 and not batching:
        raise APIError(400, "n > 1 needs continuous batching, which this server runs without", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0) and not batching:
            raise APIError(400, f"{name} needs continuous batching, which this server runs without "
                                f"(use repetition_penalty)", name)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
    if logprobs_of(body) is not None and not batching:
        raise APIError(400, "logprobs need continuous batching, which this server runs without", "logprobs")
    if isinstance(body, CompletionRequest):
        return
    if body.tool_choice is not None and body.tool_choice not in ("auto", "none"):
        raise APIError(400, "tool_choice: only \"auto\" and \"none\" are supported (the model decides whether "
                            "to call)", "tool_choice")
    if body.tool_choice is not None and not body.tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if body.parallel_tool_calls is False:
        raise APIError(400, "parallel_tool_calls: false is not supported (a model may make several calls)",
                       "parallel_tool_calls")
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens differ; give one of them",
                       "max_completion_tokens")


def logprobs_of(body: GenerationRequest) -> int | None:
    """The alternatives per token a request's logprobs ask for (0: the chosen token's alone), or
    None where it asks for none; APIError 400 for values outside OpenAI's bounds."""
    if isinstance(body, CompletionRequest):   # an integer here: even 0 asks for the chosen token's
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_COMPLETION:
            raise APIError(400, f"logprobs must be from 0 to {MAX_TOP_COMPLETION}, got {body.logprobs}", "logprobs")
        return body.logprobs
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_CHAT:
        raise APIError(400, f"top_logprobs must be from 0 to {MAX_TOP_CHAT}, got {top}", "top_logprobs")
    if not body.logprobs:
        if top:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def sampling_of(body: GenerationRequest, defaults: SamplingParams) -> SamplingParams:
    """The model's default sampling with the fields the request gives replaced, range-checked."""
    given = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    try:
        return dataclasses.replace(defaults, **given).validate()
    except SamplingError as e:
        raise APIError(400, str(e), e.param) from None


def build_jobs(model, body: GenerationRequest, grammars=None, batching: bool | None = None) -> list[Job]:
    """The Jobs for `body` on `model` (a fuselm Model): one per prompt (a completion may give a
    batch of them; chat has one conversation); APIError when the request cannot run.
    `grammars` (structured.Grammars; None where the scheduler cannot constrain sampling)
    compiles response_format; `batching`: whether the batch scheduler runs it (default: whether
    the model's engine batches). Encodes the prompts (through the chat template for chat) and
    compiles any schema, so call it off the event loop."""
    reject_unsupported(body, batches(model) if batching is None else batching)
    grammar = None
    if body.response_format is not None and body.response_format.type != "text":
        if grammars is None:
            raise APIError(400, "response_format needs continuous batching, which this server runs without",
                           "response_format")
        if body.ignore_eos:
            raise APIError(400, "ignore_eos cannot be combined with a response_format", "ignore_eos")
        grammar = grammars.compile(body.response_format)
    sampling = sampling_of(body, model.defaults)
    if isinstance(body, ChatCompletionRequest):
        tools = body.template_tools()
        if tools and not model.tokenizer.takes_tools:
            raise APIError(400, "tools: this model's chat template does not render tools", "tools")
        if tools and calls_format(model.tokenizer) is None:
            raise APIError(400, "tools: this model's vocabulary has no tool call format fuselm reads "
                                "(harmony or <tool_call> tags)", "tools")
        ids = _encoded(model, [m.as_template_input() for m in body.messages], tools, "messages", "messages")
        splitter = splitter_for(model.tokenizer, model.tokenizer.decode(ids[-8:]), tools=bool(tools))
        return [_job(model, body, ids, "messages", sampling, grammar, splitter)]
    if len(body.prompt) * (body.n or 1) > MAX_CHOICES:
        raise APIError(400, f"{len(body.prompt)} prompts of {body.n or 1} choices each are more than "
                            f"{MAX_CHOICES} answers", "prompt")
    labels = ["prompt"] if len(body.prompt) == 1 else [f"prompt[{i}]" for i in range(len(body.prompt))]
    return [_job(model, body, _encoded(model, prompt, None, "prompt", label), label, sampling, grammar, None)
            for prompt, label in zip(body.prompt, labels)]


def _encoded(model, prompt, tools, field: str, label: str) -> list[int]:
    """`prompt` (text, token ids or chat messages) as token ids; APIError naming `field`."""
    try:
        return encode_prompt(model.tokenizer, prompt, tools)
    except FuselmError as e:
        raise APIError(400, f"{label}: {e}" if label != field else str(e), field) from None


def _job(model, body: GenerationRequest, ids: list[int], label: str, sampling, grammar, splitter) -> Job:
    """The Job of one encoded prompt (`label` names it in errors), its length checked against the
    context."""
    field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    prompt_tokens = len(ids)
    room = model.engine.max_context - prompt_tokens
    if room <= 0:
        raise APIError(400, f"{label}: the prompt of {prompt_tokens} tokens leaves no room for an answer "
                       f"in the context of {model.engine.max_context} tokens", field, "context_length_exceeded")
    max_tokens = body.length
    if max_tokens is None:
        max_tokens = min(room, COMPLETION_DEFAULT_TOKENS) if isinstance(body, CompletionRequest) else room
    elif max_tokens > room:
        raise APIError(400, f"{body.length_field}: the prompt of {prompt_tokens} tokens plus {max_tokens} new tokens "
                       f"does not fit the context of {model.engine.max_context} tokens (at most {room} here)"
                       + (f" ({label})" if label != "prompt" else ""),
                       body.length_field, "context_length_exceeded")
    return Job(tuple(ids), max_tokens, sampling, tuple(body.stop or ()), body.ignore_eos, grammar, logprobs_of(body),
               body.n or 1, splitter)

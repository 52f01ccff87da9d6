"""The generation loop: prompt in, text pieces out as the engine produces tokens.

Works with any `Engine` (CPU or CUDA) and any tokenizer with the `TextTokenizer` interface
(`encode`, `encode_chat`, `stream`, `stop_ids`). Pieces are whole UTF-8 characters: the
tokenizer's stream decoder holds back bytes until a character is complete. What a user wrote is
never parsed for special tokens: only a chat template's own markup becomes control tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..errors import FuselmError
from .engine import Engine, NonFiniteLogits, SamplingParams


@dataclass
class GenerationStats:
    """Counts and timings of one generation. Times cover engine calls only, not the consumer."""
    prompt_tokens: int = 0        # tokens fed by the prefill (a reused cache prefix is not counted)
    generated_tokens: int = 0     # tokens of the answer: sampled ids up to the stop id, which is not one
    prefill_s: float = 0.0
    decode_steps: int = 0         # engine.decode calls: each feeds one token and samples the next
    decode_s: float = 0.0
    ttft_s: float = 0.0           # from the call to the first sampled token (encoding included)
    stopped: bool = False         # whether a stop id ended the answer (else max_new_tokens did)

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else 0.0

    def summary(self) -> str:
        """One line for the terminal: the answer's length, then each phase's own count and rate
        (the first token comes from the prefill; the decode rate counts decode steps)."""
        ended = "stop token" if self.stopped else "token limit"
        line = (f"answer: {_count(self.generated_tokens)} ({ended}) | "
                f"prefill: {_count(self.prompt_tokens)}, {self.prompt_tok_s:.1f} tok/s")
        if self.decode_steps:
            line += (f" | decode: {_count(self.decode_steps, 'step')}, {self.decode_tok_s:.1f} tok/s, "
                     f"{self.ms_per_token:.1f} ms/token")
        return line + f" | TTFT {self.ttft_s * 1000:.0f} ms"


def _count(n: int, unit: str = "token") -> str:
    return f"{n} {unit}{'s' * (n != 1)}"


def check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode: a lone surrogate, which is how Python carries bytes
    that were not UTF-8 (command-line arguments, stdin). `what` names where the text came from."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        raw = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        raise FuselmError(f"{what} is not valid UTF-8 text ({raw} at character {e.start})") from None


def encode_prompt(tok, prompt: str | Sequence[dict] | Sequence[int], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a plain prompt, or of chat messages (and the `tools` they may call) rendered
    by the model's chat template, or token ids given as they are (each checked to be in the
    vocabulary). Neither the prompt nor the messages' contents can produce special tokens."""
    if is_token_ids(prompt):
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise FuselmError(f"the prompt's token id {bad} is not in the vocabulary of {tok.vocab_size} tokens")
        return ids
    if isinstance(prompt, str):
        if not prompt.strip():
            raise FuselmError("the prompt is empty")
        check_text(prompt, "the prompt")
        return list(tok.encode(prompt, add_special_tokens=True, parse_special=False))
    messages = list(prompt)
    if not all(isinstance(m, dict) for m in messages):
        raise FuselmError("each chat message must be a dict with 'role' and 'content'")
    if not messages or not any(str(m.get("content", "")).strip() or m.get("tool_calls") for m in messages):
        raise FuselmError("the chat has no messages with content")
    for i, m in enumerate(messages):
        for key, value in m.items():
            if isinstance(value, str):
                check_text(value, f"message {i} {key}")
    if not tok.has_chat_template:
        raise FuselmError("this model has no chat template; run without --chat")
    # The template writes its own special tokens (BOS included), so add none here, as HF does.
    return list(tok.encode_chat(messages, add_generation_prompt=True, **({"tools": tools} if tools else {})))


def is_token_ids(prompt) -> bool:
    """Whether `prompt` is a non-empty sequence of token ids (ints, not bools)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def generate(engine: Engine, tok, prompt: str | Sequence[dict] | Sequence[int], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), stats: GenerationStats | None = None,
             cache_ids: list[int] | None = None, ignore_eos: bool = False) -> Iterator[str]:
    """Validate now, then return an iterator of text pieces.

    Stops at any id in `tok.stop_ids` (not printed) or after `max_new_tokens` tokens. `stats`, if
    given, is filled in as generation goes. `cache_ids`, if given, mirrors the ids in the engine's
    KV cache: when the new prompt extends it (the next turn of a chat), only the new tokens are
    fed; otherwise the engine is reset. It is updated in place. `ignore_eos` runs on past stop
    ids to `max_new_tokens` (for benchmarks).
    """
    start = time.perf_counter()
    if max_new_tokens <= 0:
        raise FuselmError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    sampling.validate()
    ids = encode_prompt(tok, prompt)
    if not ids:
        raise FuselmError("the prompt encodes to no tokens")
    ctx = engine.max_context
    if len(ids) > ctx:
        raise FuselmError(f"prompt of {len(ids)} tokens does not fit the context of {ctx}")
    if len(ids) + max_new_tokens > ctx:
        raise FuselmError(f"prompt of {len(ids)} tokens plus {max_new_tokens} new tokens does not "
                          f"fit the context of {ctx}; lower the number of new tokens or raise the context")
    stop_ids = frozenset() if ignore_eos else tok.stop_ids
    return _run(engine, tok, ids, max_new_tokens, sampling, stats or GenerationStats(), cache_ids, start, stop_ids)


def _run(engine, tok, ids, max_new_tokens, sampling, stats, cache_ids, start, stop_ids) -> Iterator[str]:
    reuse = (cache_ids is not None and 0 < len(cache_ids) < len(ids)
             and ids[:len(cache_ids)] == cache_ids and engine.position == len(cache_ids))
    if not reuse:
        engine.reset()
        if cache_ids is not None:
            cache_ids.clear()
    fed = ids[len(cache_ids):] if reuse else ids
    decoder = tok.stream()

    try:
        t = time.perf_counter()
        token = engine.prefill(fed, sampling)
        now = time.perf_counter()
        if cache_ids is not None:
            cache_ids.extend(fed)
        stats.prompt_tokens, stats.prefill_s, stats.ttft_s = len(fed), now - t, now - start
        while token not in stop_ids:
            stats.generated_tokens += 1
            piece = decoder.push(token)
            if piece:
                yield piece
            if stats.generated_tokens >= max_new_tokens:
                break
            t = time.perf_counter()
            next_token = engine.decode(token, sampling)
            stats.decode_s += time.perf_counter() - t
            stats.decode_steps += 1
            if cache_ids is not None:
                cache_ids.append(token)
            token = next_token
        else:
            stats.stopped = True
    except NonFiniteLogits:
        # nothing sampled from garbage is shown; the cache holds the poisoned rows: forget it
        engine.reset()
        if cache_ids is not None:
            cache_ids.clear()
        raise
    tail = decoder.flush()
    if tail:
        yield tail

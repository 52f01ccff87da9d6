"""Text <-> token ids, streaming detokenization and chat templates, over a `tokenizers.Tokenizer`.

A TextTokenizer comes from a Hugging Face folder (tokenizer.json + tokenizer_config.json) through
`TextTokenizer.from_folder`, or from GGUF metadata through `gguf_tokenizer.tokenizer_from_gguf`.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers

from ..errors import FuselmError
from . import chat_template as templates
from . import special_text
from .json_file import read_object

# Tokens that end a turn or a document in common vocabularies; generation stops on any present.
STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class StreamDecoder:
    """Turns ids arriving one at a time into text, holding back bytes of an unfinished character.

    Decoding each id alone would break multi-byte characters split across tokens and drop the
    spaces that depend on the previous token, so each step decodes a short window that starts one
    emitted token back, and emits the part beyond what that token alone gave."""

    def __init__(self, tok: "TextTokenizer"):
        self._tok, self._ids = tok, []
        self._prefix = 0  # start of the window: the last token already emitted (context for spacing)
        self._read = 0    # ids before this index have been emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is still incomplete)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD), then reset."""
        text = self._emit(final=True)
        self._ids, self._prefix, self._read = [], 0, 0
        return text

    def _emit(self, final: bool) -> str:
        seen = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(self._ids) == self._read or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen):]


class TextTokenizer:
    """Encode, decode, stream and render chats; `stop_ids` are every id that ends generation.
    `template_origin` is the file the chat template came from, named by its syntax errors."""

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, eos_ids: Iterable[int] = (),
                 template_origin: str | Path | None = None, source: str | Path | None = None):
        self.backend = backend
        self.source = source or template_origin or "tokenizer"   # the file, for errors
        self.chat_template = chat_template
        # compiled once, here: a broken template fails while the checkpoint opens, before weights load
        self.template_origin = template_origin
        self._template = templates.compile_template(chat_template, template_origin) if chat_template else None
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.bos_id = self.token_id(self.special_tokens.get("bos_token"))
        stop = set(eos_ids) | {self.token_id(t) for t in (self.special_tokens.get("eos_token"), *STOP_TOKENS)}
        self.stop_ids = frozenset(i for i in stop if i is not None)

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (its text names them)."""
        return self.chat_template is not None and "tools" in self.chat_template

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        """The id of `token` in the vocabulary, or None."""
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds (BOS).
        Text rendered by a chat template usually holds its BOS already: encode it with False.
        parse_special=False keeps the text of special tokens as text ("<|im_start|>" typed by a
        user becomes the characters, never the control token): use it for anything a user wrote."""
        try:
            backend = self.backend if parse_special else self._plain_backend
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:   # tokenizers raises plain Exception (a broken vocabulary, no unk)
            raise FuselmError(f"{self.source}: the tokenizer cannot encode this text ({_one_line(e)})") from None

    @cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special tokens' text as ordinary text."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special (control) token, longest first."""
        texts = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        return tuple(sorted((t for t in texts if t), key=lambda t: (-len(t), t)))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` (and the `tools` they may call, OpenAI's function definitions)
        through the chat template, where only the template's own markup can become special
        tokens: special-token text inside the messages and tools stays text (no forged turns).
        Each such text is swapped for a placeholder before rendering, so the template sees and
        transforms the rest of the content as usual; the placeholders are encoded as text."""
        marked, sentinel = special_text.mark([{"messages": messages, "tools": tools}], self.special_texts,
                                             self.chat_template or "")
        rendered = self.apply_chat_template(marked[0]["messages"], add_generation_prompt=add_generation_prompt,
                                            **({"tools": marked[0]["tools"]} if tools else {}))
        ids: list[int] = []
        for text, typed in special_text.split(rendered, sentinel, self.special_texts):
            ids += self.encode(text, add_special_tokens=False, parse_special=not typed)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (special tokens kept unless skip_special_tokens)."""
        try:
            return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        except Exception as e:   # as in encode
            raise FuselmError(f"{self.source}: the tokenizer cannot decode ids ({_one_line(e)})") from None

    def stream(self) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of `messages` ([{"role": ..., "content": ...}]), as transformers renders it."""
        if self._template is None:
            raise FuselmError("this tokenizer has no chat template; pass the prompt as plain text")
        return templates.render(self._template, messages, add_generation_prompt, self.special_tokens,
                                origin=self.template_origin, **kwargs)

    @classmethod
    def from_folder(cls, folder: Path, config: dict | None = None, generation: dict | None = None) -> "TextTokenizer":
        """tokenizer.json, with chat template and special tokens from tokenizer_config.json
        (or chat_template.jinja / chat_template.json), and eos ids from the two configs.
        The chat template is compiled here: a syntax error names the file that holds it."""
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FuselmError(f"{folder}: no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type on bad JSON
            raise FuselmError(f"{path}: cannot read tokenizer ({' '.join(str(e).split())})") from None
        cfg_path = folder / "tokenizer_config.json"
        tok_cfg = read_object(cfg_path, missing={})
        special = {k: _token_text(tok_cfg.get(k), cfg_path, k) for k in SPECIAL_KEYS}
        eos = [i for name, d in (("config.json", config), ("generation_config.json", generation))
               for i in _token_ids((d or {}).get("eos_token_id"), folder / name)]
        template, origin = _find_chat_template(folder, tok_cfg)
        return cls(backend, template, special, eos, template_origin=origin, source=path)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _token_text(value, path: Path, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or a serialized AddedToken."""
    text = value.get("content") if isinstance(value, dict) else value
    if text is not None and not isinstance(text, str):
        raise FuselmError(f"{path}: {key} = {value!r} is not a token")
    return text


def _token_ids(value, path: Path) -> list[int]:
    """eos_token_id: an id or a list of ids (non-negative integers)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise FuselmError(f"{path}: eos_token_id = {value!r} is not a token id or a list of them")
    return ids


def _find_chat_template(folder: Path, tok_cfg: dict) -> tuple[str | None, Path]:
    """The template and the file it is in: transformers >= 4.43 may save it as chat_template.jinja
    or chat_template.json rather than in tokenizer_config.json."""
    origin = folder / "chat_template.jinja"
    if origin.exists():
        return origin.read_text(encoding="utf-8"), origin
    origin = folder / "chat_template.json"
    template = read_object(origin, missing={}).get("chat_template")
    if not template:
        origin, template = folder / "tokenizer_config.json", tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
            raise FuselmError(f"{origin}: chat_template is a list but not of {{name, template}} objects")
        named = {t["name"]: t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise FuselmError(f"{origin}: chat_template is not a string (a {type(template).__name__})")
    return template or None, origin

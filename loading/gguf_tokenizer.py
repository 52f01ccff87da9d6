"""A TextTokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

"gpt2" files hold a byte-level BPE (tokens already spelled in the byte alphabet, plus merges);
"llama" files hold a SentencePiece vocabulary with scores, which we rebuild as a byte-fallback BPE
whose merges are ranked by the score of the token they produce.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ..errors import FuselmError
from .gguf_store import metadata
from .tokenizer import TextTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (the regexes llama.cpp uses for each).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION +   # o200k (gpt-oss)
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION +
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "gpt-4o": _GPT4O}
WHOLE_WORDS = {_LLAMA3, _GPT4O}     # tiktoken vocabularies: a piece in the vocabulary is one token
DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
GPT2_SPLIT = {None, "gpt2", "default", "olmo", "gpt-2", "phi-2", "jais"}   # GPT-2's own regex


def tokenizer_from_gguf(reader: gguf.GGUFReader, path: Path) -> TextTokenizer:
    """The file's tokenizer, its control tokens as specials, BOS added when the file asks for it."""
    meta = lambda key, default=None: _typed_metadata(reader, path, key, default)  # noqa: E731
    tokens = meta("tokens")
    if not tokens:
        raise FuselmError(f"{path}: GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
    kind = meta("model")
    if kind not in ("gpt2", "llama"):
        raise FuselmError(f"{path}: GGUF tokenizer model '{kind}' is not supported (supported: gpt2, llama)")
    if kind == "gpt2" and (pre := meta("pre")) not in {*SPLITS, *DIGITS_FIRST, *GPT2_SPLIT}:
        warnings.warn(f"{path}: GGUF tokenizer.ggml.pre '{pre}' is not known here; text is split as GPT-2 "
                      f"splits it, which may tokenize some text differently from llama.cpp", stacklevel=2)
    add_bos_default = kind == "llama"  # llama.cpp adds BOS to SentencePiece vocabularies unless told not to
    ids = {k: _token_id(meta(f"{k}_token_id"), len(tokens)) for k in ("bos", "eos", "unknown", "padding")}
    special = {name: tokens[ids[k]] if ids[k] is not None else None
               for name, k in (("bos_token", "bos"), ("eos_token", "eos"),
                               ("unk_token", "unknown"), ("pad_token", "padding"))}
    add_bos, add_eos = meta("add_bos_token", add_bos_default), meta("add_eos_token", False)
    try:
        backend = _backend(meta, kind, tokens)
        single, specials = ["$A"], []   # what the post-processor puts around every encoded text
        if add_bos and ids["bos"] is not None:
            single.insert(0, special["bos_token"])
            specials.append((special["bos_token"], ids["bos"]))
        if add_eos and ids["eos"] is not None:
            single.append(special["eos_token"])
            specials.append((special["eos_token"], ids["eos"]))
        if specials:
            backend.post_processor = processors.TemplateProcessing(single=single,
                                                                   special_tokens=list(dict(specials).items()))
    except FuselmError:
        raise
    except Exception as e:  # tokenizers raises plain Exception on a vocabulary it cannot build
        raise FuselmError(f"{path}: the GGUF tokenizer cannot be built ({' '.join(str(e).split())})") from None
    eos = [ids["eos"]] if ids["eos"] is not None else []
    template = metadata(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise FuselmError(f"{path}: GGUF metadata tokenizer.chat_template is not a string")
    return TextTokenizer(backend, template, special, eos, template_origin=path, source=path)


def _backend(meta, kind: str, tokens: list[str]) -> Tokenizer:
    """The tokenizers backend: the vocabulary and merges, control tokens as specials."""
    if kind == "gpt2":
        backend = _byte_level(tokens, meta("merges") or [], meta("pre"))
    else:
        backend = _sentencepiece(tokens, meta("scores"), meta("merges"), meta("add_space_prefix", True))
    types = meta("token_type") or [1] * len(tokens)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return backend


# The type each tokenizer key must hold: a scalar type, or [element type] for an array.
KEY_TYPES = {"model": str, "pre": str, "add_bos_token": bool, "add_eos_token": bool, "add_space_prefix": bool,
             "tokens": [str], "merges": [str], "scores": [(int, float)], "token_type": [int]}
_NAMES = {str: "string", bool: "boolean", int: "integer", (int, float): "number"}


def _typed_metadata(reader: gguf.GGUFReader, path: Path, key: str, default=None):
    """`tokenizer.ggml.{key}`, or `default` where absent; a value of another type names the key."""
    value = metadata(reader, f"tokenizer.ggml.{key}")
    if value is None:
        return default
    want = KEY_TYPES.get(key)
    if isinstance(want, list):
        ok = isinstance(value, list) and all(isinstance(v, want[0]) for v in value)
    else:
        ok = want is None or isinstance(value, want)
    if not ok:
        what = f"a list of {_NAMES[want[0]]}s" if isinstance(want, list) else f"a {_NAMES[want]}"
        raise FuselmError(f"{path}: GGUF metadata tokenizer.ggml.{key} is not {what}")
    return value


def _token_id(value, n_tokens: int) -> int | None:
    """A special token id from the metadata, or None where absent or not an id of the vocabulary."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_tokens
    return value if ok else None


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=SPLITS.get(pre) in WHOLE_WORDS))
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in DIGITS_FIRST:  # GPT-2's split after cutting out every numeric character alone
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:  # "gpt2", "default" and unknown (tokenizer_from_gguf warns): GPT-2's own split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], scores, merges, add_space_prefix: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = merges_from_scores(tokens, scores or [0.0] * len(tokens))
    unk = "<unk>" if "<unk>" in vocab else None
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the prepended space is not part of the text
        parts.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(parts)
    return tok


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best first by the score of the token they make (ties: the left part's score, then its id)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            a, b = token[:cut], token[cut:]
            if a in vocab and b in vocab:
                found.append((-score, vocab[a], vocab[b], a, b))
    found.sort()
    return [(a, b) for *_, a, b in found]

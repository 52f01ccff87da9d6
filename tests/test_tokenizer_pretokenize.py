"""GGUF byte-level vocabularies split text as llama.cpp's `tokenizer.ggml.pre` says: gpt-oss's
"gpt-4o" (OpenAI's o200k split) against tiktoken itself, with o200k's own pattern taken from
tiktoken and a tiny vocabulary trained here; an unknown pre-tokenizer name warns."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from fuselm.loading.gguf_store import read_gguf
from fuselm.loading.gguf_tokenizer import tokenizer_from_gguf

tiktoken = pytest.importorskip("tiktoken")

CORPUS = ["HelloWorld, hello world! The world's THEY'RE don't 12345 678.9 tokens/s",
          "gpt-oss decodes ÉCOLE école naïve café 日本語 テキスト tokens", "line\nnext\r\n  spaced   out\t\tx"]
TEXTS = CORPUS + ["HTTPServer's camelCaseWords", "1234567 89", "a/b/c\n\n", "  lead", "trail  ", "Ünïcödé WORD's",
                  "x=1+2; y = [3, 4]", "don'T I'M WE'VE", ""]


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (pre_tokenizers.ByteLevel's alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _trained_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE trained on CORPUS (GPT-2 spelling): its tokens by id (the 256 bytes in
    byte order, then one token per merge, in merge order) and its merges."""
    spell = _byte_spelling()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=list(spell.values()),
                                                        show_progress=False))
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    tokens = [spell[b] for b in range(256)] + ["".join(m.split(" ")) for m in merges]
    return tokens, merges


def _gguf(path, tokens, merges, pre: str):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokenizer_from_gguf(read_gguf(path), path)


def _tiktoken_o200k(tokens: list[str], monkeypatch) -> "tiktoken.Encoding":
    """tiktoken's o200k_base encoding (its pattern, its BPE) over our tiny vocabulary's ranks."""
    import tiktoken_ext.openai_public as public

    raw = {c: b for b, c in _byte_spelling().items()}
    ranks = {bytes(raw[c] for c in t): i for i, t in enumerate(tokens)}
    monkeypatch.setattr(public, "load_tiktoken_bpe", lambda *a, **k: ranks)
    spec = public.o200k_base()
    return tiktoken.Encoding(name="o200k_tiny", pat_str=spec["pat_str"], mergeable_ranks=ranks, special_tokens={})


def test_gpt4o_split_is_tiktokens_o200k(tmp_path, monkeypatch):
    tokens, merges = _trained_vocab()
    assert len(merges) > 50                                  # the texts do merge
    ours = _gguf(tmp_path / "o200k.gguf", tokens, merges, "gpt-4o")
    ref = _tiktoken_o200k(tokens, monkeypatch)
    gpt2 = _gguf(tmp_path / "gpt2.gguf", tokens, merges, "gpt2")
    differs = 0
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode_ordinary(text), text
        assert ours.decode(ids) == text
        differs += ids != gpt2.encode(text, add_special_tokens=False)
    assert differs >= 3                                      # GPT-2's split would have been wrong


def test_unknown_pre_tokenizer_warns_naming_the_file(tmp_path):
    tokens, merges = _trained_vocab()
    with pytest.warns(UserWarning, match=r"odd\.gguf: GGUF tokenizer.ggml.pre 'no-such-split' is not known"):
        _gguf(tmp_path / "odd.gguf", tokens, merges, "no-such-split")

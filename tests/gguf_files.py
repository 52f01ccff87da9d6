"""Tiny GGUF files as llama.cpp's converter writes them, shared by the loading tests: a gpt2-style
byte vocabulary, the header (hyperparameters and tokenizer), llama's Q/K row order, the write-out."""
import gguf
import numpy as np


def _byte_tokens() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, then two merges and the specials <s>, </s>."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)] + ["\u0120t", "he", "\u0120the",
                                                                                  "<s>", "</s>"]


TOKENS = _byte_tokens()
MERGES = ["\u0120 t", "h e", "\u0120t he"]
V = len(TOKENS)            # 261
BOS, EOS = 259, 260


def llama_cpp_order(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes Q and K in for llama-arch files (RoPE pairs side by side)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_writer(path, arch: str, name: str | None = None, **hparams) -> gguf.GGUFWriter:
    """A writer for `arch` holding `hparams` (GGUFWriter.add_<key>(value) each) and the tiny
    vocabulary's gpt2 tokenizer; the caller adds tensors and calls finish()."""
    w = gguf.GGUFWriter(str(path), arch)
    if name:
        w.add_name(name)
    for key, value in hparams.items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (V - 2) + [3, 3])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    return w


def finish(w: gguf.GGUFWriter, path):
    """Write header, metadata and tensors; returns `path`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

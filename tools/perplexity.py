"""`fuselm perplexity MODEL TEXT_FILE`: perplexity the way llama.cpp's `llama-perplexity` measures it,
so that figures compare: the whole file tokenized (with BOS where the vocabulary adds one), cut
into chunks of --ctx tokens, each chunk's first token replaced by BOS (where it adds one), each
chunk run from an empty cache, and only the second half of each chunk scored. Prints
`PPL = x +/- y` (y: the standard error, propagated from the per-token losses)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from ..errors import FuselmError


def chunk_tokens(tokenizer, text: str, ctx: int) -> tuple[list[list[int]], bool]:
    """The chunks of `ctx` tokens the file is scored in, and whether BOS starts each."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_id
    adds_bos = bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
    n = len(ids) // ctx
    if n == 0:
        raise FuselmError(f"the text has {len(ids)} tokens, fewer than one chunk of --ctx {ctx}; lower --ctx")
    chunks = [ids[i * ctx:(i + 1) * ctx] for i in range(n)]
    if adds_bos:
        chunks = [[bos] + c[1:] for c in chunks]
    return chunks, adds_bos


def chunk_losses(logits: np.ndarray, chunk: list[int]) -> np.ndarray:
    """Negative log-likelihoods of the second half of a chunk: logits row j predicts token j + 1,
    for j from ctx/2 to ctx - 2 (llama.cpp's `first = n_ctx / 2`)."""
    ctx = len(chunk)
    rows = logits[ctx // 2: ctx - 1].astype(np.float64)
    targets = np.asarray(chunk[ctx // 2 + 1:])
    top = rows.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
    return log_z - rows[np.arange(len(targets)), targets]


def perplexity(engine, tokenizer, text: str, ctx: int, progress=None) -> tuple[float, float, int]:
    """(perplexity, its standard error, tokens scored) of `text` on `engine` (see the module docstring)."""
    if ctx < 4:
        raise FuselmError(f"--ctx must be at least 4 tokens, got {ctx}")
    if ctx > engine.max_context:
        raise FuselmError(f"--ctx {ctx} is beyond the engine's context of {engine.max_context}")
    chunks, _ = chunk_tokens(tokenizer, text, ctx)
    losses = []
    for i, chunk in enumerate(chunks):
        engine.reset()
        logits = engine.logits_of(chunk)
        if not np.isfinite(logits).all():
            raise FuselmError(f"chunk {i}: the model's logits are not finite")
        losses.append(chunk_losses(logits, chunk))
        if progress:
            nll = np.concatenate(losses)
            progress(f"[{i + 1}/{len(chunks)}] PPL so far {math.exp(nll.mean()):.4f}")
    nll = np.concatenate(losses)
    ppl = math.exp(nll.mean())
    err = ppl * math.sqrt(nll.var() / max(1, len(nll) - 1))
    return ppl, err, len(nll)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`fuselm perplexity`'s options."""
    p.add_argument("model", help="HF checkpoint folder or .gguf file")
    p.add_argument("text", help="a UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--quant", choices=["bf16", "fp8", "q8", "q5", "q4", "mxfp4"], default=None,
                   help="CUDA weights, as for `fuselm run`")


def main(args: argparse.Namespace) -> int:
    """Print the perplexity of args.text under args.model; 0 on success."""
    import sys

    from ..api import load
    path = Path(args.text)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FuselmError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise FuselmError(f"{path}: not UTF-8 text (byte {e.start})") from None
    model = load(args.model, device=args.device, ctx=args.ctx, quant=args.quant)
    ppl, err, n = perplexity(model.engine, model.tokenizer, text, args.ctx,
                             progress=lambda line: print(line, file=sys.stderr))
    print(f"PPL = {ppl:.4f} +/- {err:.4f} ({n} tokens scored in chunks of {args.ctx})")
    return 0

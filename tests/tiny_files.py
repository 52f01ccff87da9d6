"""Tiny model files written with numpy, shared by the error-path and hostile-input tests: a Llama
HF folder (config.json, float32 model.safetensors, word-level tokenizer.json) and GGUF files with
or without weights. No torch, no transformers."""
import json
import struct

import numpy as np
from gguf_files import TOKENS, finish, gguf_writer, llama_cpp_order
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from fuselm.models import DecoderConfig, build_graph

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True)
GGUF_HPARAMS = dict(block_count=1, context_length=64, embedding_length=32, feed_forward_length=64,
                    head_count=4, head_count_kv=2, vocab_size=len(TOKENS))
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY["vocab_size"] - 3)]


def write_tiny_folder(folder):
    """The tiny Llama HF folder in `folder` (no chat template); returns `folder`."""
    rng = np.random.default_rng(0)
    weights = build_graph(DecoderConfig.from_hf(TINY)).sources("weight")
    save_file({n.name: (0.1 * rng.standard_normal(n.shape)).astype(np.float32) for n in weights},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def write_safetensors(path, header, data: bytes = b"") -> None:
    """A .safetensors file from a raw header (any JSON value) and data bytes."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# llama.cpp names and numpy shapes of the tiny Llama's tensors (GGUF_HPARAMS, tied embeddings)
GGUF_TENSORS = {"token_embd.weight": (len(TOKENS), 32), "output_norm.weight": (32,),
                "blk.0.attn_norm.weight": (32,), "blk.0.ffn_norm.weight": (32,),
                "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
                "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
                "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32),
                "blk.0.ffn_down.weight": (32, 64)}


def write_tiny_gguf(path, weights: bool = True, edit=None, **hparams):
    """A tiny llama GGUF (F32 random weights unless `weights` is False); `hparams` override
    GGUF_HPARAMS and `edit(writer)` may add keys before the write. Returns `path`."""
    w = gguf_writer(path, "llama", **{**GGUF_HPARAMS, **hparams})
    if edit:
        edit(w)
    rng = np.random.default_rng(0)
    for name, shape in GGUF_TENSORS.items() if weights else ():
        t = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            t = llama_cpp_order(t, 4 if "attn_q" in name else 2)
        w.add_tensor(name, t)
    return finish(w, path)


CHAT_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


def write_chat_tokenizer(folder, template: str = CHAT_TEMPLATE):
    """Replace the tiny folder's tokenizer by one with ChatML specials (ids 3, 4), the words
    user, assistant, system and w0.., and a ChatML-like chat template; returns `folder`."""
    from tokenizers import AddedToken

    words = CHAT_SPECIALS + ["user", "assistant", "system"]
    words += [f"w{i}" for i in range(TINY["vocab_size"] - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in CHAT_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "chat_template": template}))
    return folder

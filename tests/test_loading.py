"""open_checkpoint + load_weights on tiny checkpoints written here: HF safetensors folders (fp32,
fp16, bf16, sharded) and GGUF files (F32, F16, BF16, Q8_0, Q4_0, Q4_1), against transformers'
logits; and every bad input, which must fail with one line naming the file or tensor."""
import json
import shutil

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from gguf_files import MERGES, TOKENS, finish, gguf_writer, llama_cpp_order  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from fuselm.errors import FuselmError  # noqa: E402
from fuselm.models import ConfigError, build_graph  # noqa: E402
from fuselm.loading.checkpoint import load_weights, open_checkpoint  # noqa: E402
from fuselm.runtime.reference import new_state, run_graph  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPT = [5, 77, 180, 3, 259, 42, 101]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"




def tiny_hf_model(h, tie: bool = False, seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                                   tie_word_embeddings=tie, bos_token_id=259, eos_token_id=260)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    h.randomize_(model, seed)
    return model


def save_tokenizer(folder):
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS[:-2])}, [tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": TEMPLATE}))


def save_folder(h, folder, dtype, **kw):
    model = tiny_hf_model(h, tie=kw.pop("tie", False))
    model.to(dtype).save_pretrained(folder, safe_serialization=True, **kw)
    save_tokenizer(folder)
    return folder


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def our_logits(ckpt, weights=None, ids=PROMPT) -> np.ndarray:
    graph = build_graph(ckpt.config)
    weights = weights or load_weights(ckpt, graph, progress=False)
    feeds = {"ids": np.array(ids, np.int32), "pos": np.arange(len(ids), dtype=np.int32)}
    return run_graph(graph, weights, feeds, new_state(graph, len(ids)))["logits"]


def stored_dtypes(path) -> set[str]:
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


# ---- Hugging Face folders ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tag,tie", [(torch.float32, "F32", False), (torch.float16, "F16", True),
                                           (torch.bfloat16, "BF16", False)])
def test_folder_round_trip(h, tmp_path, dtype, tag, tie):
    folder = save_folder(h, tmp_path, dtype, tie=tie)
    assert stored_dtypes(folder / "model.safetensors") == {tag}
    ckpt = open_checkpoint(folder)
    assert ckpt.config.tie_word_embeddings == tie and ckpt.generation["eos_token_id"] == 260
    # transformers reads the same 16-bit values and upcasts them to float32 exactly, as we do
    ref_model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rel = h.rel_err(our_logits(ckpt), hf_logits(ref_model, PROMPT))
    print(f"\n{tag} folder: logits relative error vs transformers {rel:.1e}")
    assert rel < 1e-5


def test_folder_weights_in_16_bit_dtypes(h, tmp_path):
    folder = save_folder(h, tmp_path, torch.bfloat16)
    ckpt = open_checkpoint(folder)
    graph = build_graph(ckpt.config)
    ref = {k: v for k, v in tiny_hf_model(h).to(torch.bfloat16).state_dict().items()}
    as_bf16 = load_weights(ckpt, graph, dtype=ml_dtypes.bfloat16, progress=False)
    as_f16 = load_weights(ckpt, graph, dtype=np.float16, progress=False)
    assert set(as_bf16) == {n.name for n in graph.sources("weight")}
    for name, w in as_bf16.items():
        assert w.dtype == ml_dtypes.bfloat16 and as_f16[name].dtype == np.float16
        assert np.array_equal(w.view(np.int16), ref[name].view(torch.int16).numpy()), name   # bit-exact
        np.testing.assert_allclose(as_f16[name].astype(np.float32), w.astype(np.float32), rtol=1e-3, atol=1e-4)


def test_sharded_folder(h, tmp_path):
    folder = save_folder(h, tmp_path, torch.float32, max_shard_size="40KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").exists()
    ckpt = open_checkpoint(folder)
    rel = h.rel_err(our_logits(ckpt), hf_logits(tiny_hf_model(h), PROMPT))
    assert rel < 1e-5


def test_folder_tokenizer_and_stop_ids(h, tmp_path):
    ckpt = open_checkpoint(save_folder(h, tmp_path, torch.float32))
    tok = ckpt.tokenizer
    assert tok.bos_id == 259 and tok.stop_ids == {260} and tok.has_chat_template
    assert tok.encode(" the then") == [258, 258, 110] and tok.decode([258, 258, 110]) == " the then"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x</s>"


# ---- GGUF files ----------------------------------------------------------------------------------

GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{LAYER_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def write_gguf(path, model, qtype=Q.F32, types=None):
    """A GGUF as llama.cpp's converter would write `model`: renamed, Q/K rows reordered, matrices
    stored as `qtype` (norms stay F32); `types` overrides the type per GGUF tensor name."""
    cfg = model.config
    w = gguf_writer(path, "llama", block_count=cfg.num_hidden_layers,
                    context_length=cfg.max_position_embeddings, embedding_length=cfg.hidden_size,
                    feed_forward_length=cfg.intermediate_size, head_count=cfg.num_attention_heads,
                    head_count_kv=cfg.num_key_value_heads, rope_freq_base=5000.0,
                    layer_norm_rms_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = t.float().numpy()
        if "q_proj" in name or "k_proj" in name:
            a = llama_cpp_order(a, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        kind = (types or {}).get(gguf_name(name), qtype if a.ndim == 2 else Q.F32)
        if kind in (Q.F32, Q.F16):
            w.add_tensor(gguf_name(name), a.astype(np.float32 if kind == Q.F32 else np.float16))
        elif kind == Q.I32:
            w.add_tensor(gguf_name(name), a.astype(np.int32))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, kind), raw_dtype=kind)
    return finish(w, path)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_weights_dequantized_in_hf_layout(h, tmp_path, qtype):
    model = tiny_hf_model(h)
    ckpt = open_checkpoint(write_gguf(tmp_path / "tiny.gguf", model, qtype))
    weights = load_weights(ckpt, build_graph(ckpt.config), progress=False)
    for name, t in model.state_dict().items():
        a = t.numpy()
        if a.ndim == 2 and qtype == Q.F16:
            a = a.astype(np.float16).astype(np.float32)
        elif a.ndim == 2 and qtype != Q.F32:   # what a quantize -> dequantize round trip gives
            a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], a, err_msg=name)


def test_gguf_config_tokenizer_and_logits(h, tmp_path):
    model = tiny_hf_model(h, tie=True)
    path = write_gguf(tmp_path / "tiny.gguf", model, Q.F32)
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (2, 64, 96, 4, 2, 261, 5000.0, True)
    assert ckpt.tokenizer.encode(" the") == [259, 258]        # add_bos_token: BOS first
    assert ckpt.tokenizer.stop_ids == {260} and ckpt.generation["eos_token_id"] == 260
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x</s>"
    ours = our_logits(ckpt)
    assert h.rel_err(ours, hf_logits(model, PROMPT)) < 1e-5
    # transformers' own GGUF loader (it undoes the row order itself) agrees on our file
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    assert h.rel_err(ours, hf_logits(theirs.eval(), PROMPT)) < 1e-5


# ---- bad input: one-line errors naming the file or tensor ----------------------------------------

def one_line_error(fn, *match):
    with pytest.raises(FuselmError) as e:
        fn()
    msg = str(e.value)
    print(f"\n  error: {msg}")
    assert "\n" not in msg, msg
    for m in match:
        assert str(m) in msg, msg
    return msg


def test_missing_path(tmp_path):
    one_line_error(lambda: open_checkpoint(tmp_path / "nope"), "nope", "no such file")


@pytest.mark.parametrize("remove,says", [("config.json", "no config.json"), ("model.safetensors", "no weights"),
                                         ("tokenizer.json", "no tokenizer.json")])
def test_folder_missing_part(h, tmp_path, remove, says):
    folder = save_folder(h, tmp_path, torch.float32)
    (folder / remove).unlink()
    one_line_error(lambda: open_checkpoint(folder), str(folder), says)


def test_missing_shard(h, tmp_path):
    folder = save_folder(h, tmp_path, torch.float32, max_shard_size="40KB")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    one_line_error(lambda: open_checkpoint(folder), shard.name, "does not exist")


def rewrite_weights(folder, edit):
    """Re-save model.safetensors after `edit(dict of arrays)`."""
    from safetensors.numpy import load_file
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor(h, tmp_path):
    folder = save_folder(h, tmp_path, torch.float32)
    rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    ckpt = open_checkpoint(folder)
    one_line_error(lambda: load_weights(ckpt, build_graph(ckpt.config), progress=False),
                   "model.layers.1.mlp.up_proj.weight", "missing")


def test_wrong_shape(h, tmp_path):
    folder = save_folder(h, tmp_path, torch.float32)
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite_weights(folder, lambda t: t.update({name: np.zeros((64, 64), np.float32)}))
    ckpt = open_checkpoint(folder)
    one_line_error(lambda: load_weights(ckpt, build_graph(ckpt.config), progress=False),
                   name, "(64, 64)", "(32, 64)")


@pytest.mark.parametrize("keep", [4, 200, -100])
def test_truncated_safetensors(h, tmp_path, keep):
    folder = save_folder(h, tmp_path, torch.float32)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep])
    one_line_error(lambda: open_checkpoint(folder), "model.safetensors")


def test_garbage_safetensors_header(h, tmp_path):
    folder = save_folder(h, tmp_path, torch.float32)
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\x00\xff" * 16   # the JSON header no longer parses
    f.write_bytes(bytes(data))
    one_line_error(lambda: open_checkpoint(folder), "model.safetensors", "not a valid safetensors")


@pytest.mark.parametrize("keep", [3, 100, 3000, -50])
def test_truncated_gguf(h, tmp_path, keep):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf_model(h), Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    one_line_error(lambda: open_checkpoint(path), "tiny.gguf")


def test_unsupported_gguf_tensor_type(h, tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf_model(h), Q.F32, types={"blk.1.ffn_up.weight": Q.I32})
    ckpt = open_checkpoint(path)
    one_line_error(lambda: load_weights(ckpt, build_graph(ckpt.config), progress=False),
                   "blk.1.ffn_up.weight", "I32")


def test_unsupported_architecture(h, tmp_path):
    folder = save_folder(h, tmp_path, torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    ckpt = open_checkpoint(folder)
    with pytest.raises(ConfigError, match="FooForCausalLM"):
        build_graph(ckpt.config)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    one_line_error(lambda: open_checkpoint(tmp_path / "notes.txt"), "notes.txt", "not a checkpoint")
    shutil.copy(tmp_path / "notes.txt", tmp_path / "fake.gguf")
    one_line_error(lambda: open_checkpoint(tmp_path / "fake.gguf"), "fake.gguf", "not a valid GGUF")


# ---- reading ahead -------------------------------------------------------------------------------

def test_read_ahead_keeps_order_and_its_budget():
    """Reads run on threads but come back in item order, and never hold more than the budget in
    flight (beyond the one that must run when none does)."""
    import threading
    import time
    from fuselm.loading.checkpoint import read_ahead
    sizes = [5, 1, 1, 7, 2, 2, 2, 9, 1, 3]
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def read(i):
        with lock:
            state["now"] += sizes[i]
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.01 * (len(sizes) - i))      # later items finish first
        with lock:
            state["now"] -= sizes[i]
        return i * 10

    assert list(read_ahead(read, list(range(len(sizes))), lambda i: sizes[i], 4, 8)) == [10 * i for i in range(len(sizes))]
    assert 7 <= state["most"] <= 9      # 5 + 1 + 1 overlapped; the 9 ran alone, nothing beside it


def test_read_ahead_raises_at_the_failing_item_and_starts_no_later_read():
    from fuselm.loading.checkpoint import read_ahead
    started = []

    def read(i):
        started.append(i)
        if i == 2:
            raise FuselmError("tensor 2 is broken")
        return i

    got = read_ahead(read, list(range(50)), lambda i: 1, 2, 3)
    assert next(got) == 0 and next(got) == 1
    with pytest.raises(FuselmError, match="tensor 2 is broken"):
        next(got)
    assert max(started) <= 2 + 3              # at most the budget's worth read beyond it


def test_iter_weights_read_ahead_equal_one_at_a_time(h, tmp_path):
    """Threads reading ahead give the same weights, in the same order, as one reader."""
    from fuselm.loading.checkpoint import iter_weights
    ckpt = open_checkpoint(save_folder(h, tmp_path, torch.bfloat16))
    graph = build_graph(ckpt.config)
    alone = list(iter_weights(ckpt, graph, workers=1))
    ahead = list(iter_weights(ckpt, graph, workers=4))
    assert [n for n, _ in ahead] == [n for n, _ in alone] == [n.name for n in graph.sources("weight")]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(alone, ahead))


class CallerOnly:
    """numpy, as a device array module (iter_weights' xp) that fails when a thread other than the
    one that made it uses it."""

    def __init__(self):
        import threading
        self._owner = threading.get_ident()

    def __getattr__(self, name):
        import threading
        assert threading.get_ident() == self._owner, f"xp.{name} used on a reader thread"
        return getattr(np, name)


def test_iter_weights_does_device_work_on_the_callers_thread_only(h, tmp_path):
    """With a device xp, the quantized tensors are converted on the caller's thread (CUDA's current
    device is per thread), into the same bytes as numpy's on the readers' threads."""
    from fuselm.loading.checkpoint import iter_weights
    from fuselm.quant.formats import QuantizedWeight
    ckpt = open_checkpoint(write_gguf(tmp_path / "q8.gguf", tiny_hf_model(h), Q.Q8_0))
    graph = build_graph(ckpt.config)
    device = list(iter_weights(ckpt, graph, keep_quantized=True, workers=4, xp=CallerOnly()))
    host = list(iter_weights(ckpt, graph, keep_quantized=True, workers=4))
    kept = [(a, b) for (_, a), (_, b) in zip(device, host) if isinstance(b, QuantizedWeight)]
    assert kept and all(isinstance(a, QuantizedWeight) and a.format == b.format for a, b in kept)
    assert all(np.array_equal(a.data, b.data) for a, b in kept)

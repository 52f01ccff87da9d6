"""Model files are untrusted: corrupt or hostile safetensors headers, shard lists, GGUF metadata and
hyperparameters fail while the checkpoint opens, in one line naming the file, the tensor or the key
and the reason. Each case here once gave a traceback or loaded and produced garbage."""
import json
import re
import shutil
import sys
import time

import gguf
import numpy as np
import pytest
from gguf_files import TOKENS
from tiny_files import TINY, write_safetensors, write_tiny_folder, write_tiny_gguf

import fuselm
from fuselm.errors import FuselmError
from fuselm.loading.checkpoint import open_checkpoint
from fuselm.models import DecoderConfig


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture
def tiny(tiny_base, tmp_path):
    """A fresh copy of the tiny HF folder, free to break."""
    return shutil.copytree(tiny_base, tmp_path / "tiny")


def one_line(fn, *args, **kwargs) -> str:
    """fn(...) must raise FuselmError in one line; returns the message."""
    with pytest.raises(FuselmError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ---- safetensors headers --------------------------------------------------------------------------

F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("entry,says", [
    ({**F32_2, "dtype": ["F32"]}, "dtype ['F32'] is not one of"),
    ({**F32_2, "dtype": "F31"}, "dtype 'F31' is not one of"),
    ({**F32_2, "data_offsets": ["0", "8"]}, "data_offsets ['0', '8'] are not two non-negative integers"),
    ({**F32_2, "data_offsets": [0.0, 8.0]}, "data_offsets [0.0, 8.0] are not two non-negative integers"),
    ({**F32_2, "data_offsets": [-8, 0]}, "data_offsets [-8, 0] are not two non-negative integers"),
    ({**F32_2, "data_offsets": [8, 0]}, "begin <= end"),
    ({**F32_2, "data_offsets": [0, 8, 16]}, "are not two non-negative integers"),
    ({**F32_2, "data_offsets": [True, 8]}, "are not two non-negative integers"),
    ({**F32_2, "shape": [-2]}, "shape [-2] is not a list of non-negative integers"),
    ({**F32_2, "shape": "2"}, "shape '2' is not a list of non-negative integers"),
    ([0, 8], "needs dtype, shape and data_offsets"),
])
def test_safetensors_header_fields_are_type_checked(tiny, entry, says):
    """A header entry whose dtype is no known string, whose offsets are not non-negative integers in
    order, or whose shape is not a list of counts: one line naming the file and the tensor."""
    write_safetensors(tiny / "model.safetensors", {"w": entry}, b"\0" * 8)
    message = one_line(open_checkpoint, tiny)
    assert message.startswith(f"{tiny / 'model.safetensors'}: corrupt header entry for tensor 'w' ("), message
    assert says in message, message


def test_negative_offsets_into_the_json_header_are_refused(tiny):
    """Offsets below 0 would read the JSON header as weights (NaN logits, exit 0): refused."""
    header = {"model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [-128, 0]}}
    write_safetensors(tiny / "model.safetensors", header)
    assert "data_offsets [-128, 0]" in one_line(fuselm.load, tiny, device="cpu", progress=False)


def test_overlapping_tensors_are_refused(tiny):
    """Two tensors sharing bytes of the data section: a corrupt file, both named."""
    header = {"a": {**F32_2, "data_offsets": [0, 8]}, "b": {**F32_2, "data_offsets": [4, 12]}}
    write_safetensors(tiny / "model.safetensors", header, b"\0" * 12)
    assert one_line(open_checkpoint, tiny).endswith("corrupt: tensors 'a' and 'b' overlap in the data section")


def test_offsets_beyond_the_data_section_are_refused(tiny):
    write_safetensors(tiny / "model.safetensors", {"w": F32_2}, b"\0" * 4)
    assert "truncated: tensor 'w' ends at byte" in one_line(open_checkpoint, tiny)


def test_a_deeply_nested_header_is_refused(tiny):
    """JSON nested beyond the parser's recursion limit is not a traceback."""
    raw = b"[" * 100_000 + b"]" * 100_000
    (tiny / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    assert "not a valid safetensors file" in one_line(open_checkpoint, tiny)


def test_a_tensor_in_two_shards_is_refused(tiny):
    (tiny / "model.safetensors").rename(tiny / "a.safetensors")
    shutil.copy(tiny / "a.safetensors", tiny / "b.safetensors")
    message = one_line(open_checkpoint, tiny)
    assert re.search(r"b\.safetensors: tensor '[\w.]+' is also in .*a\.safetensors$", message), message


# ---- shard paths ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", "sub/../../model.safetensors", ""])
def test_shard_paths_stay_inside_the_model_folder(tiny, shard):
    """An index naming a shard outside the folder (.., absolute) is refused before it is opened."""
    index = tiny / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    assert one_line(open_checkpoint, tiny) == f"{index}: shard '{shard}' is outside the model folder"


def test_shards_in_a_subfolder_and_symlinked_shards_load(tiny, tmp_path):
    """Relative names inside the folder still work, symlinks included (the Hugging Face cache links
    every shard to a blob outside the snapshot folder)."""
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    (tiny / "model.safetensors").rename(blob)
    (tiny / "sub").mkdir()
    (tiny / "sub" / "model-1.safetensors").symlink_to(blob)
    (tiny / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "sub/model-1.safetensors"}}))
    model = fuselm.load(tiny, device="cpu", progress=False)
    assert model.config.hidden_size == 32


# ---- hyperparameters ------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,says", [
    (dict(rms_norm_eps=3.4e33), "rms_norm_eps = 3.4e+33 is out of range (0 < rms_norm_eps <= 0.1)"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps = 0.0 is out of range"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps = -1e-05 is out of range"),
    (dict(rope_theta=0.5), "rope_theta = 0.5 is out of range (1 < rope_theta <= 1e+12)"),
    (dict(rope_theta=float("inf")), "rope_theta = inf is out of range"),
    (dict(rope_theta=float("nan")), "rope_theta = nan is not a number"),
    (dict(num_hidden_layers=10**9), "num_hidden_layers = 1000000000 is out of range (1 to 1024)"),
    (dict(vocab_size=1 << 40), "vocab_size = 1099511627776 is out of range"),
    (dict(head_dim=7), "head_dim = 7 is odd (RoPE rotates pairs of dimensions)"),
    (dict(hidden_size=30), "hidden_size 30 is not a multiple of num_attention_heads 4 (and there is no head_dim)"),
    (dict(rope_scaling={"rope_type": "linear", "factor": -2.0}),
     "rope_scaling factor = -2.0 is out of range (0 < factor <= 1e8)"),
    (dict(rope_scaling={"rope_type": "linear", "factor": float("nan")}), "rope_scaling factor = nan is out of range"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192}),
     "rope_scaling low_freq_factor 4 is not below high_freq_factor 1"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling type 'dynamic' is not supported"),
])
def test_hyperparameters_are_range_checked(changes, says):
    """Values no model has fail DecoderConfig.from_hf, naming the source and the key."""
    message = one_line(DecoderConfig.from_hf, {**TINY, **changes}, "x/config.json")
    assert message.startswith("x/config.json: ") and says in message, message


def test_gguf_with_a_corrupted_norm_eps_is_refused(tmp_path):
    """SmolLM2's GGUF with rms_norm_eps turned into 3.4e33 used to answer " is is is ...", exit 0."""
    path = write_tiny_gguf(tmp_path / "eps.gguf", edit=lambda w: w.add_layer_norm_rms_eps(3.4e33))
    message = one_line(fuselm.load, path, device="cpu", progress=False)
    assert message.startswith(f"{path}: rms_norm_eps = 3.4") and "out of range" in message, message


def test_gguf_head_count_that_does_not_divide_the_width(tmp_path):
    path = write_tiny_gguf(tmp_path / "heads.gguf", weights=False, head_count=3, head_count_kv=3)
    assert "hidden_size 32 is not a multiple of num_attention_heads 3" in one_line(open_checkpoint, path)


# ---- the config against the tokenizer and the tensors ---------------------------------------------

def test_vocab_size_smaller_than_the_tokenizer(tmp_path):
    """A GGUF claiming fewer rows than its vocabulary has tokens: ids past the embedding are refused."""
    path = write_tiny_gguf(tmp_path / "v.gguf", vocab_size=100)
    assert one_line(open_checkpoint, path) == f"{path}: the tokenizer has {len(TOKENS)} tokens but vocab_size is 100"


def test_embedding_shape_must_match_vocab_and_width(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**cfg, "vocab_size": 20}))
    message = one_line(open_checkpoint, tiny)
    assert message.endswith("tensor 'model.embed_tokens.weight' has shape (16, 32) but vocab_size "
                            "and hidden_size are (20, 32)"), message


def test_layer_count_must_match_the_tensors(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    assert one_line(open_checkpoint, tiny).endswith("the tensors hold 1 layers but num_hidden_layers is 3")


# ---- GGUF metadata that does not decode -----------------------------------------------------------

def patch_bytes(path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new))


def test_gguf_string_that_is_not_utf8_names_the_file_and_key(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", weights=False, edit=lambda w: w.add_chat_template("{{ 'QQQQ' }}"))
    patch_bytes(path, b"QQQQ", b"\xff\xfe\xfd\xfc")
    message = one_line(open_checkpoint, path)
    assert message.startswith(f"{path}: GGUF metadata 'tokenizer.chat_template' does not decode ("), message


def test_gguf_token_that_is_not_utf8_names_the_file_and_key(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", weights=False)
    patch_bytes(path, b"\x04\x00\x00\x00\x00\x00\x00\x00</s>", b"\x04\x00\x00\x00\x00\x00\x00\x00<\xff\xfe>")
    message = one_line(open_checkpoint, path)
    assert message.startswith(f"{path}: GGUF metadata 'tokenizer.ggml.tokens' does not decode ("), message


def test_gguf_merges_naming_unknown_tokens(tmp_path):
    """A merge of tokens the vocabulary lacks: tokenizers' own exception becomes one line."""
    path = write_tiny_gguf(tmp_path / "m.gguf", weights=False)
    patch_bytes(path, "\u0120t he".encode(), "\u0120t hX".encode())
    message = one_line(open_checkpoint, path)
    assert message.startswith(f"{path}: the GGUF tokenizer cannot be built (") and "out of vocabulary" in message


def test_gguf_chat_template_that_is_not_a_string(tmp_path):
    path = write_tiny_gguf(tmp_path / "c.gguf", weights=False,
                           edit=lambda w: w.add_array("tokenizer.chat_template", [1, 2]))
    assert one_line(open_checkpoint, path).endswith("tokenizer.chat_template is not a string")


@pytest.mark.parametrize("key,value,says", [
    ("pre", [0], "tokenizer.ggml.pre is not a string"),
    ("model", 7, "tokenizer.ggml.model is not a string"),
    ("add_bos_token", "yes", "tokenizer.ggml.add_bos_token is not a boolean"),
    ("merges", [1, 2], "tokenizer.ggml.merges is not a list of strings"),
    ("token_type", "control", "tokenizer.ggml.token_type is not a list of integers"),
])
def test_gguf_tokenizer_keys_of_the_wrong_type(tmp_path, key, value, says):
    def edit(writer):
        writer.kv_data[0].pop(f"tokenizer.ggml.{key}", None)
        if isinstance(value, list):
            writer.add_array(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_key_value(f"tokenizer.ggml.{key}", value, {str: gguf.GGUFValueType.STRING,
                                                                  int: gguf.GGUFValueType.UINT32}[type(value)])
    path = write_tiny_gguf(tmp_path / "k.gguf", weights=False, edit=edit)
    assert one_line(open_checkpoint, path) == f"{path}: GGUF metadata {says}"


def test_tiny_gguf_loads(tmp_path):
    """The files above differ from this one, which loads and generates, by the corruption alone."""
    model = fuselm.load(write_tiny_gguf(tmp_path / "ok.gguf"), device="cpu", progress=False)
    assert model.config.vocab_size == len(TOKENS) and np.isfinite(model.config.rms_norm_eps)
    "".join(model.generate("the", 3))
    assert model.last_stats.prompt_tokens >= 1 and model.last_stats.decode_steps >= 0


# ---- chat templates: sandboxed and bounded --------------------------------------------------------

NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE_TEMPLATES = {
    "nested loops": (NESTED, "rendering took more than 0.3 s"),
    "loops over a list, no calls": ("{% set l = range(100000)|list %}{% for i in l %}{% for j in l %}"
                                    "{% endfor %}{% endfor %}", "rendering took more than 0.3 s"),
    "output": ("{% for i in range(1000) %}{% for j in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
               "the output exceeds 65536 characters"),
    "string times": ("{{ 'x' * 1000000000 }}", "'*' would build 1000000000 items"),
    "power": ("{{ 10 ** 100000000 }}", "'**' would build too large a number"),
    "squaring": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
                 "'*' would build a number of more than 65536 bits"),
    "doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "'~' built 16777216 characters"),
    "doubling with +": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}", "'+' would build 16777216 items"),
    "wide filter": ("{{ 'x'|center(1000000000) }}", "argument 1000000000 is too large"),
    "wide method": ("{{ 'x'.ljust(1000000000) }}", "argument 1000000000 is too large"),
    "wide format": ("{{ '{:>1000000000}'.format(1) }}", "format with a field width of a million or more"),
    "wide %": ("{{ '%1000000000d' % 1 }}", "'%' with a field width of a million or more"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    "type error": ("{{ 1 + 'a' }}", "failed: TypeError: unsupported operand"),
    "sandbox escape": ("{{ ''.__class__.__mro__ }}", "chat template: access to attribute '__class__'"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_chat_templates_are_bounded(monkeypatch, name):
    """Templates that would hang, eat memory or escape: one line naming the file, within about
    MAX_SECONDS (0.3 s here)."""
    from fuselm.loading import chat_template

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.3)
    if name == "output":   # a smaller limit, reached well within the time
        monkeypatch.setattr(chat_template, "MAX_CHARS", 1 << 16)
    source, says = HOSTILE_TEMPLATES[name]
    template = chat_template.compile_template(source, "m/tokenizer_config.json")
    started = time.monotonic()
    message = one_line(chat_template.render, template, [{"role": "user", "content": "hi"}], True, {},
                       origin="m/tokenizer_config.json")
    assert message.startswith("m/tokenizer_config.json: chat template") and says in message, message
    assert time.monotonic() - started < 3


def test_a_hanging_template_in_a_checkpoint_names_its_file(tiny, monkeypatch):
    from fuselm.loading import chat_template

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.3)
    (tiny / "tokenizer_config.json").write_text(json.dumps({"chat_template": NESTED}))
    model = fuselm.load(tiny, device="cpu", progress=False)
    message = one_line(model.chat, [{"role": "user", "content": "w1"}], 2)
    assert message == f"{tiny / 'tokenizer_config.json'}: chat template: rendering took more than 0.3 s"
    # the trace function is gone afterwards: plain rendering of a fine template is untouched
    assert sys.gettrace() is None or "chat_template" not in repr(sys.gettrace())


def test_ordinary_templates_render_unchanged():
    from fuselm.loading import chat_template

    source = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + "
              "'<|im_end|>\\n' }}{% endfor %}{{ '%s-%d' % ('a', 3) }}{{ '{:>4}'.format(7) }}{{ 'x' * 3 }}")
    template = chat_template.compile_template(source)
    out = chat_template.render(template, [{"role": "user", "content": " hi "}], True, {})
    assert out == "<|im_start|>user\nhi<|im_end|>\na-3   7xxx"


def test_a_value_with_line_breaks_keeps_the_error_on_one_line(tmp_path):
    """Model files may put line breaks in any string an error quotes (found by the fuzzer)."""
    path = write_tiny_gguf(tmp_path / "a.gguf", weights=False,
                           edit=lambda w: (w.kv_data[0].pop("general.architecture"),
                                           w.add_string("general.architecture", "llama\nfake: ok")))
    assert one_line(open_checkpoint, path) == (f"{path}: GGUF architecture 'llama\\nfake: ok' is not supported "
                                               "(supported: llama, qwen2, qwen3, gemma2, gemma3, olmo2, smollm3, qwen3moe, phi3, "
                                               "gpt-oss)")
    assert str(FuselmError("x\ny\rz")) == "x\\ny\\rz"

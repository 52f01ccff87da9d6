"""Fuzzing the files a model comes with: GGUF headers (bytes and metadata values), safetensors
headers, tokenizer.json, tokenizer_config.json and config.json, each corrupted by hypothesis and
loaded (and generated from) as `fuselm run` would. Every outcome must be a clean run or a one-line
FuselmError (tests/fuzzing.py); counts are bounded so the whole file takes seconds."""
import json
import os
import shutil
import struct

import gguf
import pytest
from fuzzing import Target, assert_clean, json_values, mutate_bytes, mutate_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_files import GGUF_HPARAMS, write_chat_tokenizer, write_tiny_folder, write_tiny_gguf

import fuselm
from fuselm.errors import FuselmError

# FUSELM_FUZZ_EXAMPLES=2000 fuzzes longer (locally); CI keeps the default, seconds in all
FUZZ = settings(max_examples=int(os.environ.get("FUSELM_FUZZ_EXAMPLES", 60)), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def load_and_generate(path) -> None:
    """What `fuselm run PATH -p ... --chat` does: open, load, render a chat, generate two tokens."""
    model = fuselm.load(path, device="cpu", progress=False, log=open("/dev/null", "w"))
    prompt = [{"role": "user", "content": "w5 w6 the"}]
    pieces = model.chat(prompt, 2) if model.tokenizer.has_chat_template else model.generate("w5 w6 the", 2)
    "".join(pieces)


@pytest.fixture(scope="module")
def folder_seed(tmp_path_factory):
    return write_chat_tokenizer(write_tiny_folder(tmp_path_factory.mktemp("fuzz-folder")))


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("fuzz-gguf") / "seed.gguf")
    return path.read_bytes(), gguf.GGUFReader(path).data_offset


def folder_target(seed_folder, tmp_path, name: str, write) -> Target:
    """A Target for one file of the HF folder: its value is written by `write(path, value)` into
    a fresh copy of the folder, which is then loaded."""
    def consume(value):
        folder = tmp_path / "case"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(seed_folder, folder)
        write(folder / name, value)
        load_and_generate(folder)
    return Target(name, None, consume)


def write_json(path, value) -> None:
    path.write_text(json.dumps(value))


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header_bytes(gguf_seed, tmp_path, data):
    raw, header_end = gguf_seed
    path = tmp_path / "fuzz.gguf"
    target = Target("GGUF header", raw, lambda b: (path.write_bytes(b), load_and_generate(path)))
    assert_clean(target, mutate_bytes(data, raw, header_end))


GGUF_KEYS = [f"llama.{k}" for k in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                                     "attention.head_count", "attention.head_count_kv", "vocab_size",
                                     "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
                                     "expert_count", "rope.scaling.type", "rope.scaling.factor")]
GGUF_KEYS += ["general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
              "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.add_space_prefix",
              "tokenizer.ggml.scores"]
gguf_scalars = st.one_of(
    st.tuples(st.integers(0, 2**32 - 1), st.just(gguf.GGUFValueType.UINT32)),
    st.tuples(st.integers(-2**63, 2**63 - 1), st.just(gguf.GGUFValueType.INT64)),
    st.tuples(st.floats(width=32), st.just(gguf.GGUFValueType.FLOAT32)),
    st.tuples(st.text(max_size=16), st.just(gguf.GGUFValueType.STRING)),
    st.tuples(st.booleans(), st.just(gguf.GGUFValueType.BOOL)),
    st.tuples(st.lists(st.integers(0, 300), min_size=1, max_size=6), st.just(gguf.GGUFValueType.ARRAY)),
)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_metadata_values(tmp_path, data):
    """Well-formed GGUF files whose hyperparameters and tokenizer keys hold random values and types."""
    edits = data.draw(st.dictionaries(st.sampled_from(GGUF_KEYS), gguf_scalars, min_size=1, max_size=3))

    def edit(writer):
        for key, (value, kind) in edits.items():
            writer.kv_data[0].pop(key, None)
            writer.add_key_value(key, value, kind,
                                 sub_type=gguf.GGUFValueType.INT32 if kind == gguf.GGUFValueType.ARRAY else None)

    def consume(_):
        path = tmp_path / "meta.gguf"
        path.unlink(missing_ok=True)
        write_tiny_gguf(path, edit=edit)
        load_and_generate(path)

    assert_clean(Target("GGUF metadata", GGUF_HPARAMS, consume), edits)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header(folder_seed, tmp_path, data):
    raw = (folder_seed / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]

    def write(path, value):
        text = json.dumps(value).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + body)

    assert_clean(folder_target(folder_seed, tmp_path, "model.safetensors", write), mutate_json(data, header))


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header_bytes(folder_seed, tmp_path, data):
    raw = (folder_seed / "model.safetensors").read_bytes()
    end = 8 + struct.unpack("<Q", raw[:8])[0]
    target = folder_target(folder_seed, tmp_path, "model.safetensors", lambda p, v: p.write_bytes(v))
    assert_clean(target, mutate_bytes(data, raw, end))


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
@FUZZ
@given(data=st.data())
def test_fuzz_folder_json(folder_seed, tmp_path, name, data):
    seed = json.loads((folder_seed / name).read_text())
    assert_clean(folder_target(folder_seed, tmp_path, name, write_json), mutate_json(data, seed))


@settings(FUZZ, max_examples=max(15, FUZZ.max_examples // 4))
@given(value=json_values)
def test_fuzz_index_json(folder_seed, tmp_path, value):
    """model.safetensors.index.json holding anything at all."""
    assert_clean(folder_target(folder_seed, tmp_path, "model.safetensors.index.json", write_json),
                 {"weight_map": value} if isinstance(value, dict) else value)


def test_harness_reports_other_exceptions_and_hangs():
    """The harness itself: a TypeError or a hang fails, a FuselmError of one line passes."""
    def refuse(message):
        raise FuselmError(message)

    with pytest.raises(AssertionError, match="TypeError escaped"):
        assert_clean(Target("t", None, lambda v: 1 + "a"), None)
    with pytest.raises(AssertionError, match="hangs on this input"):
        assert_clean(Target("t", None, lambda v: [None for _ in iter(int, 1)]), None, seconds=0.2)
    class TwoLines(FuselmError):
        def __str__(self):
            return "a\nb"

    def refuse_in_two_lines(value):
        raise TwoLines(value)

    with pytest.raises(AssertionError, match="not one line"):
        assert_clean(Target("t", None, refuse_in_two_lines), "a")
    assert assert_clean(Target("t", None, refuse), "bad") == "bad"
    assert assert_clean(Target("t", None, lambda v: None), None) is None

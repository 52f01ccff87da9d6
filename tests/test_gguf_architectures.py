"""GGUF files of the architectures beyond plain llama: qwen2 (Q/K/V bias), qwen3 (per-head Q/K norms,
explicit head_dim), gemma2 (norms stored as 1 + w, pre/post norms, soft-caps, sliding window), olmo2
(post-norms only, Q/K norms over the whole projection), smollm3 (llama's Q/K row order, every 4th
layer NoPE) and a llama-architecture GGUF of a Mistral model. Each is written here as llama.cpp's
converter would write it (names, Q/K row order, norm offset, metadata keys), at F32 and Q8_0, then
read by fuselm and, where transformers' own GGUF loader knows the architecture (not olmo2 nor
smollm3), by that loader from the SAME file; the logits must agree, and agree with the HF model the
file was written from."""
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf_files import V, finish, gguf_writer, llama_cpp_order  # noqa: E402

from fuselm.errors import FuselmError  # noqa: E402
from fuselm.models import build_graph  # noqa: E402
from fuselm.loading.checkpoint import load_weights, open_checkpoint  # noqa: E402
from fuselm.runtime.reference import new_state, run_graph  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPT = [5, 77, 180, 3, 259, 42, 101]   # 7 tokens: longer than the Gemma 2 window of 4 below



# the tiny models: each arch with the shapes that exercise what it adds
SPECS = {
    "qwen2": dict(cls="Qwen2", tie=False, cfg=dict(num_attention_heads=4, num_key_value_heads=2)),
    # head_dim 128 != 64 / 2: must come from `qwen3.attention.key_length` (128 is also what
    # transformers' GGUF loader assumes, since it does not read that key for qwen3)
    "qwen3": dict(cls="Qwen3", tie=True, cfg=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)),
    # head_dim 256 = transformers' default query_pre_attn_scalar (its GGUF loader keeps the default);
    # soft-caps 50 / 30 are Gemma 2's and transformers' defaults; window 4 < the 7-token prompt
    "gemma2": dict(cls="Gemma2", tie=True, cfg=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                                    query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                                    final_logit_softcapping=30.0, sliding_window=4,
                                                    hidden_activation="gelu_pytorch_tanh")),
    "mistral": dict(cls="Mistral", tie=False, cfg=dict(num_attention_heads=4, num_key_value_heads=2,
                                                       sliding_window=None)),
    # 6 layers: llama.cpp's fixed pattern makes layer 5 full, 0-4 slide with RoPE base 10000
    "gemma3": dict(cls="Gemma3", tie=True, cfg=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                                    num_hidden_layers=6, query_pre_attn_scalar=256,
                                                    sliding_window=4, hidden_activation="gelu_pytorch_tanh")),
    "olmo2": dict(cls="Olmo2", tie=False, cfg=dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True)),
    # 4 layers: llama.cpp's fixed NoPE step of 4 makes layer 3 NoPE
    "smollm3": dict(cls="SmolLM3", tie=True, cfg=dict(num_attention_heads=4, num_key_value_heads=2,
                                                      num_hidden_layers=4, no_rope_layer_interval=4)),
}
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "mistral": "llama", "olmo2": "olmo2",
             "smollm3": "smollm3", "gemma3": "gemma3"}
HF_READS = {"qwen2", "qwen3", "gemma2", "mistral", "gemma3"}   # archs transformers' GGUF loader can map
GEMMA = {"gemma2", "gemma3"}
PERMUTED = {"llama", "smollm3"}                     # archs whose converter reorders Q/K rows

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_OLMO2_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf: str, arch: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, *rest = hf.split(".")
    table = {"gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER, "olmo2": _OLMO2_LAYER}.get(arch, _LAYER)
    return f"blk.{layer}.{table['.'.join(rest[:-1])]}.{rest[-1]}"


def tiny_model(h, kind: str, seed: int = 0):
    spec = SPECS[kind]
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
              rms_norm_eps=1e-5 if kind not in GEMMA else 1e-6, rope_theta=5000.0, tie_word_embeddings=spec["tie"],
              bos_token_id=259, eos_token_id=260, pad_token_id=0)
    config_class = "Gemma3TextConfig" if kind == "gemma3" else f"{spec['cls']}Config"
    cfg = getattr(transformers, config_class)(**{**kw, **spec["cfg"]})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{spec['cls']}ForCausalLM")(cfg).eval()
    h.randomize_(model, seed)
    return model


def write_gguf(path, model, kind: str, qtype=Q.F32, softcaps=None, name=None, linear_rope=None):
    """`model` as llama.cpp's converter writes it for `kind`; 2-D matrices stored as `qtype`."""
    cfg, arch = model.config, GGUF_ARCH[kind]
    w = gguf_writer(path, arch, name or ("Mistral 7B Instruct v0.3" if kind == "mistral" else f"tiny-{kind}"),
                    block_count=cfg.num_hidden_layers, context_length=cfg.max_position_embeddings,
                    embedding_length=cfg.hidden_size, feed_forward_length=cfg.intermediate_size,
                    head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads,
                    rope_freq_base=5000.0, layer_norm_rms_eps=cfg.rms_norm_eps, vocab_size=V)
    if kind in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in PERMUTED:
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if kind == "gemma2":
        attn_cap, final_cap = softcaps or (cfg.attn_logit_softcapping, cfg.final_logit_softcapping)
        w.add_attn_logit_softcapping(attn_cap)
        w.add_final_logit_softcapping(final_cap)
        w.add_sliding_window(cfg.sliding_window)
    if kind == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if linear_rope:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope)
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = t.float().numpy().copy()
        if arch in PERMUTED and ("q_proj" in name or "k_proj" in name):
            a = llama_cpp_order(a, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if arch in GEMMA and name.endswith("norm.weight"):
            a = a + 1   # the converter stores Gemma's norm weights as 1 + w
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name, arch), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name, arch), a.astype(np.float32))
    return finish(w, path)


def our_logits(ckpt) -> np.ndarray:
    graph = build_graph(ckpt.config)
    weights = load_weights(ckpt, graph, progress=False)
    feeds = {"ids": np.array(PROMPT, np.int32), "pos": np.arange(len(PROMPT), dtype=np.int32)}
    return run_graph(graph, weights, feeds, new_state(graph, len(PROMPT)))["logits"]


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float().numpy()


EXPECTED_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3": "Gemma3ForCausalLM",
                  "mistral": "LlamaForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}


@pytest.mark.parametrize("kind", list(SPECS))
def test_f32_weights_are_hf_weights(h, tmp_path, kind):
    """Names, Q/K row order and the Gemma norm offset all undone: every weight equals the HF one."""
    model = tiny_model(h, kind)
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", model, kind))
    assert ckpt.config.architecture == EXPECTED_CLASS[kind]
    weights = load_weights(ckpt, build_graph(ckpt.config), progress=False)
    tied = model.config.tie_word_embeddings
    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(weights) == set(ref)
    for name, t in ref.items():
        # Gemma norms: (w + 1) - 1 in float32 is w to within one rounding of the +1
        np.testing.assert_allclose(weights[name], t.numpy(), rtol=0, atol=2e-7, err_msg=name)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
@pytest.mark.parametrize("kind", list(SPECS))
def test_logits_match_transformers_gguf_loader(h, tmp_path, kind, qtype):
    t0 = time.perf_counter()
    model = tiny_model(h, kind)
    write_gguf(tmp_path / "m.gguf", model, kind, qtype)
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    cfg = ckpt.config
    spec = SPECS[kind]["cfg"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size, cfg.rope_theta) == (spec.get("num_hidden_layers", 2), 64, 96, spec["num_attention_heads"],
                                                spec["num_key_value_heads"], V, 5000.0)
    head_dim = spec.get("head_dim", 64 // spec["num_attention_heads"])
    assert cfg.head_dim == head_dim and cfg.tie_word_embeddings == SPECS[kind]["tie"]
    ours = our_logits(ckpt)
    rel = "n/a"
    if kind in HF_READS:
        theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf",
                                                                         dtype=torch.float32).eval()
        rel = h.rel_err(ours, hf_logits(theirs_model))
        assert rel < 1e-4
        rel = f"{rel:.1e}"
    rel_src = h.rel_err(ours, hf_logits(model))   # vs the unquantized model the file was written from
    print(f"\n{kind} {qtype.name}: vs transformers(gguf) {rel}, vs source HF model {rel_src:.1e} "
          f"({time.perf_counter() - t0:.1f}s)")
    assert rel_src < (1e-4 if qtype == Q.F32 else 3e-2)


def test_llama_gguf_named_exactly_mistral(h, tmp_path):
    """general.name "mistral" makes transformers' loader switch to its `mistral` path, which gguf 0.19
    cannot map (NotImplementedError there); fuselm keeps the llama graph and matches the source model."""
    model = tiny_model(h, "mistral")
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", model, "mistral", name="mistral"))
    assert ckpt.config.architecture == "LlamaForCausalLM"
    rel = h.rel_err(our_logits(ckpt), hf_logits(model))
    print(f"\nllama-arch GGUF named 'mistral' vs source MistralForCausalLM: {rel:.1e}")
    assert rel < 1e-4


def test_qwen_bias_and_qk_norm_config(h, tmp_path):
    q2 = open_checkpoint(write_gguf(tmp_path / "q2.gguf", tiny_model(h, "qwen2"), "qwen2")).config
    # Qwen2: Q/K/V bias only, through the architecture; no O bias asked for
    assert not q2.attention_bias and q2.sliding_window is None
    graph = build_graph(q2)
    names = {n.name for n in graph.sources("weight")}
    assert "model.layers.1.self_attn.k_proj.bias" in names and "model.layers.1.self_attn.o_proj.bias" not in names
    q3 = open_checkpoint(write_gguf(tmp_path / "q3.gguf", tiny_model(h, "qwen3"), "qwen3")).config
    assert q3.head_dim == 128 and not q3.attention_bias
    assert "model.layers.0.self_attn.q_norm.weight" in {n.name for n in build_graph(q3).sources("weight")}


def test_olmo2_and_smollm3_config(h, tmp_path):
    """olmo2: biases and whole-projection Q/K norms, no pre-norms; smollm3: layer 3 of 4 is NoPE
    (llama.cpp's fixed step, no metadata key) and the LM head is the embedding."""
    olmo = open_checkpoint(write_gguf(tmp_path / "o.gguf", tiny_model(h, "olmo2"), "olmo2")).config
    names = {n.name for n in build_graph(olmo).sources("weight")}
    assert olmo.attention_bias and "model.layers.0.input_layernorm.weight" not in names
    assert build_graph(olmo).nodes["model.layers.1.self_attn.k_norm.weight"].shape == (2 * 16,)
    smol = open_checkpoint(write_gguf(tmp_path / "s.gguf", tiny_model(h, "smollm3"), "smollm3")).config
    graph = build_graph(smol)
    assert sum(n.op == "rope" for n in graph.nodes.values()) == 2 * 3 and smol.tie_word_embeddings
    assert smol.extra["no_rope_layer_interval"] == 4 and smol.head_dim == 16


def test_gemma2_metadata_keys(h, tmp_path):
    """Soft-caps and window are read from gemma2.* metadata (values unlike any default)."""
    path = write_gguf(tmp_path / "g.gguf", tiny_model(h, "gemma2"), "gemma2", softcaps=(42.5, 17.25))
    cfg = open_checkpoint(path).config
    assert cfg.extra["attn_logit_softcapping"] == 42.5 and cfg.extra["final_logit_softcapping"] == 17.25
    assert cfg.sliding_window == 4 and cfg.head_dim == 256 and cfg.extra["query_pre_attn_scalar"] == 256
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == pytest.approx(1e-6)
    graph = build_graph(cfg)
    attn = graph.sources("attention")
    assert [n.attrs["window"] for n in attn] == [4, 0]          # layer 0 slides, layer 1 is global
    assert all(n.attrs["softcap"] == 42.5 and n.attrs["scale"] == pytest.approx(256 ** -0.5) for n in attn)
    assert [n.attrs["cap"] for n in graph.sources("softcap")] == [17.25]


def test_gemma3_layout_and_scaling(h, tmp_path):
    """Gemma 3: llama.cpp's fixed layout (every 6th layer full, local RoPE base 10000) and the
    linear scaling of the full layers from rope.scaling.*; against the source model with that scaling."""
    model = tiny_model(h, "gemma3")
    cfg = model.config
    cfg.rope_parameters["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 5000.0}
    scaled = transformers.Gemma3ForCausalLM(cfg).eval()
    scaled.load_state_dict(model.state_dict())
    ckpt = open_checkpoint(write_gguf(tmp_path / "g.gguf", scaled, "gemma3", linear_rope=8.0))
    ours = ckpt.config
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert ours.extra["sliding_window_pattern"] == 6 and ours.extra["query_pre_attn_scalar"] == 256
    graph = build_graph(ours)
    assert [n.attrs["window"] for n in graph.sources("attention")] == [4] * 5 + [0]
    rel = h.rel_err(our_logits(ckpt), hf_logits(scaled))
    print(f"\ngemma3 with linear RoPE scaling vs source model: {rel:.1e}")
    assert rel < 1e-4


@pytest.mark.parametrize("arch,layers,scalar", [("gemma2", 26, 128), ("gemma2", 46, 144), ("gemma3", 48, 128),
                                                ("gemma3", 62, 144)])
def test_gemma_query_scale_follows_llama_cpp(tmp_path, arch, layers, scalar):
    """No query_pre_attn_scalar in GGUF: llama.cpp uses head_dim, but hidden/heads for the 27Bs
    (Gemma 2: 46 layers, Gemma 3: 62)."""
    from fuselm.loading.gguf_config import config_from_gguf
    from fuselm.loading.gguf_store import read_gguf
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in (("block_count", layers), ("embedding_length", 4608), ("feed_forward_length", 36864),
                       ("head_count", 32), ("head_count_kv", 16), ("key_length", 128), ("value_length", 128),
                       ("vocab_size", 256000)):
        getattr(w, f"add_{add}")(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = config_from_gguf(read_gguf(path), path)
    assert cfg["query_pre_attn_scalar"] == scalar


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FuselmError) as e:
        open_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg and "falcon.gguf" in msg and "'falcon'" in msg
    for arch in ("llama", "qwen2", "qwen3", "gemma2", "qwen3moe", "phi3"):
        assert arch in msg, msg

"""GGUF files of Qwen3-MoE (`qwen3moe`) and Phi-3 (`phi3`), written here as llama.cpp's converter
writes them, read by fuselm and checked against the transformers model they were written from and
against fuselm's own safetensors path for the same weights.

qwen3moe: the router `ffn_gate_inp`, the experts as one 3-D stack per projection
(`ffn_{gate,up,down}_exps`), qwen3's Q/K norms and head_dim (`key_length`), and
`expert_count` / `expert_used_count` / `expert_feed_forward_length`; llama.cpp renormalises the
top-k weights of this arch, so the source model has norm_topk_prob true.
phi3: Q, K, V fused as `attn_qkv`, gate and up fused as `ffn_up`, the rotated dims of a head as
`rope.dimension_count` (partial rotary), LongRoPE's factors as the tensors `rope_factors_long` /
`rope_factors_short` with `rope.scaling.original_context_length` and `rope.scaling.attn_factor`.
"""
import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf_files import BOS, EOS, V, finish, gguf_writer  # noqa: E402
from test_gguf_architectures import gguf_name, hf_logits  # noqa: E402

from fuselm.errors import FuselmError  # noqa: E402
from fuselm.loading.checkpoint import load_weights, open_checkpoint  # noqa: E402
from fuselm.models import build_graph  # noqa: E402
from fuselm.quant.formats import GGUF_FORMATS  # noqa: E402
from fuselm.runtime.reference import new_state, run_graph  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPT = [5, 77, 180, 3, 259, 42, 101]
E, TOP_K, MOE_INTER = 6, 3, 32


def tiny(h, cls: str, seed: int = 0, **kw):
    """A tiny float32 transformers model of class `cls` with random weights."""
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0)
    cfg = getattr(transformers, f"{cls}Config")(**{**base, **kw}, attn_implementation="eager")
    cfg._experts_implementation = "eager"   # torch._grouped_mm wants 16-byte strides
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).eval()
    h.randomize_(model, seed)
    return model


def add(w, name: str, a: np.ndarray, qtype):
    """One tensor, quantized as `qtype` when it is a matrix (or a stack of them)."""
    if a.ndim >= 2 and qtype != Q.F32:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, a.astype(np.float32))


def common_keys(cfg) -> dict:
    return dict(block_count=cfg.num_hidden_layers, context_length=cfg.max_position_embeddings,
                embedding_length=cfg.hidden_size, feed_forward_length=cfg.intermediate_size,
                head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads,
                rope_freq_base=5000.0, layer_norm_rms_eps=cfg.rms_norm_eps, vocab_size=V)


def our_logits(path, context=None) -> np.ndarray:
    ckpt = open_checkpoint(path)
    graph = build_graph(ckpt.config, context)
    weights = load_weights(ckpt, graph, progress=False)
    feeds = {"ids": np.array(PROMPT, np.int32), "pos": np.arange(len(PROMPT), dtype=np.int32)}
    return run_graph(graph, weights, feeds, new_state(graph, len(PROMPT)))["logits"]


# ---- qwen3moe --------------------------------------------------------------------------------------

def tiny_qwen3_moe(h, seed: int = 0):
    return tiny(h, "Qwen3Moe", seed, head_dim=32, num_experts=E, num_experts_per_tok=TOP_K,
                moe_intermediate_size=MOE_INTER, norm_topk_prob=True)


def write_qwen3moe(path, model, qtype=Q.F32, expert_count=E):
    cfg = model.config
    w = gguf_writer(path, "qwen3moe", "tiny-qwen3moe", **common_keys(cfg), key_length=cfg.head_dim,
                    value_length=cfg.head_dim, expert_count=expert_count, expert_used_count=TOP_K,
                    expert_feed_forward_length=MOE_INTER)
    for name, t in model.state_dict().items():
        a = t.float().numpy().copy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):      # [E, 2I, D]: gate rows first
            add(w, f"blk.{layer}.ffn_gate_exps.weight", a[:, :MOE_INTER], qtype)
            add(w, f"blk.{layer}.ffn_up_exps.weight", a[:, MOE_INTER:], qtype)
        elif name.endswith("mlp.experts.down_proj"):
            add(w, f"blk.{layer}.ffn_down_exps.weight", a, qtype)
        elif name.endswith("mlp.gate.weight"):
            add(w, f"blk.{layer}.ffn_gate_inp.weight", a, Q.F32)   # llama.cpp keeps the router F32
        else:
            add(w, gguf_name(name, "qwen3"), a, qtype)
    return finish(w, path)


@pytest.fixture(scope="module")
def qwen3_moe(h):
    return tiny_qwen3_moe(h)


def test_qwen3moe_config_and_weights(tmp_path, qwen3_moe):
    """The expert metadata becomes Qwen3-MoE's config keys; every stack reads back as the model's."""
    ckpt = open_checkpoint(write_qwen3moe(tmp_path / "m.gguf", qwen3_moe))
    cfg = ckpt.config
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.head_dim == 32
    ex = cfg.extra
    assert (ex["num_experts"], ex["num_experts_per_tok"], ex["moe_intermediate_size"], ex["norm_topk_prob"]) == \
        (E, TOP_K, MOE_INTER, True)
    weights = load_weights(ckpt, build_graph(cfg), progress=False)
    sd = {k: v.float().numpy() for k, v in qwen3_moe.state_dict().items()}
    for i in range(2):
        p = f"model.layers.{i}.mlp"
        np.testing.assert_array_equal(weights[f"{p}.experts.*.gate_proj.weight"], sd[f"{p}.experts.gate_up_proj"][:, :MOE_INTER])
        np.testing.assert_array_equal(weights[f"{p}.experts.*.up_proj.weight"], sd[f"{p}.experts.gate_up_proj"][:, MOE_INTER:])
        np.testing.assert_array_equal(weights[f"{p}.experts.*.down_proj.weight"], sd[f"{p}.experts.down_proj"])
        np.testing.assert_array_equal(weights[f"{p}.gate.weight"], sd[f"{p}.gate.weight"])
        np.testing.assert_array_equal(weights[f"model.layers.{i}.self_attn.q_norm.weight"],
                                      sd[f"model.layers.{i}.self_attn.q_norm.weight"])


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_qwen3moe_logits_match_transformers_and_safetensors(h, tmp_path, qwen3_moe, qtype):
    qwen3_moe.save_pretrained(tmp_path / "hf")
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0")).save(str(tmp_path / "hf" / "tokenizer.json"))
    ref = our_logits(tmp_path / "hf")
    source = hf_logits(qwen3_moe)
    assert h.rel_err(ref, source) < 1e-4       # the safetensors path against transformers
    ours = our_logits(write_qwen3moe(tmp_path / "m.gguf", qwen3_moe, qtype))
    rel, rel_src = h.rel_err(ours, ref), h.rel_err(ours, source)
    print(f"\nqwen3moe {qtype.name}: vs fuselm(safetensors) {rel:.1e}, vs transformers {rel_src:.1e}")
    tol = 1e-5 if qtype == Q.F32 else 3e-2
    assert rel < tol and rel_src < max(tol, 1e-4)


def test_qwen3moe_stack_of_the_wrong_count_fails_in_one_line(tmp_path, qwen3_moe):
    path = write_qwen3moe(tmp_path / "bad.gguf", qwen3_moe, expert_count=8)
    with pytest.raises(FuselmError) as e:
        open_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg and "bad.gguf" in msg and "ffn_gate_exps" in msg and "expert_count" in msg, msg


# ---- phi3 ------------------------------------------------------------------------------------------

PHI3_LAYER = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def tiny_phi3(h, original: int | None, seed: int = 0):
    """Phi-3 with partial rotary 0.75 (12 of 16 dims) and, with `original`, LongRoPE over that
    pretraining context (factors unlike each other, so a swap shows)."""
    kw = dict(partial_rotary_factor=0.75, sliding_window=None)
    if original:
        rng = np.random.default_rng(seed)
        kw.update(original_max_position_embeddings=original,
                  rope_scaling={"type": "longrope", "short_factor": rng.uniform(1, 4, 6).tolist(),
                                "long_factor": rng.uniform(1, 4, 6).tolist()})
    return tiny(h, "Phi3", seed, **kw)


def write_phi3(path, model, qtype=Q.F32, blocks: dict | None = None):
    """The GGUF file of `model`, its matrices as `qtype`; `blocks`: GGUF name -> (raw blocks, type)
    of tensors written as those bytes instead."""
    cfg, blocks = model.config, blocks or {}
    rotated = int(cfg.hidden_size // cfg.num_attention_heads * cfg.partial_rotary_factor)
    w = gguf_writer(path, "phi3", "tiny-phi3", **common_keys(cfg), rope_dimension_count=rotated, sliding_window=0)
    rope = cfg.rope_parameters
    if rope.get("long_factor"):
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original   # the converter's attention factor
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        add(w, "rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32), Q.F32)
        add(w, "rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32), Q.F32)
    for name, t in model.state_dict().items():
        a = t.float().numpy().copy()
        if name.startswith("model.layers."):
            _, _, layer, *rest = name.split(".")
            name = f"blk.{layer}.{PHI3_LAYER['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            name = gguf_name(name, "phi3")
        if name in blocks:
            w.add_tensor(name, blocks[name][0], raw_dtype=blocks[name][1])
        else:
            add(w, name, a, qtype)
    return finish(w, path)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
@pytest.mark.parametrize("rope", ["plain", "short", "long"])
def test_phi3_logits_match_transformers(h, tmp_path, rope, qtype):
    """"short": the prompt stays within the original context of 16 (short factors); "long": an
    original context of 2, passed by the prompt, so transformers takes the long factors and the
    graph must be built for a context beyond 2."""
    model = tiny_phi3(h, {"plain": None, "short": 16, "long": 2}[rope])
    path = write_phi3(tmp_path / "p.gguf", model, qtype)
    cfg = open_checkpoint(path).config
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.extra["partial_rotary_factor"] == 0.75
    assert cfg.sliding_window is None and (cfg.rope_scaling is None) == (rope == "plain")
    ours = our_logits(path, context=32 if rope == "long" else None)
    rel = h.rel_err(ours, hf_logits(model))
    print(f"\nphi3 {rope} {qtype.name}: vs transformers {rel:.1e}")
    assert rel < (1e-4 if qtype == Q.F32 else 3e-2)
    if rope == "long":   # the short factors (no context given) are measurably wrong here
        assert h.rel_err(our_logits(path), hf_logits(model)) > 1e-2


@pytest.mark.parametrize("ctx,original", [(32, 2), (16, 16)], ids=["long", "short"])
def test_phi3_gguf_load_picks_factors_by_ctx(h, tmp_path, ctx, original):
    """fuselm.load passes its KV cache's context to the Phi-3 graph: ctx 32 over an original
    context of 2 takes the long factors, ctx 16 within 16 the short ones; greedy tokens are
    transformers' (which picks by the sequence's length, beyond 2 / within 16 here throughout)."""
    import fuselm
    from fuselm import SamplingParams

    model = tiny_phi3(h, original, seed=1)
    engine = fuselm.load(write_phi3(tmp_path / "p.gguf", model), device="cpu", ctx=ctx, progress=False).engine
    prompt, greedy = [3, 14, 15, 9, 2], SamplingParams()
    ours = [engine.prefill(prompt, greedy)]
    while len(ours) < 10:
        ours.append(engine.decode(ours[-1], greedy))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(prompt):] and len(set(ours)) > 1


def gguf_blocks(qtype, n: int, k: int, rng, std: float = 0.05) -> np.ndarray:
    """Random GGUF blocks of `qtype` for an [n, k] matrix (gguf cannot quantize to K-quants), the f16
    scales set so that its weights spread about `std`; raw uint8 [n, bytes per row]."""
    from test_quant import SCALE_FIELDS, random_blocks

    fmt = GGUF_FORMATS[qtype.name].name
    raw = random_blocks(fmt, n, k, rng)
    spread = float(gguf.quants.dequantize(raw, qtype).std())
    per_block = raw.reshape(n, -1, gguf.GGML_QUANT_SIZES[qtype][1])
    for at in SCALE_FIELDS[fmt]:           # every weight is linear in these scales
        d = per_block[..., at: at + 2].copy().view("<f2").astype(np.float32) * (std / spread)
        per_block[..., at: at + 2] = d.astype("<f2").view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_phi3_quantized_fused_tensors_stay_quantized(h, tmp_path, qtype):
    """`attn_qkv` and `ffn_up` (gate + up) in a quantized type: their blocks hold whole rows, so the
    graph's Q, K, V, gate and up (rows of them, Q's and K's reordered per head for partial rotary)
    stay in that format where the GPU keeps it, with the values of the dequantizing load; that load
    gives transformers' logits for the model holding the blocks' values. hidden_size 256: the
    K-quants' super-blocks span 256 weights of a row."""
    from fuselm.loading.checkpoint import gpu_formats
    from fuselm.quant.formats import QuantizedWeight
    from fuselm.quant.layout import dequantize

    model = tiny(h, "Phi3", 3, hidden_size=256, partial_rotary_factor=0.75, sliding_window=None)
    rng, blocks = np.random.default_rng(3), {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
                raw = gguf_blocks(qtype, *p.shape, rng)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(p.shape)))
                layer, fused = name.split(".")[2], "attn_qkv" if "qkv" in name else "ffn_up"
                blocks[f"blk.{layer}.{fused}.weight"] = (raw, qtype)
    path = write_phi3(tmp_path / "q.gguf", model, Q.F32, blocks)
    ckpt = open_checkpoint(path)
    graph = build_graph(ckpt.config)
    plain = load_weights(ckpt, graph, progress=False)
    kept = load_weights(ckpt, graph, progress=False, keep_quantized=True)
    fmt = GGUF_FORMATS[qtype.name].name
    parts = [n for n in plain if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                             "gate_proj.weight", "up_proj.weight"))]
    assert len(parts) == 10
    formats = gpu_formats(ckpt, graph)
    for name in parts:
        w = kept[name]
        assert isinstance(w, QuantizedWeight) and w.format == fmt == formats[name], name
        assert w.shape == plain[name].shape, name
        np.testing.assert_array_equal(dequantize(w), plain[name], err_msg=name)
    rel = h.rel_err(our_logits(path), hf_logits(model))
    print(f"\nphi3, fused tensors {qtype.name}: vs transformers {rel:.1e}")
    assert rel < 1e-4

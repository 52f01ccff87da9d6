"""GGUF files of gpt-oss (`gpt-oss`), written here as llama.cpp's converter writes them, read by
fuselm and checked against the transformers model they were written from.

The converter splits the Hub's interleaved gate_up_proj into `ffn_gate_exps` and `ffn_up_exps`
(and its bias alike), transposes the stacks to [E, rows, cols], keeps the experts in MXFP4 (or
floats), names the sinks `attn_sinks.weight` and the norm after attention `post_attention_norm`,
and writes the sliding window, the experts' width and YaRN's factor and original context; the
window pattern, YaRN's betas and the SwiGLU clamp it leaves to llama.cpp's code.
"""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf_files import BOS, EOS, V, finish, gguf_writer  # noqa: E402
from test_gguf_architectures import PROMPT, hf_logits  # noqa: E402

from fuselm.loading.checkpoint import load_weights, open_checkpoint  # noqa: E402
from fuselm.models import build_graph  # noqa: E402
from fuselm.runtime.reference import new_state, run_graph  # noqa: E402

Q = gguf.GGMLQuantizationType
E, TOP_K, LAYERS = 4, 2, 3
ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def tiny_gpt_oss(h, seed: int = 0):
    """A tiny float32 gpt-oss whose rows are whole MXFP4 blocks (64 = 2 x 32)."""
    cfg = transformers.GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=TOP_K, sliding_window=3,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)],
        max_position_embeddings=256, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 64, "rope_theta": 5000.0},
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0, attn_implementation="eager")
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    h.randomize_(model, seed)
    return model


def write_gpt_oss(path, model, mxfp4: bool):
    """The GGUF of `model`; with `mxfp4`, its experts quantized to MXFP4 and the model's experts
    replaced by what those blocks hold (the reference then runs the same weights)."""
    cfg = model.config
    w = gguf_writer(path, "gpt-oss", "tiny-gpt-oss", block_count=LAYERS, context_length=cfg.max_position_embeddings,
                    embedding_length=cfg.hidden_size, feed_forward_length=cfg.intermediate_size,
                    head_count=cfg.num_attention_heads, head_count_kv=cfg.num_key_value_heads, key_length=16,
                    value_length=16, rope_freq_base=5000.0, layer_norm_rms_eps=cfg.rms_norm_eps, vocab_size=V,
                    expert_count=E, expert_used_count=TOP_K, expert_feed_forward_length=cfg.intermediate_size,
                    sliding_window=cfg.sliding_window, rope_scaling_type=gguf.RopeScalingType.YARN,
                    rope_scaling_factor=4.0, rope_scaling_orig_ctx_len=64)

    def stack(name, a):            # [E, rows, cols], MXFP4 or floats; returns what it holds
        if not mxfp4:
            w.add_tensor(name, a.astype(np.float32))
            return a
        blocks = gguf.quants.quantize(a, Q.MXFP4)
        w.add_tensor(name, blocks, raw_dtype=Q.MXFP4)
        return gguf.quants.dequantize(blocks, Q.MXFP4).reshape(a.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for name, t in model.state_dict().items():
        a = t.float().numpy().copy()
        if name in names:
            w.add_tensor(names[name], a)
            continue
        _, _, i, *rest = name.split(".")
        part, blk = ".".join(rest), f"blk.{i}"
        experts = model.model.layers[int(i)].mlp.experts
        if part == "mlp.experts.gate_up_proj":                 # [E, D, 2I], gate and up interleaved
            rows = a.transpose(0, 2, 1)
            held = [stack(f"{blk}.ffn_gate_exps.weight", rows[:, 0::2]), stack(f"{blk}.ffn_up_exps.weight", rows[:, 1::2])]
            with torch.no_grad():
                both = np.empty_like(rows)
                both[:, 0::2], both[:, 1::2] = held
                experts.gate_up_proj.copy_(torch.from_numpy(both.transpose(0, 2, 1)))
        elif part == "mlp.experts.down_proj":                  # [E, I, D]
            held = stack(f"{blk}.ffn_down_exps.weight", a.transpose(0, 2, 1))
            with torch.no_grad():
                experts.down_proj.copy_(torch.from_numpy(held.transpose(0, 2, 1)))
        elif part == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"{blk}.ffn_gate_exps.bias", a[:, 0::2].copy())
            w.add_tensor(f"{blk}.ffn_up_exps.bias", a[:, 1::2].copy())
        elif part == "mlp.experts.down_proj_bias":
            w.add_tensor(f"{blk}.ffn_down_exps.bias", a)
        elif part.startswith("mlp.router."):
            w.add_tensor(f"{blk}.ffn_gate_inp.{rest[-1]}", a)
        elif part == "self_attn.sinks":
            w.add_tensor(f"{blk}.attn_sinks.weight", a)
        elif rest[0] == "self_attn":
            w.add_tensor(f"{blk}.{ATTN[rest[1]]}.{rest[2]}", a)
        else:
            w.add_tensor(f"{blk}.{'attn_norm' if rest[0] == 'input_layernorm' else 'post_attention_norm'}.weight", a)
    return finish(w, path)


def our_logits(path) -> np.ndarray:
    ckpt = open_checkpoint(path)
    graph = build_graph(ckpt.config)
    weights = load_weights(ckpt, graph, progress=False)
    feeds = {"ids": np.array(PROMPT, np.int32), "pos": np.arange(len(PROMPT), dtype=np.int32)}
    return run_graph(graph, weights, feeds, new_state(graph, len(PROMPT)))["logits"]


def test_gpt_oss_config_from_gguf(h, tmp_path):
    """The metadata and llama.cpp's fixed choices become the config transformers' model has."""
    model = tiny_gpt_oss(h)
    cfg = open_checkpoint(write_gpt_oss(tmp_path / "m.gguf", model, mxfp4=False)).config
    ex = cfg.extra
    assert cfg.architecture == "GptOssForCausalLM" and cfg.head_dim == 16 and cfg.sliding_window == 3
    assert (ex["num_local_experts"], ex["num_experts_per_tok"], ex["layer_types"]) == \
        (E, TOP_K, model.config.layer_types)
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.rope_scaling["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
def test_gpt_oss_gguf_logits_match_transformers(h, tmp_path, mxfp4):
    """A prompt past the sliding window through the GGUF (experts in floats, or in MXFP4 with
    transformers holding what the blocks hold): every position's logits within 1e-4."""
    model = tiny_gpt_oss(h, 1)
    path = write_gpt_oss(tmp_path / "m.gguf", model, mxfp4)
    ours, theirs = our_logits(path), hf_logits(model)
    assert float(np.std(theirs)) > 0.1
    assert h.rel_err(ours, theirs) < 1e-4, h.rel_err(ours, theirs)


def test_mxfp4_expert_stacks_stay_mxfp4_for_the_gpu(h, tmp_path):
    """Loaded for the GPU (keep_quantized), the GGUF's MXFP4 expert stacks stay in MXFP4 (repacked
    to element order), their values exactly the floats the CPU reads."""
    from fuselm.quant.formats import QuantizedWeight
    from fuselm.quant.layout import dequantize
    ckpt = open_checkpoint(write_gpt_oss(tmp_path / "m.gguf", tiny_gpt_oss(h, 1), True))
    graph = build_graph(ckpt.config)
    floats = load_weights(ckpt, graph, progress=False)
    kept = load_weights(ckpt, graph, progress=False, keep_quantized=True)
    quantized = {n for n, w in kept.items() if isinstance(w, QuantizedWeight)}
    assert quantized == {n for n, w in floats.items() if w.ndim == 3}, quantized
    for n in quantized:
        assert kept[n].format == "mxfp4"
        np.testing.assert_array_equal(dequantize(kept[n]), floats[n])

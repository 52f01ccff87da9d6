"""Tensor parallelism on the CPU (compiler/partition.py, runtime/reference.py run_ranks): a model
split over N simulated ranks, each with its slices of the weights and its own KV caches, summing
at every all_reduce, gives the logits of the whole model, prompt and decode steps alike; what
the split cannot serve is refused by name."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuselm.compiler.partition import partition
from fuselm.errors import FuselmError
from fuselm.models import DecoderConfig, build_graph
from fuselm.runtime.reference import new_state, run_graph, run_ranks

ARCHS = {   # each one's distinctive layers: windows, biases, per-head Q/K norms, soft-capping and post-norms,
    # LongRoPE-free Phi-3, routed experts (Qwen3-MoE's 48 wide: any rank count here divides it), sinks
    "LlamaForCausalLM": {}, "MistralForCausalLM": {"sliding_window": 6}, "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {}, "Phi3ForCausalLM": {},
    "Gemma2ForCausalLM": {"sliding_window": 6, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"},
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen3MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                            "norm_topk_prob": True},
    "GptOssForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                          "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True},
}


def tiny(arch: str, kv_heads: int, group: int, head_dim: int, inter: int, **extra) -> DecoderConfig:
    heads = kv_heads * group
    return DecoderConfig.from_hf({"architectures": [arch], "vocab_size": 97, "hidden_size": heads * head_dim,
                                  "head_dim": head_dim, "intermediate_size": inter, "num_hidden_layers": 2,
                                  "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                  "max_position_embeddings": 64, **ARCHS.get(arch, {}), **extra})


def random_weights(graph, rng) -> dict:
    return {n.name: ((1 + 0.1 * rng.standard_normal(n.shape)) if len(n.shape) == 1
                     else 0.2 * rng.standard_normal(n.shape)).astype(np.float32) for n in graph.sources("weight")}


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arch=st.sampled_from(sorted(ARCHS)), ranks=st.sampled_from([2, 4]), kv_per_rank=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([8, 16]), inter_per_rank=st.sampled_from([8, 24]),
       seed=st.integers(0, 2**16))
def test_ranks_in_lockstep_give_the_whole_models_logits(arch, ranks, kv_per_rank, group, head_dim, inter_per_rank,
                                                        seed):
    """A prompt of 6 tokens, then 3 single-token steps, on the whole graph and on the ranks."""
    cfg = tiny(arch, ranks * kv_per_rank, group, head_dim, ranks * inter_per_rank)
    graph = build_graph(cfg)
    rng = np.random.default_rng(seed)
    weights = random_weights(graph, rng)
    shards = partition(graph, ranks)
    graphs, rank_weights = [s.graph for s in shards], [s.weights(weights) for s in shards]
    state, states = new_state(graph, 16), [new_state(g, 16) for g in graphs]
    ids = rng.integers(0, cfg.vocab_size, 9).astype(np.int32)
    for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):
        feeds = {"ids": ids[lo:hi], "pos": np.arange(lo, hi, dtype=np.int32)}
        want = run_graph(graph, weights, feeds, state)["logits"]
        for out in run_ranks(graphs, rank_weights, feeds, states):
            err = float(np.abs(out["logits"] - want).max() / np.abs(want).max())
            assert err < 1e-4, f"{arch} over {ranks} ranks, tokens {lo}..{hi}: rel error {err:.2e}"


def test_the_split_keeps_whole_heads_and_two_all_reduces_a_layer():
    cfg = tiny("LlamaForCausalLM", 4, 2, 16, 64)
    graph = build_graph(cfg)
    shards = partition(graph, 4)
    g = shards[1].graph
    attention = [n for n in g.nodes.values() if n.op == "attention"]
    assert all(n.attrs["n_heads"] == 2 and n.attrs["n_kv_heads"] == 1 for n in attention)
    assert sum(n.op == "all_reduce" for n in g.nodes.values()) == 2 * cfg.num_layers
    axes = shards[1].split_axes
    assert axes["model.layers.0.self_attn.q_proj.weight"] == 0 and axes["model.layers.0.self_attn.o_proj.weight"] == 1
    assert axes["model.layers.0.mlp.gate_proj.weight"] == 0 and axes["model.layers.0.mlp.down_proj.weight"] == 1
    assert "model.embed_tokens.weight" not in axes and "model.norm.weight" not in axes   # replicated
    assert g.nodes["cache.0.k"].shape == ("S", 16)
    weights = random_weights(graph, np.random.default_rng(0))
    parts = [s.weights(weights)["model.layers.0.self_attn.o_proj.weight"] for s in shards]
    assert np.array_equal(np.concatenate(parts, axis=1), weights["model.layers.0.self_attn.o_proj.weight"])
    assert partition(graph, 1)[0].graph is graph
    from fuselm.codegen import build_program
    with pytest.raises(FuselmError, match="tensor-parallel rank's: the GPU has no all-reduce for it yet"):
        build_program(g, 64, compile=False)


@pytest.mark.parametrize("cfg, ranks, message", [
    (lambda: tiny("LlamaForCausalLM", 3, 2, 8, 48), 2, "3 KV heads do not split over 2 ranks"),
    (lambda: tiny("LlamaForCausalLM", 2, 3, 8, 48), 4, "6 query heads do not split over 4 ranks"),
    (lambda: tiny("Olmo2ForCausalLM", 2, 2, 8, 48), 2, "normalizes the whole projection"),
    (lambda: tiny("MixtralForCausalLM", 2, 2, 8, 36, num_local_experts=4, num_experts_per_tok=2), 8,
     "36 expert intermediate rows do not split over 8 ranks"),
    (lambda: tiny("LlamaForCausalLM", 2, 2, 8, 48), 0, "at least one rank"),
])
def test_what_cannot_be_split_is_refused_by_name(cfg, ranks, message):
    with pytest.raises(FuselmError, match=message):
        partition(build_graph(cfg()), ranks)


def test_experts_split_their_width_and_the_down_bias_is_added_once():
    """gpt-oss over 2 ranks: every expert on both, half its intermediate rows each, the down
    bias on rank 0 alone, the sinks with their heads, an all_reduce after the experts."""
    cfg = tiny("GptOssForCausalLM", 2, 2, 8, 48, **ARCHS["GptOssForCausalLM"])
    graph = build_graph(cfg)
    shards = partition(graph, 2)
    weights = random_weights(graph, np.random.default_rng(0))
    p = "model.layers.0.mlp.experts"
    ones = [s.weights(weights) for s in shards]
    assert ones[1][f"{p}.gate_proj.weight"].shape == (4, 24, 32) and ones[1][f"{p}.down_proj.weight"].shape == (4, 32, 24)
    assert np.array_equal(ones[0][f"{p}.down_proj.bias"], weights[f"{p}.down_proj.bias"])
    assert not ones[1][f"{p}.down_proj.bias"].any()
    assert ones[1]["model.layers.0.self_attn.sinks"].shape == (2,)
    moe = next(n for n in shards[1].graph.nodes.values() if n.op == "moe_ffn")
    assert f"{moe.name}.all_reduce" in shards[1].graph.nodes


def test_inspect_tp_shows_each_ranks_share(capsys):
    from fuselm import cli
    assert cli.main(["inspect", "llama-3.1-8b", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "8 of 32 query heads, 2 of 8 KV heads" in out and "64 (2 a layer), 16384 bytes a token each" in out
    assert "o_proj.weight: (4096, 4096) split along axis 1 (input columns: row-parallel)" in out
    assert cli.main(["inspect", "gpt-oss-20b", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "experts.gate_proj.weight: (32, 2880, 2880) split along axis 1 (each expert's intermediate rows)" in out
    assert "experts.down_proj.bias: (32, 2880) on rank 0 only" in out and "sinks: (64,) split along axis 0" in out
    assert cli.main(["inspect", "llama-3.1-8b", "--tp", "3"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: tensor parallelism: attention_10: 32 query heads do not split over 3 ranks"]

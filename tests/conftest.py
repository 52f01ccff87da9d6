"""Shared test helpers: hypothesis profiles, relative error, tiny random Hugging Face models.

Hypothesis profiles: "ci" (default; few examples, no deadline: CI has 2 slow cores) and "dev"
(more examples). Pick one with HYPOTHESIS_PROFILE=dev.

Helpers are handed out as session-scoped fixtures (function-scoped fixtures do not mix with
@given), so the test files never import this module by name.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=20, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", max_examples=100, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"shape {out.shape} != reference shape {ref.shape}"
    denom = np.linalg.norm(ref)
    assert denom > 0, "reference is all zeros: the comparison would prove nothing"
    return float(np.linalg.norm(out - ref) / denom)


def randomize_(model, seed: int) -> None:
    """Overwrite every parameter with seeded random values that keep activations O(1).

    Norm weights get 1 + noise (not ones, so a norm weight read under the wrong name shows);
    embeddings N(0, 1); matrices and biases N(0, 1/fan_in).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():   # tied parameters appear once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / (p.shape[-1] ** 0.5))


def make_hf_model(arch: str = "LlamaForCausalLM", seed: int = 0, **cfg_kwargs):
    """A tiny float32 HF model with random weights, its weights dict and its fuselm DecoderConfig.

    The config dict given to fuselm is the HF config's `to_dict()` with `architectures` set and,
    when the model scales RoPE, the scaling also under the classic `rope_scaling` key, as the
    config.json files of Llama 3.1/3.2 on the Hub have it (transformers 5 writes only
    `rope_parameters`; see test_reference_vs_hf.test_from_hf_reads_rope_parameters).
    """
    import torch
    import transformers

    from fuselm.models import DecoderConfig

    cls_cfg = {"LlamaForCausalLM": transformers.LlamaConfig,
               "MistralForCausalLM": transformers.MistralConfig}[arch]
    hf_cfg = cls_cfg(architectures=[arch], **cfg_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_cfg).eval()
    randomize_(model, seed)
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if hf_cfg.tie_word_embeddings:   # some versions list lm_head.weight, some do not: never need it
        weights.pop("lm_head.weight", None)
    d = hf_cfg.to_dict()
    rp = d.get("rope_parameters") or {}
    if d.get("rope_scaling") is None and rp.get("rope_type", "default") != "default":
        d["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return model, weights, DecoderConfig.from_hf(d, source=f"tiny {arch}")


def hf_cache_kwarg(model) -> str:
    """The name under which this transformers version's forward() takes the KV cache."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_prefill_then_decode(model, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    """HF logits: [T, V] for the prompt, then [1, V] per decode step, through one DynamicCache."""
    import torch
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    kw = hf_cache_kwarg(model)
    outs = []
    with torch.no_grad():
        for chunk in [prompt] + [[t] for t in steps]:
            out = model(torch.tensor([chunk]), use_cache=True, **{kw: cache})
            outs.append(out.logits[0].float().numpy())
    return outs


def ours_prefill_then_decode(cfg, weights, prompt: list[int], steps: list[int],
                             graph=None) -> list[np.ndarray]:
    """fuselm reference-executor logits, the same way: prompt first, then one token per step."""
    from fuselm.models import build_graph
    from fuselm.runtime.reference import new_state, run_graph

    graph = graph or build_graph(cfg)
    state = new_state(graph, len(prompt) + len(steps))
    outs, pos = [], 0
    for chunk in [prompt] + [[t] for t in steps]:
        feeds = {"ids": np.array(chunk, np.int32),
                 "pos": np.arange(pos, pos + len(chunk), dtype=np.int32)}
        outs.append(run_graph(graph, weights, feeds, state)["logits"])
        pos += len(chunk)
    return outs


@pytest.fixture(scope="session")
def h():
    """The helpers of this file, for tests (with or without @given)."""
    return SimpleNamespace(rel_err=rel_err, make_hf_model=make_hf_model, randomize_=randomize_,
                           hf_prefill_then_decode=hf_prefill_then_decode,
                           ours_prefill_then_decode=ours_prefill_then_decode)

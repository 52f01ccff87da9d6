"""RoPE at Llama 3.1's full context (131,072 positions) against Hugging Face transformers.

The GPU kernels rotate by the float32 product (float)pos * inv_freq[pair] (common.cuh rope_rotate,
inv_freq rounded once from float64); transformers takes a float32 product too, of inverse
frequencies it computes in float32; the reference executor (dsl/ops.py _rope) takes float64
angles. A float32 angle near 131k is off by up to ~p * inv_freq * 2^-24 (0.004 rad for the fastest
pair) plus p times the error of inv_freq: the checks below hold each side to that bound around the
exact rotation, on Llama-3.1-8B's own RoPE parameters.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fuselm.dsl.ops import _rope  # noqa: E402
from fuselm.models import DecoderConfig, rope_inv_freq  # noqa: E402

LLAMA_31 = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336, num_hidden_layers=1,
                vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
POSITIONS = np.array([0, 1, 8191, 8192, 65_535, 100_000, 117_003, 131_070, 131_071])
INV_RTOL = 5e-7     # transformers' float32 inverse frequencies against float64: a few float32 ulps


def transformers_rope(positions: np.ndarray):
    """transformers' inverse frequencies [64] (float32) and cos, sin [T, 128] at `positions`."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA_31.items() if k != "architectures"})
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    cos, sin = rotary(torch.zeros(1, len(positions), 128), torch.tensor(positions)[None])
    return rotary.inv_freq.numpy(), cos[0].numpy().astype(np.float64), sin[0].numpy().astype(np.float64)


def exact_angles() -> np.ndarray:
    """[T, 64] float64 angles of the float64 inverse frequencies."""
    return POSITIONS[:, None] * rope_inv_freq(DecoderConfig.from_hf(LLAMA_31))[None, :]


def test_inverse_frequencies_equal_transformers():
    ours = rope_inv_freq(DecoderConfig.from_hf(LLAMA_31))
    theirs, _, _ = transformers_rope(POSITIONS)
    np.testing.assert_allclose(theirs, ours, rtol=INV_RTOL)


def test_gpu_and_transformers_angles_within_float32_rounding_up_to_131k():
    """The kernels' formula (float32 product, then sin/cos) and transformers' cos/sin, each within
    its float32 angle bound of the exact rotation: the GPU's 2^-23 of the angle (the product's
    rounding and inv_freq's), transformers' INV_RTOL more, plus float32 sin/cos."""
    exact = exact_angles()
    inv32 = rope_inv_freq(DecoderConfig.from_hf(LLAMA_31)).astype(np.float32)
    gpu = (POSITIONS.astype(np.float32)[:, None] * inv32[None, :]).astype(np.float64)
    _, cos, sin = transformers_rope(POSITIONS)
    np.testing.assert_array_equal(cos[:, :64], cos[:, 64:])   # HF layout: pair i with i + 64
    for (c, s), bound in [((np.cos(gpu), np.sin(gpu)), exact * 2.0 ** -23 + 1e-7),
                          ((cos[:, :64], sin[:, :64]), exact * (2.0 ** -23 + INV_RTOL) + 1e-6)]:
        miss = np.hypot(c - np.cos(exact), s - np.sin(exact))    # chord of the angle's error
        assert (miss <= bound).all(), float((miss / bound).max())
    assert np.abs(gpu - exact)[POSITIONS >= 100_000].max() > 1e-4   # the rounding shows: positions reached


def test_the_reference_rotation_matches_transformers_within_its_bound():
    """The reference executor's rotation of random heads against transformers' apply_rotary_pos_emb,
    pair by pair within transformers' angle bound above."""
    cfg = DecoderConfig.from_hf(LLAMA_31)
    _, cos, sin = transformers_rope(POSITIONS)
    x = np.random.default_rng(0).standard_normal((len(POSITIONS), 2 * 128)).astype(np.float32)   # two heads
    ours = _rope(x, POSITIONS.astype(np.int32), rope_inv_freq(cfg), 128).reshape(-1, 2, 128)
    q = torch.tensor(x.reshape(-1, 2, 128), dtype=torch.float64)
    theirs = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(
        q[None].transpose(1, 2), q[None].transpose(1, 2), torch.tensor(cos)[None], torch.tensor(sin)[None])[0]
    theirs = theirs.transpose(1, 2)[0].numpy()
    xh = x.reshape(-1, 2, 128)
    pair_norm = np.hypot(xh[..., :64], xh[..., 64:])
    bound = pair_norm * (exact_angles()[:, None, :] * (2.0 ** -23 + INV_RTOL) + 2e-6)
    diff = np.hypot(ours[..., :64] - theirs[..., :64], ours[..., 64:] - theirs[..., 64:])
    assert (diff <= bound).all(), float((diff / bound).max())

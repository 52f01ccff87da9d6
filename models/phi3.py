"""Phi-3 / Phi-4-mini: Llama's layer with fused weights, partial rotary and LongRoPE.

The checkpoint fuses Q, K, V (`qkv_proj`) and gate, up (`gate_up_proj`); the graph reads them as
separate weights, rows of the fused ones (`checkpoint_rows`, applied at load). Partial rotary
(`partial_rotary_factor`, Phi-4-mini 0.75) rotates the first r dims of a head in pairs (i, i + r/2);
the Q and K rows of every head are reordered alike (q.k unchanged) so that those pairs become
(i, i + head_dim/2) and the plain RoPE op serves, the unrotated pairs with inv_freq 0. LongRoPE
divides the frequencies by `short_factor`, or by `long_factor` when the engine's context exceeds
`original_max_position_embeddings` (as transformers does for a sequence that long; fuselm.load
passes the KV cache's, so a context within the original one keeps the short factors, exact there). Its attention factor
f scales the rotated dims of Q and K: f^2 on Q's alone gives the same scores (a constant multiply).
"""
import numpy as np

from ..dsl import Graph
from .config import DecoderConfig, rope_attention_factor, rope_inv_freq, rotary_dims
from .layers import glu_mlp, layer_windows, lm_head, rmsnorm, self_attention, step_inputs


def head_order(cfg: DecoderConfig) -> np.ndarray:
    """Row j of a reordered Q/K head is row head_order[j] of the checkpoint's."""
    hd, half = cfg.head_dim, rotary_dims(cfg) // 2
    rest = np.arange(2 * half, hd).reshape(2, -1)          # unrotated dims, as pairs (a, b)
    return np.concatenate([np.arange(half), rest[0], half + np.arange(half), rest[1]])


def checkpoint_rows(cfg: DecoderConfig) -> dict[str, tuple[str, np.ndarray]]:
    """Graph weight -> (fused checkpoint tensor, its rows) for every projection Phi-3 fuses."""
    hd, H, KV, I = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    heads = lambda n, start: (start + np.arange(n)[:, None] * hd + head_order(cfg)).ravel()   # noqa: E731
    parts = {"self_attn.q_proj": ("self_attn.qkv_proj", heads(H, 0)),
             "self_attn.k_proj": ("self_attn.qkv_proj", heads(KV, H * hd)),
             "self_attn.v_proj": ("self_attn.qkv_proj", (H + KV) * hd + np.arange(KV * hd)),
             "mlp.gate_proj": ("mlp.gate_up_proj", np.arange(I)), "mlp.up_proj": ("mlp.gate_up_proj", I + np.arange(I))}
    return {f"model.layers.{i}.{ours}.weight": (f"model.layers.{i}.{fused}.weight", rows)
            for i in range(cfg.num_layers) for ours, (fused, rows) in parts.items()}


def build(cfg: DecoderConfig, context: int | None = None) -> Graph:
    """One step of a Phi-3 decoder (context: the engine's, for LongRoPE's choice of factors)."""
    g = Graph(cfg.architecture)
    ids, pos, _ = step_inputs(g, cfg, inv_freq=False)
    half, pairs = rotary_dims(cfg) // 2, cfg.head_dim // 2
    inv_freq = g.constant("rope.inv_freq", np.pad(rope_inv_freq(cfg, context), (0, pairs - half)))
    f2, eps, windows = rope_attention_factor(cfg) ** 2, cfg.rms_norm_eps, layer_windows(cfg)
    rotated = np.tile(np.arange(pairs) < half, 2)                    # [head_dim], reordered
    q_scale = g.constant("rope.q_scale", np.tile(np.where(rotated, f2, 1.0), cfg.num_heads)) if f2 != 1 else None
    x = g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)), ids)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, window=windows[i], q_scale=q_scale)
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        x = x + glu_mlp(g, cfg, i, h)
    g.output(logits=lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps)))
    return g

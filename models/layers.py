"""Building blocks shared by the decoder architectures: each one a few DSL calls."""
from __future__ import annotations

from ..dsl import Graph, Value
from .config import DecoderConfig, rope_inv_freq


def linear(g: Graph, x: Value, prefix: str, n: int, bias: bool = False) -> Value:
    """y = x @ W.T (+ b), with W = `{prefix}.weight` of shape [n, width of x]."""
    y = g.op("linear", x, g.weight(f"{prefix}.weight", (n, x.shape[-1])))
    return y + g.weight(f"{prefix}.bias", (n,)) if bias else y


def rmsnorm(g: Graph, x: Value, weight: str, eps: float, **attrs) -> Value:
    return g.op("rmsnorm", x, g.weight(weight, (attrs.get("group") or x.shape[-1],)), eps=eps, **attrs)


def step_inputs(g: Graph, cfg: DecoderConfig) -> tuple[Value, Value, Value]:
    """Token ids [T], their positions [T], and the RoPE inverse frequencies [head_dim/2]."""
    ids = g.input("ids", ("T",), "i32")
    pos = g.input("pos", ("T",), "i32")
    return ids, pos, g.constant("rope.inv_freq", rope_inv_freq(cfg))


def cached_attention(g: Graph, cfg: DecoderConfig, layer: int, q: Value, k: Value, v: Value,
                     pos: Value, window: int = 0, **attrs) -> Value:
    """Write this step's K and V rows into the layer's cache, then attend over the cache."""
    kv_width = cfg.num_kv_heads * cfg.head_dim
    k_cache = g.op("kv_write", g.state(f"cache.{layer}.k", ("S", kv_width)), k, pos)
    v_cache = g.op("kv_write", g.state(f"cache.{layer}.v", ("S", kv_width)), v, pos)
    return g.op("attention", q, k_cache, v_cache, pos, n_heads=cfg.num_heads,
                n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                scale=cfg.head_dim ** -0.5, window=window or 0, **attrs)


def lm_head(g: Graph, cfg: DecoderConfig, x: Value) -> Value:
    name = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    return linear(g, x, name, cfg.vocab_size)

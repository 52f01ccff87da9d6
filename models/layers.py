"""Building blocks shared by the decoder architectures: each one a few DSL calls."""
from __future__ import annotations

import numpy as np

from ..dsl import Graph, Value
from .config import ConfigError, DecoderConfig, rope_inv_freq


def linear(g: Graph, x: Value, prefix: str, n: int, bias: bool = False) -> Value:
    """y = x @ W.T (+ b), with W = `{prefix}.weight` of shape [n, width of x]."""
    y = g.op("linear", x, g.weight(f"{prefix}.weight", (n, x.shape[-1])))
    return y + g.weight(f"{prefix}.bias", (n,)) if bias else y


def rmsnorm(g: Graph, x: Value, weight: str, eps: float, **attrs) -> Value:
    """RMSNorm of x with the checkpoint weight `weight` (per group when attrs has group=...)."""
    return g.op("rmsnorm", x, g.weight(weight, (attrs.get("group") or x.shape[-1],)), eps=eps, **attrs)


def embed(g: Graph, cfg: DecoderConfig, ids: Value) -> Value:
    """The token embeddings [T, hidden] of ids [T] (`model.embed_tokens.weight`)."""
    return g.op("embedding", g.weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)), ids)


def step_inputs(g: Graph, cfg: DecoderConfig, inv_freq: bool = True) -> tuple[Value, Value, Value | None]:
    """Token ids [T], their positions [T], and the RoPE inverse frequencies [head_dim/2] (None
    with `inv_freq=False`: for a model that lays out its own)."""
    ids = g.input("ids", ("T",), "i32")
    pos = g.input("pos", ("T",), "i32")
    return ids, pos, g.constant("rope.inv_freq", rope_inv_freq(cfg)) if inv_freq else None


def cached_attention(g: Graph, cfg: DecoderConfig, layer: int, q: Value, k: Value, v: Value,
                     pos: Value, window: int = 0, scale: float | None = None, sinks: Value | None = None,
                     **attrs) -> Value:
    """Write this step's K and V rows into the layer's cache, then attend over the cache (with a
    learned logit per head in each softmax where `sinks` [H] is given: gpt-oss)."""
    kv_width = cfg.num_kv_heads * cfg.head_dim
    k_cache = g.op("kv_write", g.state(f"cache.{layer}.k", ("S", kv_width)), k, pos)
    v_cache = g.op("kv_write", g.state(f"cache.{layer}.v", ("S", kv_width)), v, pos)
    return g.op("attention", q, k_cache, v_cache, pos, *([sinks] if sinks else []), n_heads=cfg.num_heads,
                n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                scale=cfg.head_dim ** -0.5 if scale is None else scale, window=window or 0, **attrs)


def self_attention(g: Graph, cfg: DecoderConfig, layer: int, h: Value, pos: Value, inv_freq: Value,
                   qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                   window: int = 0, qk_norm_per_head: bool = True, rope: bool = True,
                   qk_norm_offset: float = 0.0, q_scale: Value | None = None, sinks: bool = False,
                   **attention_attrs) -> Value:
    """The attention block of layer `layer` on the input h: Q, K, V projections, (when
    `qk_norm_eps` is given, an RMSNorm of Q and K: over each head (Qwen3; Gemma 3 with
    `qk_norm_offset=1`, its (1 + w) norm), or over the whole projection with
    `qk_norm_per_head=False` (OLMo 2)), RoPE (unless `rope` is False: SmolLM3's NoPE layers),
    Q times `q_scale` [H * hd] where given (Phi-3's LongRoPE factor), attention over the cache
    (with `sinks`, the learned logits `{prefix}.sinks` [H] in its softmax: gpt-oss), O projection.
    The residual add and any norms around it stay with the caller."""
    p, hd = f"model.layers.{layer}.self_attn", cfg.head_dim
    q = linear(g, h, f"{p}.q_proj", cfg.num_heads * hd, qkv_bias)      # [T, H * hd]
    k = linear(g, h, f"{p}.k_proj", cfg.num_kv_heads * hd, qkv_bias)   # [T, KV * hd]
    v = linear(g, h, f"{p}.v_proj", cfg.num_kv_heads * hd, qkv_bias)   # [T, KV * hd]
    if qk_norm_eps is not None:
        group = hd if qk_norm_per_head else None
        q = rmsnorm(g, q, f"{p}.q_norm.weight", qk_norm_eps, group=group, offset=qk_norm_offset)
        k = rmsnorm(g, k, f"{p}.k_norm.weight", qk_norm_eps, group=group, offset=qk_norm_offset)
    if rope:
        q = g.op("rope", q, pos, inv_freq, head_dim=hd)
        k = g.op("rope", k, pos, inv_freq, head_dim=hd)
    if q_scale is not None:
        q = q * q_scale
    sink = g.weight(f"{p}.sinks", (cfg.num_heads,)) if sinks else None
    a = cached_attention(g, cfg, layer, q, k, v, pos, window=window, sinks=sink, **attention_attrs)
    return linear(g, a, f"{p}.o_proj", cfg.hidden_size, o_bias)


def glu_mlp(g: Graph, cfg: DecoderConfig, layer: int, h: Value, act: str | None = None, bias: bool = False) -> Value:
    """down(act(gate(h)) * up(h)) of layer `layer`: `act` a DSL op, by default the config's
    `hidden_act` (SwiGLU for "silu", the default; an activation fuselm lacks is a ConfigError)."""
    act = act or activation(cfg.extra.get("hidden_act") or "silu")
    p, inter = f"model.layers.{layer}.mlp", cfg.intermediate_size
    gate = linear(g, h, f"{p}.gate_proj", inter, bias)
    up = linear(g, h, f"{p}.up_proj", inter, bias)
    return linear(g, g.op(act, gate) * up, f"{p}.down_proj", cfg.hidden_size, bias)


def sparse_moe(g: Graph, cfg: DecoderConfig, h: Value, prefix: str, experts: int, top_k: int, inter: int,
               names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), **attrs) -> Value:
    """The routed expert FFN at `prefix` on h: the router `{prefix}.gate` (a linear to `experts`
    logits), then `moe_ffn` over each expert's gate, up and down projections (`names`), read as
    stacks `{prefix}.experts.*.{name}.weight` ("*" = 0 .. experts-1, stacked at load) of width `inter`."""
    if not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok {top_k} with {experts} experts")
    D, act = cfg.hidden_size, activation(cfg.extra.get("hidden_act") or "silu")
    logits = linear(g, h, f"{prefix}.gate", experts)
    stacks = (g.weight(f"{prefix}.experts.*.{n}.weight", s)
              for n, s in zip(names, [(experts, inter, D), (experts, inter, D), (experts, D, inter)]))
    return g.op("moe_ffn", h, logits, *stacks, top_k=top_k, act=act, **attrs)


def lm_head(g: Graph, cfg: DecoderConfig, x: Value, tied: bool | None = None) -> Value:
    """Logits; `tied` overrides cfg.tie_word_embeddings (for architectures whose default is True)."""
    name = "model.embed_tokens" if (cfg.tie_word_embeddings if tied is None else tied) else "lm_head"
    return linear(g, x, name, cfg.vocab_size)


def gemma_decoder(g: Graph, cfg: DecoderConfig, ids: Value, attend) -> Value:
    """The logits of Gemma's decoder (2 and 3) over the token ids: the embedding scaled by
    sqrt(hidden), then per layer x += post_norm(attend(i, input_norm(x))) and
    x += post_ff_norm(mlp(pre_ff_norm(x))), all norms (1 + w); a GELU-tanh GLU; the final norm,
    the LM head (tied unless the config says otherwise) and the final soft-cap where set.
    `attend(i, h)` is layer i's attention block, which is where the versions differ."""
    eps, ex = cfg.rms_norm_eps, cfg.extra
    act = activation(ex.get("hidden_activation") or ex.get("hidden_act") or "gelu_pytorch_tanh")

    def norm(x, name):
        return rmsnorm(g, x, name, eps, offset=1.0)

    x = g.op("scale", embed(g, cfg, ids), factor=embed_scale(cfg))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        x = x + norm(attend(i, norm(x, f"{p}.input_layernorm.weight")), f"{p}.post_attention_layernorm.weight")
        h = norm(x, f"{p}.pre_feedforward_layernorm.weight")
        x = x + norm(glu_mlp(g, cfg, i, h, act), f"{p}.post_feedforward_layernorm.weight")
    logits = lm_head(g, cfg, norm(x, "model.norm.weight"), tied=ex.get("tie_word_embeddings", True))
    if ex.get("final_logit_softcapping"):
        logits = g.op("softcap", logits, cap=float(ex["final_logit_softcapping"]))
    return logits



def layer_windows(cfg: DecoderConfig, slides=None) -> list[int]:
    """The attention window of every layer (0: full attention).

    A config that lists `layer_types` (transformers >= 4.53 writes them) decides per layer:
    "sliding_attention" layers use `cfg.sliding_window`. Without the list, `slides(i)` is the
    architecture's own rule (Gemma 2: even layers); the default is Qwen2's, which covers Mistral:
    layers i >= `max_window_layers` slide (0 when absent: every layer). No `sliding_window`
    (or `use_sliding_window: false`, see DecoderConfig.from_hf): every layer attends in full.
    """
    w = int(cfg.sliding_window or 0)
    types = cfg.extra.get("layer_types")
    if types:
        if len(types) < cfg.num_layers:
            raise ConfigError(f"layer_types lists {len(types)} layers, the model has {cfg.num_layers}")
        return [w if t == "sliding_attention" else 0 for t in types[:cfg.num_layers]]
    if slides is None:
        first = int(cfg.extra.get("max_window_layers") or 0)
        slides = lambda i: i >= first   # noqa: E731
    return [w if slides(i) else 0 for i in range(cfg.num_layers)]


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation(name: str) -> str:
    """The DSL op of a Hugging Face activation name (hidden_act / hidden_activation)."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation '{name}' is not supported (supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


def embed_scale(cfg: DecoderConfig) -> float:
    """Gemma's embedding multiplier sqrt(hidden), rounded as transformers rounds it.

    transformers multiplies by the normalizer cast to the activation dtype, so a bf16 (fp16)
    checkpoint run in its own dtype scales by bf16(sqrt(D)) (59.75, not 59.87, for D = 3584).
    The config's `torch_dtype` / `dtype` names that dtype; float32 keeps the exact root.
    """
    s = np.float32(cfg.hidden_size ** 0.5)
    dtype = str(cfg.extra.get("dtype") or cfg.extra.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype == "bfloat16":      # round to nearest even on the top 16 bits
        b = int(s.view(np.uint32))
        s = np.uint32((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32)
    elif dtype == "float16":
        s = np.float32(np.float16(s))
    return float(s)

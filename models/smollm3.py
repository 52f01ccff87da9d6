"""SmolLM3: Llama's layer, with some layers attending without rotary embedding (NoPE).

`no_rope_layers` lists a flag per layer (1: RoPE, 0: NoPE); without it every
`no_rope_layer_interval`-th layer (default 4: layers 3, 7, 11, ...) is NoPE, as transformers
derives the list. Sliding attention only with `use_sliding_window` (off by default): on the layers
`layer_types` names, else on the NoPE layers. The LM head is the embedding unless
`tie_word_embeddings` is false.
"""
from ..dsl import Graph
from .config import ConfigError, DecoderConfig
from .layers import embed, glu_mlp, layer_windows, lm_head, rmsnorm, self_attention, step_inputs


def rope_layers(cfg: DecoderConfig) -> list[bool]:
    """Whether each layer applies RoPE, from `no_rope_layers` or `no_rope_layer_interval`."""
    flags = cfg.extra.get("no_rope_layers")
    if flags is None:
        every = int(cfg.extra.get("no_rope_layer_interval") or 4)
        return [(i + 1) % every != 0 for i in range(cfg.num_layers)]
    if len(flags) < cfg.num_layers:
        raise ConfigError(f"no_rope_layers lists {len(flags)} layers, the model has {cfg.num_layers}")
    return [bool(f) for f in flags[:cfg.num_layers]]


def build(cfg: DecoderConfig) -> Graph:
    """One step of a SmolLM3 decoder."""
    g = Graph(cfg.architecture)
    ids, pos, inv_freq = step_inputs(g, cfg)
    eps, bias, ex = cfg.rms_norm_eps, cfg.attention_bias, cfg.extra
    rope, slide = rope_layers(cfg), bool(ex.get("use_sliding_window"))
    windows = layer_windows(cfg, slides=lambda i: not rope[i]) if slide else [0] * cfg.num_layers
    x = embed(g, cfg, ids)                                                     # [T, D]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        h = rmsnorm(g, x, f"{p}.input_layernorm.weight", eps)
        x = x + self_attention(g, cfg, i, h, pos, inv_freq, bias, bias, window=windows[i], rope=rope[i])
        h = rmsnorm(g, x, f"{p}.post_attention_layernorm.weight", eps)
        x = x + glu_mlp(g, cfg, i, h, bias=bool(ex.get("mlp_bias")))
    logits = lm_head(g, cfg, rmsnorm(g, x, "model.norm.weight", eps), tied=ex.get("tie_word_embeddings", True))
    g.output(logits=logits)
    return g

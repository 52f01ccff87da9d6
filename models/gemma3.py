"""Gemma 3 (text): Gemma 2's decoder with per-head (1 + w) Q/K norms and two RoPE tables.

Sliding and full layers come from `layer_types`, else from `sliding_window_pattern` (default 6:
every 6th layer is full). Full layers rotate with `rope_theta` and the config's RoPE scaling
(linear x8 on the 4B-27B), sliding ones with `rope_local_base_freq` unscaled (transformers 5
nests both under `rope_parameters`, by layer type). Scores are scaled by
query_pre_attn_scalar^-0.5 and not soft-capped (transformers ignores attn_logit_softcapping here);
final_logit_softcapping applies where set. The LM head is the embedding unless untied.

Gemma3ForConditionalGeneration (the multimodal 4B-27B) is read as this text model: its config.json
nests the language model's settings under `text_config` (which omits what Gemma3TextConfig
defaults: `text_config`), its tensors are `language_model.model.*` (newer transformers:
`model.language_model.*`) beside the vision tower's, which are left out (`text_tensor`).
"""
from ..dsl import Graph
from .config import ConfigError, DecoderConfig, rope_inv_freq_of
from .layers import gemma_decoder, layer_windows, self_attention, step_inputs


# Gemma3TextConfig's defaults (transformers), which a multimodal config.json's text_config omits
# (the 4B's gives only hidden_size, intermediate_size, num_hidden_layers, rope_scaling, sliding_window)
TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                     max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                     sliding_window=4096)   # and build's sliding_window_pattern of 6
ROPE_DEFAULTS = {"full_attention": ("rope_theta", 1000000.0), "sliding_attention": ("rope_local_base_freq", 10000.0)}


def text_config(raw: dict) -> dict:
    """The Gemma3ForCausalLM config of a Gemma3ForConditionalGeneration config.json: its
    text_config over Gemma3TextConfig's defaults (RoPE bases included, in whichever form the
    text_config has them), tie_word_embeddings and the dtype from the top level where text_config
    lacks them, and the top level's special token ids."""
    text = raw.get("text_config") or {}
    if not isinstance(text, dict):
        raise ConfigError(f"text_config = {text!r} is not an object")
    out = {**TEXT_DEFAULTS, **text, "architectures": ["Gemma3ForCausalLM"]}
    rope = text.get("rope_parameters")
    if isinstance(rope, dict):              # transformers 5: the bases by layer type
        out["rope_parameters"] = {**rope, **{kind: {"rope_theta": base, **(rope.get(kind) or {})}
                                             for kind, (_, base) in ROPE_DEFAULTS.items()}}
    else:                                   # the Hub's: rope_theta, rope_local_base_freq
        out.update({key: text.get(key, base) for key, base in ROPE_DEFAULTS.values()})
    for key, default in (("tie_word_embeddings", True), ("dtype", None), ("torch_dtype", None)):
        if key not in text:
            out[key] = raw.get(key, default)
    out.update({k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None})
    return out


def text_tensor(name: str) -> str | None:
    """The Gemma3ForCausalLM name of a Gemma3ForConditionalGeneration tensor; None for the vision
    tower's and the projector's."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return "lm_head.weight" if name in ("lm_head.weight", "language_model.lm_head.weight") else None


def local_rope(cfg: DecoderConfig) -> dict:
    """The RoPE parameters of the sliding layers, from either form of the config."""
    nested = cfg.extra.get("rope_parameters")
    if isinstance(nested, dict) and nested.get("sliding_attention") is not None:
        return nested["sliding_attention"]
    return {"rope_theta": cfg.extra.get("rope_local_base_freq") or 10000.0}


def build(cfg: DecoderConfig) -> Graph:
    """One step of a Gemma 3 text decoder."""
    g = Graph(cfg.architecture)
    ids, pos, full_freq = step_inputs(g, cfg)                 # the full layers' RoPE (scaled)
    local_freq = g.constant("rope.local_inv_freq", rope_inv_freq_of(cfg, local_rope(cfg)))
    bias, eps, ex = cfg.attention_bias, cfg.rms_norm_eps, cfg.extra
    scale = float(ex.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
    every = int(ex.get("sliding_window_pattern") or ex.get("_sliding_window_pattern") or 6)
    windows = layer_windows(cfg, slides=lambda i: (i + 1) % every != 0)

    def attend(i, h):
        return self_attention(g, cfg, i, h, pos, local_freq if windows[i] else full_freq, bias, bias,
                              qk_norm_eps=eps, qk_norm_offset=1.0, window=windows[i], scale=scale)

    g.output(logits=gemma_decoder(g, cfg, ids, attend))
    return g

"""The decoder configuration every architecture is built from, parsed from a Hugging Face config.json."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from ..errors import FuselmError


class ConfigError(FuselmError, ValueError):
    """A config.json that fuselm cannot build a model from."""


@dataclass(frozen=True)
class DecoderConfig:
    """The sizes and switches every decoder architecture is built from."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    attention_bias: bool = False
    extra: dict = field(default_factory=dict, compare=False)  # architecture-specific keys
    source: str = field(default="", compare=False)            # the file it was read from, for errors

    @classmethod
    def from_hf(cls, d: dict, source: str = "config.json") -> "DecoderConfig":
        """Read the keys fuselm needs; a missing one, or one of the wrong type or range, is named
        in the error."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: not a JSON object")

        number = partial(_number, d, source)

        archs = d.get("architectures") or [d.get("model_type", "?")]
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ConfigError(f"{source}: architectures = {archs!r} is not a list of class names")
        _check_extra(d, source)
        heads, hidden = number("num_attention_heads", required=True), number("hidden_size", required=True)
        rope_parameters = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        if isinstance(rope_parameters.get("full_attention"), dict):   # transformers 5, per layer type:
            rope_parameters = rope_parameters["full_attention"]        # the full layers' are the model's
        window = d.get("use_sliding_window", True) and number("sliding_window", default=0, low=0)
        cfg = cls(
            architecture=archs[0],
            vocab_size=number("vocab_size", required=True),
            hidden_size=hidden,
            intermediate_size=number("intermediate_size", required=True),
            num_layers=number("num_hidden_layers", required=True),
            num_heads=heads,
            num_kv_heads=number("num_key_value_heads", default=0, low=0) or heads,   # 0 or null: as many as heads
            head_dim=number("head_dim", default=0, low=0) or hidden // heads,
            rms_norm_eps=number("rms_norm_eps", float, 1e-6),
            rope_theta=number("rope_theta", float, _number(rope_parameters, source, "rope_theta", float, 10000.0)),
            rope_scaling=d.get("rope_scaling") or _scaling_in(rope_parameters),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=number("max_position_embeddings", default=4096),
            sliding_window=window or None,
            attention_bias=bool(d.get("attention_bias", False)),
            extra=d,
            source=source,
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {cfg.num_kv_heads}")
        if not number("head_dim", default=0, low=0) and hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                              f"{heads} (and there is no head_dim)")
        check_ranges(cfg)
        return cfg


# Bounds on what a model file may claim, far beyond any released model: a corrupt or hostile value
# fails here, naming the key, instead of building a graph of a billion layers or dividing by 3e33.
SIZE_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
               "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
               "head_dim": 2048, "max_position_embeddings": 1 << 26}
FLOAT_RANGES = {"rms_norm_eps": (0.0, 0.1), "rope_theta": (1.0, 1e12)}   # open below, closed above


def check_ranges(cfg: DecoderConfig) -> None:
    """Refuse hyperparameters no model has: sizes past SIZE_LIMITS, a norm eps or RoPE base outside
    FLOAT_RANGES (or not finite), an odd head_dim (RoPE rotates pairs) and RoPE scaling whose
    parameters are not finite and positive. The error names `cfg.source` and the key."""
    src = cfg.source
    sizes = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
             "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings}
    for key, value in sizes.items():
        if not 1 <= value <= SIZE_LIMITS[key]:
            raise ConfigError(f"{src}: {key} = {value} is out of range (1 to {SIZE_LIMITS[key]})")
    for key, (low, high) in FLOAT_RANGES.items():
        value = getattr(cfg, key)
        if not (math.isfinite(value) and low < value <= high):
            raise ConfigError(f"{src}: {key} = {value!r} is out of range ({low:g} < {key} <= {high:g})")
    if cfg.head_dim % 2:
        raise ConfigError(f"{src}: head_dim = {cfg.head_dim} is odd (RoPE rotates pairs of dimensions)")
    try:
        rope_inv_freq(cfg)
    except ConfigError as e:
        raise ConfigError(f"{src}: {e}") from None


# Keys the architecture builders read from the raw config (cfg.extra), and what each must be.
EXTRA_NAMES = ("hidden_act", "hidden_activation", "dtype", "torch_dtype")
EXTRA_COUNTS = {"max_window_layers": 1 << 20, "num_local_experts": 1024, "num_experts": 1024,
                "num_experts_per_tok": 1024, "moe_intermediate_size": 1 << 20, "decoder_sparse_step": 1024}
EXTRA_FLOATS = {"query_pre_attn_scalar": (0.0, 1e6), "attn_logit_softcapping": (-1e-300, 1e6),
                "final_logit_softcapping": (-1e-300, 1e6)}   # open below, closed above


def _check_extra(d: dict, source: str) -> None:
    """The architecture-specific keys, where present: names are strings, layer_types a list of
    strings, no_rope_layers a list of 0/1 flags and no_rope_layer_interval a positive integer,
    counts integers in range, scales and soft-caps finite numbers in range."""
    for key in EXTRA_NAMES:
        if d.get(key) is not None and not isinstance(d[key], str):
            raise ConfigError(f"{source}: {key} = {d[key]!r} is not a name")
    types = d.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ConfigError(f"{source}: layer_types = {types!r} is not a list of names")
    flags = d.get("no_rope_layers")
    if flags is not None and not (isinstance(flags, list) and all(type(f) is int and f in (0, 1) for f in flags)):
        raise ConfigError(f"{source}: no_rope_layers = {flags!r} is not a list of 0/1 flags")
    _number(d, source, "no_rope_layer_interval")   # a positive integer where given (any size: modulo)
    for key, high in EXTRA_COUNTS.items():
        value = _number(d, source, key, default=None, low=0)
        if value is not None and value > high:
            raise ConfigError(f"{source}: {key} = {value} is out of range (0 to {high})")
    for key, (low, high) in EXTRA_FLOATS.items():
        value = _number(d, source, key, float, default=None)
        if value is not None and not (math.isfinite(value) and low < value <= high):
            raise ConfigError(f"{source}: {key} = {value!r} is out of range ({max(low, 0):g} to {high:g})")


def _number(d: dict, source: str, key: str, kind=int, default=None, required: bool = False, low: int = 1):
    """d[key] as `kind`, `default` where absent or null; an int must be a whole number of at least
    `low` (0 or 1). Anything else is a ConfigError naming the key and `source`, the file."""
    raw = d.get(key)
    if raw is None:
        if required:
            raise ConfigError(f"{source}: missing required key '{key}'")
        return default
    what = "an integer" if kind is int else "a number"
    try:
        value = kind(raw)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{source}: {key} = {raw!r} is not {what}") from None
    if isinstance(raw, (bool, np.bool_)) or isinstance(raw, numbers.Real) and value != raw:
        raise ConfigError(f"{source}: {key} = {raw!r} is not {what}")
    if kind is int and value < low:
        raise ConfigError(f"{source}: {key} = {raw!r} must be a {'positive' if low == 1 else 'non-negative'} integer")
    return value


def _scaling_in(params: dict | None) -> dict | None:
    """transformers 5 writes RoPE scaling under `rope_parameters` instead of `rope_scaling`."""
    if params and params.get("rope_type", "default") != "default":
        return params
    return None


def rope_inv_freq_of(cfg: DecoderConfig, params: dict) -> np.ndarray:
    """RoPE inverse frequencies [head_dim/2] for one set of RoPE parameters (`rope_theta`, default
    cfg's, and a `rope_type` with its keys), such as transformers 5 nests per layer type under
    `rope_parameters`; a bad base or scaling is a ConfigError naming cfg.source."""
    if not isinstance(params, dict):
        raise ConfigError(f"{cfg.source}: RoPE parameters {params!r} are not an object")
    theta = _number(params, cfg.source, "rope_theta", float, cfg.rope_theta)
    low, high = FLOAT_RANGES["rope_theta"]
    if not (math.isfinite(theta) and low < theta <= high):
        raise ConfigError(f"{cfg.source}: rope_theta = {theta!r} is out of range ({low:g} < rope_theta <= {high:g})")
    kind = params.get("rope_type", params.get("type", "default"))
    try:
        return rope_inv_freq(replace(cfg, rope_theta=theta, rope_scaling=None if kind == "default" else params))
    except ConfigError as e:
        raise ConfigError(f"{cfg.source}: {e}") from None


def rotary_dims(cfg: DecoderConfig) -> int:
    """How many dimensions of each head RoPE rotates: head_dim x `partial_rotary_factor` (top level,
    or under transformers 5's rope_parameters; Phi-4-mini: 0.75), the first ones of the head."""
    nested = cfg.extra.get("rope_parameters") if isinstance(cfg.extra.get("rope_parameters"), dict) else {}
    raw = cfg.extra.get("partial_rotary_factor", nested.get("partial_rotary_factor", 1.0))
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real) or not 0 < raw <= 1:
        raise ConfigError(f"partial_rotary_factor = {raw!r} is not a number in (0, 1]")
    dims = int(cfg.head_dim * raw)
    if dims < 2 or dims % 2:
        raise ConfigError(f"partial_rotary_factor {raw!r} rotates {dims} of {cfg.head_dim} dimensions (not a "
                          "positive even number)")
    return dims


def rope_original_context(cfg: DecoderConfig) -> int:
    """The context the model was pretrained at, before RoPE scaling stretched it (LongRoPE's switch)."""
    sc = cfg.rope_scaling or {}
    return int(sc.get("original_max_position_embeddings") or cfg.extra.get("original_max_position_embeddings")
               or cfg.max_position_embeddings)


def rope_attention_factor(cfg: DecoderConfig) -> float:
    """LongRoPE's and YaRN's factor on the rotated dimensions of Q and K (1 for other RoPE types):
    the config's `attention_factor`, else for YaRN 0.1 ln(factor) + 1 (its `mscale`s' ratio where
    both are given), for LongRoPE sqrt(1 + ln(s) / ln(original context)) with s = `factor`, else
    max_position_embeddings / original context, as transformers computes them."""
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind not in ("longrope", "yarn"):
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    if kind == "yarn":
        factor = float(sc.get("factor") or cfg.max_position_embeddings / rope_original_context(cfg))
        mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1   # noqa: E731
        both = sc.get("mscale") and sc.get("mscale_all_dim")
        return mscale(float(sc["mscale"])) / mscale(float(sc["mscale_all_dim"])) if both else mscale(1.0)
    original = rope_original_context(cfg)
    s = float(sc.get("factor") or cfg.max_position_embeddings / original)
    return 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(original))


def rope_inv_freq(cfg: DecoderConfig, context: int | None = None) -> np.ndarray:
    """Inverse frequencies [rotary_dims/2] of RoPE (head_dim/2 unless partial rotary), with Llama-3.1
    ("llama3"), linear or LongRoPE scaling. LongRoPE divides by its `long_factor` when `context`
    (the positions an engine is built for) exceeds the original context, else by `short_factor`,
    as transformers does for a sequence of that length."""
    rot = rotary_dims(cfg)
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    sc = cfg.rope_scaling or {}
    if not isinstance(sc, dict):
        raise ConfigError(f"rope_scaling {sc!r} is not an object")
    kind = sc.get("rope_type", sc.get("type"))

    def param(name):
        try:
            value = float(sc[name])
        except KeyError:
            raise ConfigError(f"rope_scaling of type '{kind}' needs '{name}'") from None
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"rope_scaling {name} = {sc[name]!r} is not a number") from None
        if isinstance(sc[name], bool) or not (math.isfinite(value) and 0 < value <= 1e8):
            raise ConfigError(f"rope_scaling {name} = {sc[name]!r} is out of range (0 < {name} <= 1e8)")
        return value

    if kind == "linear":
        inv = inv / param("factor")
    elif kind == "llama3":
        factor, lo, hi = param("factor"), param("low_freq_factor"), param("high_freq_factor")
        old = param("original_max_position_embeddings")
        if lo >= hi:
            raise ConfigError(f"rope_scaling low_freq_factor {lo:g} is not below high_freq_factor {hi:g}")
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "longrope":
        key = "long_factor" if context and context > rope_original_context(cfg) else "short_factor"
        factors = sc.get(key)
        if (not isinstance(factors, list) or len(factors) != len(inv)
                or not all(isinstance(f, numbers.Real) and not isinstance(f, bool) and 0 < f < 1e8 for f in factors)):
            raise ConfigError(f"rope_scaling {key} = {factors!r} is not {len(inv)} positive numbers")
        inv = inv / np.asarray(factors, np.float64)
    elif kind == "yarn":
        inv = _yarn(inv, rot, cfg.rope_theta, param("factor"), rope_original_context(cfg),
                    float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1), sc.get("truncate", True))
    elif kind not in (None, "default"):
        raise ConfigError(f"rope_scaling type '{kind}' is not supported (supported: linear, llama3, longrope, yarn)")
    return inv.astype(np.float32)


def _yarn(inv: np.ndarray, dims: int, theta: float, factor: float, original: float, beta_fast: float,
          beta_slow: float, truncate: bool) -> np.ndarray:
    """YaRN's frequencies (gpt-oss): the original ones for the dimensions that turn more than
    `beta_fast` times over the original context, divided by `factor` for those turning fewer
    than `beta_slow` times, a linear ramp between, as transformers computes them."""
    def dim_of(turns):   # the dimension that turns `turns` times over the original context
        return dims * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / ((high - low) or 0.001), 0, 1)   # 1: interpolated
    return inv / factor * ramp + inv * (1 - ramp)

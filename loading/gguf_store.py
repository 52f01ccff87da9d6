"""Tensors of a llama.cpp GGUF file, dequantized on read and renamed to Hugging Face names.

GGUF lists dims innermost-first (the reverse of numpy). What llama.cpp's converter changes, per
architecture (`general.architecture`), and we undo:
- llama: the rows of each Q and K head are reordered so that RoPE pairs (2i, 2i+1) sit together; we
  restore the Hugging Face order, where the pairs are (i, i + head_dim/2), which our RoPE expects.
  smollm3 (a Llama subclass in the converter) is permuted the same way; qwen2, qwen3, gemma2 and
  olmo2 are converted without that permutation (their converters do not call it).
- olmo2: no norm before the blocks; `post_attention_norm` / `post_ffw_norm` are the norms after
  them, and `attn_q_norm` / `attn_k_norm` span the whole Q / K projection.
- gemma2, gemma3: every `*norm.weight` (Gemma 3's Q/K norms too) is stored with the 1 of Gemma's
  (1 + w) RMSNorm already added; we subtract it so the graph's (1 + w) norm sees Hugging Face's w.
  Gemma's `ffn_norm` is the norm before the MLP (pre_feedforward_layernorm), not Llama's
  post_attention_layernorm.
- llama with `llama.expert_count` (Mixtral): the router `ffn_gate_inp` is block_sparse_moe.gate;
  the experts are either one tensor each (`blk.N.ffn_gate.E.weight`, older files) or one 3-D stack
  per projection (`blk.N.ffn_gate_exps.weight`, numpy shape [E, rows, cols]). A stack is listed
  here as E per-expert Hugging Face names (`...experts.E.w1.weight`; gate w1, up w3, down w2),
  each read as its own slice of the stack, so both layouts look like the Hub's safetensors.
  qwen3moe: the same, under Qwen3-MoE's names (mlp.gate, mlp.experts.E.gate_proj / up_proj /
  down_proj), with qwen3's Q/K norms.
- phi3: Q, K, V fused as `attn_qkv` and gate, up as `ffn_up` (the Hub's qkv_proj and
  gate_up_proj, split by models/phi3.checkpoint_rows); `rope_factors_long` / `_short` are LongRoPE's
  factors, read into the config (gguf_config.py), not weights.
- gpt-oss: the norm after attention is `post_attention_norm`, the sinks `attn_sinks.weight`, the
  router `ffn_gate_inp` (with a bias); the experts are whole stacks, gate and up apart (the
  converter splits the Hub's interleaved gate_up_proj), with biases, MXFP4 or floats: read as the
  stacks models/gpt_oss.py names (`mlp.experts.gate_proj.weight` [E, I, D], ...).
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from ..errors import FuselmError
from .tensor_store import TensorStore

SUPPORTED = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# arch -> (the block holding its experts, llama.cpp's expert projections -> the Hub's)
_EXPERT_NAMES = {"llama": ("block_sparse_moe", {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}),
                 "qwen3moe": ("mlp", {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"})}
_QWEN3_NAMES = {**_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# per-architecture differences from the Llama names (gguf's MODEL_TENSORS / TENSOR_NAMES)
_ARCH_BLOCK_NAMES = {
    "llama": {**_BLOCK_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen2": _BLOCK_NAMES,
    "qwen3": _QWEN3_NAMES,
    "qwen3moe": {**_QWEN3_NAMES, "ffn_gate_inp": "mlp.gate"},
    "phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "gemma3": {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "olmo2": {**_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "smollm3": _BLOCK_NAMES,
    "gpt-oss": {**_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
                "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"},
}
UNSUFFIXED = ("self_attn.sinks",)          # Hugging Face names without the ".weight" llama.cpp adds
PERMUTED_QK = {"llama", "smollm3"}          # archs whose converter reorders Q/K rows for llama.cpp's RoPE
NORM_PLUS_ONE = {"gemma2", "gemma3"}       # archs whose converter stores norm weights as 1 + w


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a llama.cpp tensor name; unknown names are kept as they are.
    A stack of experts (`ffn_*_exps`) gets the Hub's expert name with "*" for the expert index."""
    block_names = _ARCH_BLOCK_NAMES.get(arch, _BLOCK_NAMES)
    m = re.fullmatch(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)(?:\.(\d+)|_exps)\.weight", gguf_name)
    if m and arch in _EXPERT_NAMES:
        block, names = _EXPERT_NAMES[arch]
        return f"model.layers.{m[1]}.{block}.experts.{m[3] or '*'}.{names[m[2]]}.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m[2] in block_names:
        ours = block_names[m[2]]
        return f"model.layers.{m[1]}.{ours}" + ("" if ours in UNSUFFIXED else f".{m[3]}")
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m[1]]}.{m[2]}"
    return gguf_name


class GGUFFile(gguf.GGUFReader):
    """gguf's reader, keeping the path it opened: errors about its metadata name the file.

    The reader parses the header with a view of the mapped file per value, and a vocabulary is
    hundreds of thousands of them (Llama 3's 128k tokens and 280k merges); views of np.memmap go
    through its Python hooks (`__array_finalize__`, `__getitem__`), so here `data` is a plain
    ndarray of the same mapping and the byte orders' dtypes are made once: the header of an 8B
    GGUF with SmolLM2's vocabulary parses in 0.37 s instead of 1.65 s, to the same fields."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.path = path

    @property
    def data(self) -> np.ndarray:
        return self._bytes           # uint8 [file size], the mapping (kept alive as its base)

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._bytes = mapped.view(np.ndarray)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        dt = _ordered(np.dtype(dtype), self.byte_order if override_order is None else override_order)
        count = int(count)
        return self._bytes[offset: offset + dt.itemsize * count].view(dt)[:count]


@functools.lru_cache(maxsize=None)
def _ordered(dtype: np.dtype, order: str) -> np.dtype:
    return dtype.newbyteorder(order)


def read_gguf(path: Path) -> gguf.GGUFReader:
    """Parse a GGUF file; any failure of the parser becomes one line naming the file."""
    try:
        reader = GGUFFile(path)
    except Exception as e:  # the parser raises ValueError, struct.error, IndexError... on bad bytes
        raise FuselmError(f"{path}: not a valid GGUF file, truncated or corrupt ({_one_line(e)})") from None
    for t in reader.tensors:  # a truncated data section shows as views shorter than the header says
        if t.data.nbytes != int(t.n_bytes):
            raise FuselmError(f"{path}: truncated: tensor '{t.name}' has {t.data.nbytes} of {t.n_bytes} bytes")
    return reader


def metadata(reader: gguf.GGUFReader, key: str, default=None):
    """The value of metadata `key` (a Python scalar, str or list), or `default` if absent; a value
    that does not decode (a string that is not UTF-8) is an error naming the file and the key."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (UnicodeDecodeError, ValueError, IndexError, TypeError) as e:
        where = getattr(reader, "path", "GGUF file")
        raise FuselmError(f"{where}: GGUF metadata '{key}' does not decode ({_one_line(e)})") from None


def metadata_count(reader: gguf.GGUFReader, key: str) -> int:
    """Metadata `key` as a count (0 where absent); anything but a non-negative integer names the key."""
    value = metadata(reader, key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FuselmError(f"{getattr(reader, 'path', 'GGUF file')}: GGUF metadata '{key}' = {value!r} "
                          "is not a count")
    return value


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class GGUFStore(TensorStore):
    """Dequantizing view of a GGUF file; `n_heads`/`n_kv_heads` are needed to undo the Q/K row order."""

    def __init__(self, reader: gguf.GGUFReader, path: Path, n_heads: int, n_kv_heads: int):
        self.source, self._path = str(path), path
        self.arch = metadata(reader, "general.architecture") or "llama"
        self._n_experts = metadata_count(reader, f"{self.arch}.expert_count")
        self._tensors = {}   # Hugging Face name -> (GGUF tensor, index in its expert stack or None)
        for t in reader.tensors:
            name = hf_name(t.name, self.arch)
            if "*" not in name:
                self._tensors[name] = (t, None)
                continue
            if len(t.shape) != 3 or int(t.shape[-1]) != self._n_experts:
                raise FuselmError(f"{path}: expert stack '{t.name}' has shape {self._shape(t)}, not "
                                  f"[{self.arch}.expert_count = {self._n_experts}, rows, cols]")
            self._tensors.update({name.replace("*", str(e)): (t, e) for e in range(self._n_experts)})
        if self._n_experts:
            self._check_experts(metadata_count(reader, f"{self.arch}.block_count"))
        self._heads = {"q_proj": n_heads, "k_proj": n_kv_heads} if self.arch in PERMUTED_QK else {}
        self._norm_offset = 1.0 if self.arch in NORM_PLUS_ONE else 0.0

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        t, expert = self._tensor(name)
        return self._shape(t) if expert is None else self._shape(t)[1:]

    @staticmethod
    def _shape(t) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape))

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        t, expert = self._tensor(name)
        kind = Q(t.tensor_type)
        if kind not in SUPPORTED:
            raise FuselmError(f"{self._path}: tensor '{t.name}' has type {kind.name}, which fuselm cannot "
                              f"dequantize (supported: {', '.join(sorted(q.name for q in SUPPORTED))})")
        shape = self.shape(name)
        # the reader's view has the numpy dims, bytes innermost: [e] is one expert's rows of a stack
        data = t.data if expert is None else t.data[expert]
        if kind in (Q.F32, Q.F16):
            w = np.asarray(data).reshape(shape)
        else:  # BF16 arrives as raw bytes, the quantized types as blocks: dequantize gives float32
            w = gguf.quants.dequantize(data, kind).reshape(shape)
        proj = name.split(".")[-2]
        if proj in self._heads and name.startswith("model.layers."):
            w = unpermute_rope_rows(w, self._heads[proj])
        if self._norm_offset and name.endswith("norm.weight"):
            w = w - np.float32(self._norm_offset)
        return w.astype(dtype, copy=False)

    def gpu_format(self, name: str) -> str | None:
        """The GPU format (quant/formats.py) that tensor `name` keeps, from its header, or None."""
        from ..quant.formats import GGUF_FORMATS
        t, _ = self._tensor(name)
        fmt = GGUF_FORMATS.get(Q(t.tensor_type).name)
        ok = fmt is not None and fmt.fits(self.shape(name))
        return fmt.name if ok else None

    def quantized(self, name: str, xp=np):
        """Tensor `name` kept in its GGUF blocks, repacked for the GPU (quant/layout.py) by `xp`
        (cupy: the blocks are uploaded as they are and repacked there), or None when its type has
        no GPU format (it is then read dequantized, by get)."""
        from ..quant.layout import from_gguf
        fmt = self.gpu_format(name)
        if fmt is None:
            return None
        t, expert = self._tensor(name)
        shape = self.shape(name)
        raw = xp.asarray(t.data if expert is None else t.data[expert]).reshape(shape[0], -1)
        proj = name.split(".")[-2]
        if proj in self._heads and name.startswith("model.layers."):
            raw = unpermute_rope_rows(raw, self._heads[proj])     # whole rows of blocks move
        try:
            return from_gguf(fmt, raw, shape, xp)
        except ValueError as e:
            raise FuselmError(f"{self._path}: tensor '{t.name}': {e}") from None

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise FuselmError(f"{self._path}: tensor '{name}' not found "
                              f"(the file has {len(self._tensors)} tensors)") from None

    def _check_experts(self, n_layers: int) -> None:
        """Every layer with a router has experts 0 .. E-1 of each projection, stacked or one tensor
        each, and no more."""
        for t, _ in self._tensors.values():
            m = re.fullmatch(r"blk\.\d+\.ffn_\w+\.(\d+)\.weight", t.name)
            if m and int(m[1]) >= self._n_experts:
                raise FuselmError(f"{self._path}: tensor '{t.name}' is expert {m[1]} but "
                                  f"{self.arch}.expert_count is {self._n_experts}")
        block, names = _EXPERT_NAMES.get(self.arch, _EXPERT_NAMES["llama"])
        for i in range(n_layers):
            if f"model.layers.{i}.{block}.gate.weight" not in self._tensors:
                continue    # a dense layer
            for short, w in names.items():
                for e in range(self._n_experts):
                    if f"model.layers.{i}.{block}.experts.{e}.{w}.weight" not in self._tensors:
                        raise FuselmError(f"{self._path}: missing expert tensor 'blk.{i}.{short}.{e}.weight' "
                                          f"(nor a stack 'blk.{i}.{short}_exps.weight'; "
                                          f"{self.arch}.expert_count is {self._n_experts})")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: within a head, GGUF row 2i+j is Hugging Face row j*hd/2 + i."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

"""Tensors of a Hugging Face safetensors checkpoint (one file or shards), memory-mapped.

We parse the header ourselves (8 bytes little-endian length, then JSON) instead of going through
the `safetensors` package: its numpy API has no bfloat16, and our own checks name the broken file.
The header is untrusted: every entry is type- and range-checked before any byte is mapped.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path, PurePosixPath

import ml_dtypes
import numpy as np

from ..errors import FuselmError
from .tensor_store import TensorStore

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "U8": np.dtype(np.uint8)}
# Bytes per element of every dtype the safetensors format defines (those we read, and the rest,
# whose tensors are refused only when a model asks for them).
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_header(path: Path) -> tuple[dict, int]:
    """The tensor entries of one .safetensors file and where its data section begins.

    Each entry must have a known dtype, a shape of non-negative integers and `data_offsets`: two
    integers 0 <= begin <= end within the data section, end - begin bytes for the shape, no two
    tensors overlapping. Anything else, a truncated file included, is an error naming the file."""
    size = path.stat().st_size
    if size < 8:
        raise FuselmError(f"{path}: not a valid safetensors file (only {size} bytes)")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes but the file has {size}")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FuselmError(f"{path}: not a valid safetensors file ({_one_line(e)})") from None
    if not isinstance(header, dict):
        raise FuselmError(f"{path}: not a valid safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    start, data_size = 8 + n, size - 8 - n
    spans = []
    for name, entry in header.items():
        lo, hi = _check_entry(path, name, entry)
        if hi > data_size:
            raise FuselmError(f"{path}: truncated: tensor '{name}' ends at byte {start + hi} "
                              f"of a {size}-byte file")
        spans.append((lo, hi, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise FuselmError(f"{path}: corrupt: tensors '{first}' and '{second}' overlap in the data section")
    return header, start


def _check_entry(path: Path, name: str, entry) -> tuple[int, int]:
    """The (begin, end) offsets of one header entry, after checking its fields' types and ranges."""
    def bad(why: str):
        return FuselmError(f"{path}: corrupt header entry for tensor '{name}' ({why})")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise bad("needs dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise bad(f"dtype {dtype!r} is not one of {', '.join(ITEMSIZE)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise bad(f"data_offsets {offsets!r} are not two non-negative integers, begin <= end")
    lo, hi = offsets
    if hi - lo != ITEMSIZE[dtype] * math.prod(shape):
        raise FuselmError(f"{path}: corrupt: tensor '{name}' has {hi - lo} bytes for shape {shape}")
    return lo, hi


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class SafetensorsStore(TensorStore):
    """The tensors of `files` (shards of one checkpoint), each file mapped once on first use."""

    def __init__(self, files: list[Path], source: str):
        self.source = source
        self._entries: dict[str, tuple[Path, dict, int]] = {}
        for path in files:
            header, start = read_header(path)
            for name, entry in header.items():
                if name in self._entries:
                    raise FuselmError(f"{path}: tensor '{name}' is also in {self._entries[name][0]}")
                self._entries[name] = (path, entry, start)
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        """Tensor `name` as `dtype`; an fp8 (e4m3) weight times its `weight_scale` (see fp8_scale)."""
        stored = self._stored(name)
        if self._entry(name)[1]["dtype"] == "F8_E4M3" and len(stored.shape) == 2:
            scale = self.fp8_scale(name)
            return (stored.astype(np.float32) * scale[:, None]).astype(dtype, copy=False)
        return stored.astype(dtype, copy=False)

    def _stored(self, name: str) -> np.ndarray:
        """Tensor `name` as stored: a read-only view of the mapped file."""
        path, entry, start = self._entry(name)
        stored = DTYPES.get(entry["dtype"])
        if stored is None:
            raise FuselmError(f"{path}: tensor '{name}' has dtype {entry['dtype']}; "
                              f"supported: {', '.join(DTYPES)}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, np.uint8, mode="r")
        lo, hi = entry["data_offsets"]
        raw = self._maps[path][start + lo:start + hi]
        return raw.view(stored).reshape(entry["shape"])

    def fp8_scale(self, name: str) -> np.ndarray:
        """The float32 scale per row [N] of fp8 matrix `name`: its `<name>_scale` tensor (the fp8
        checkpoints' `weight_scale`), one value for the tensor or one per row; 1 where absent."""
        rows = self.shape(name)[0]
        scale_name = name + "_scale"
        if scale_name not in self._entries:
            return np.ones(rows, np.float32)
        scale = self._stored(scale_name).astype(np.float32)
        if scale.size == 1:
            return np.full(rows, scale.reshape(-1)[0], np.float32)
        if scale.size == rows and scale.shape in ((rows,), (rows, 1)):
            return scale.reshape(rows)
        raise FuselmError(f"{self.source}: tensor '{scale_name}' has shape {scale.shape}: fp8 weights need one "
                          f"scale for the tensor or one per row ({rows}); block scales are not supported")

    def gpu_format(self, name: str) -> str | None:
        shape = self.shape(name)
        fp8 = self._entry(name)[1]["dtype"] == "F8_E4M3" and len(shape) == 2 and shape[1] % 32 == 0
        return "fp8" if fp8 else None

    def quantized(self, name: str, xp=np):
        """An fp8 matrix kept in its bytes with its scale per row (quant/layout.from_fp8)."""
        from ..quant.layout import from_fp8
        if self.gpu_format(name) is None:
            return None
        return from_fp8(self._stored(name), self.fp8_scale(name))

    def _entry(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise FuselmError(f"{self.source}: tensor '{name}' not found "
                              f"(the checkpoint has {len(self._entries)} tensors)") from None


def open_safetensors_folder(folder: Path) -> SafetensorsStore:
    """model.safetensors, or the shards listed by model.safetensors.index.json, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [_shard_path(folder, index, s) for s in sorted(_index_shards(index))]
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FuselmError(f"{folder}: no weights (model.safetensors or *.safetensors shards)")
    return SafetensorsStore(files, str(folder))


def _index_shards(index: Path) -> set[str]:
    """The shard file names an index's weight_map lists."""
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (ValueError, KeyError, AttributeError, TypeError, RecursionError) as e:
        raise FuselmError(f"{index}: not a valid index ({_one_line(e)})") from None
    if bad := [s for s in shards if not isinstance(s, str)]:
        raise FuselmError(f"{index}: not a valid index (shard names must be strings, got {bad[0]!r})")
    return shards


def _shard_path(folder: Path, index: Path, name: str) -> Path:
    """A shard named by the index: a relative path that stays inside the model folder (checked on
    the name, so symlinked shards, as the Hugging Face cache has them, still load)."""
    parts = PurePosixPath(name.replace(os.sep, "/")).parts
    if not name or PurePosixPath(name).is_absolute() or Path(name).is_absolute() or ".." in parts:
        raise FuselmError(f"{index}: shard '{name}' is outside the model folder")
    path = folder / name
    if not path.is_file():
        raise FuselmError(f"{index}: lists shard '{name}', which does not exist")
    return path

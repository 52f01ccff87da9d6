"""Tensors of a Hugging Face safetensors checkpoint (one file or shards), memory-mapped.

We parse the header ourselves (8 bytes little-endian length, then JSON) instead of going through
the `safetensors` package: its numpy API has no bfloat16, and our own checks name the broken file.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import FuselmError
from .tensor_store import TensorStore

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64)}


def read_header(path: Path) -> tuple[dict, int]:
    """The tensor entries of one .safetensors file and where its data section begins.

    Every entry is checked against the file size, so a truncated file fails here, naming itself."""
    size = path.stat().st_size
    if size < 8:
        raise FuselmError(f"{path}: not a valid safetensors file (only {size} bytes)")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes but the file has {size}")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise FuselmError(f"{path}: not a valid safetensors file ({_one_line(e)})") from None
    if not isinstance(header, dict):
        raise FuselmError(f"{path}: not a valid safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    start, data_size = 8 + n, size - 8 - n
    for name, entry in header.items():
        try:
            lo, hi = entry["data_offsets"]
            int(np.prod(entry["shape"])), entry["dtype"]
        except (KeyError, TypeError, ValueError):
            raise FuselmError(f"{path}: corrupt header entry for tensor '{name}'") from None
        if hi > data_size:
            raise FuselmError(f"{path}: truncated: tensor '{name}' ends at byte {start + hi} "
                              f"of a {size}-byte file")
        if entry["dtype"] in DTYPES and hi - lo != DTYPES[entry["dtype"]].itemsize * int(np.prod(entry["shape"])):
            raise FuselmError(f"{path}: corrupt: tensor '{name}' has {hi - lo} bytes for shape {entry['shape']}")
    return header, start


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
                self._entries[name] = (path, entry, start)
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        path, entry, start = self._entry(name)
        stored = DTYPES.get(entry["dtype"])
        if stored is None:
            raise FuselmError(f"{path}: tensor '{name}' has dtype {entry['dtype']}; "
                              f"supported: {', '.join(DTYPES)}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, np.uint8, mode="r")
        lo, hi = entry["data_offsets"]
        raw = self._maps[path][start + lo:start + hi]
        return raw.view(stored).reshape(entry["shape"]).astype(dtype, copy=False)

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
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError, TypeError) as e:
            raise FuselmError(f"{index}: not a valid index ({_one_line(e)})") from None
        if bad := [s for s in shards if not isinstance(s, str)]:
            raise FuselmError(f"{index}: not a valid index (shard names must be strings, got {bad[0]!r})")
        shards = sorted(shards)
        files = [folder / s for s in shards]
        for f in files:
            if not f.exists():
                raise FuselmError(f"{index}: lists shard '{f.name}', which does not exist")
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FuselmError(f"{folder}: no weights (model.safetensors or *.safetensors shards)")
    return SafetensorsStore(files, str(folder))

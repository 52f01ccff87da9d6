"""A checkpoint view in which some tensors are rows of another: fused projections read as parts."""
from __future__ import annotations

import threading
from collections import Counter

import numpy as np

from ..errors import FuselmError
from ..quant.layout import take_rows
from .tensor_store import TensorStore


class RowViews(TensorStore):
    """`store`, plus each name of `views` (name -> (tensor of `store`, row indices)) as those rows
    of that tensor, in that order (models/__init__.checkpoint_rows says which). A view of a tensor
    the GPU keeps quantized stays so: its blocks hold whole rows (a GGUF block never spans two), so
    the view's rows are those rows of every section of the layout (quant/layout.take_rows)."""

    def __init__(self, store: TensorStore, views: dict[str, tuple[str, np.ndarray]]):
        self._store, self.source = store, store.source
        have = set(store.names())
        self._views = {name: (src, np.asarray(rows)) for name, (src, rows) in views.items() if src in have}
        self._views_of = Counter(src for src, _ in self._views.values())
        # (tensor, xp) -> [its quantized weight, its views not yet taken]: Q, K and V repack their
        # tensor once, which goes when the last of them is taken; loader threads share it
        self._held: dict[tuple, list] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return self._store.names() + list(self._views)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._views:
            return self._store.shape(name)
        src, rows = self._views[name]
        shape = self._store.shape(src)
        if rows.size and not (0 <= rows.min() and rows.max() < shape[0]):
            raise FuselmError(f"{self.source}: tensor '{src}' has {shape[0]} rows; '{name}' needs rows up to "
                              f"{rows.max()}")
        return (len(rows), *shape[1:])

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        if name not in self._views:
            return self._store.get(name, dtype)
        src, rows = self._views[name]
        self.shape(name)   # rows in range
        return np.ascontiguousarray(self._store.get(src, dtype)[rows])

    def gpu_format(self, name: str) -> str | None:
        return self._store.gpu_format(self._views[name][0] if name in self._views else name)

    def quantized(self, name: str, xp=np):
        if name not in self._views:
            return self._store.quantized(name, xp)
        src, rows = self._views[name]
        self.shape(name)
        with self._lock:
            held = self._held.setdefault((src, xp), [None, self._views_of[src]])
            if held[0] is None:
                held[0] = self._store.quantized(src, xp)
            whole, held[1] = held[0], held[1] - 1
            if held[1] <= 0:
                del self._held[(src, xp)]
        return None if whole is None else take_rows(whole, rows)

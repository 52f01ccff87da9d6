"""A checkpoint view in which some tensors are rows of another: fused projections read as parts."""
from __future__ import annotations

import numpy as np

from ..errors import FuselmError
from .tensor_store import TensorStore


class RowViews(TensorStore):
    """`store`, plus each name of `views` (name -> (tensor of `store`, row indices)) as those rows
    of that tensor, in that order (models/__init__.checkpoint_rows says which). A view is read as
    float and kept so on the GPU: the rows of a quantized tensor are not sliced out of its blocks."""

    def __init__(self, store: TensorStore, views: dict[str, tuple[str, np.ndarray]]):
        self._store, self.source = store, store.source
        have = set(store.names())
        self._views = {name: (src, np.asarray(rows)) for name, (src, rows) in views.items() if src in have}

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
        return None if name in self._views else self._store.gpu_format(name)

    def quantized(self, name: str):
        return None if name in self._views else self._store.quantized(name)

"""A checkpoint's tensors under other names: a multimodal checkpoint read as its language model."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .tensor_store import TensorStore


class RenamedStore(TensorStore):
    """`store`, each tensor named `rename(its name)` and left out where that is None (the vision
    tower of a multimodal checkpoint: models.language_model says which)."""

    def __init__(self, store: TensorStore, rename: Callable[[str], str | None]):
        self._store, self.source = store, store.source
        self._names: dict[str, str] = {}   # our name -> the store's
        for name in store.names():
            if (ours := rename(name)) is not None:
                self._names.setdefault(ours, name)

    def _theirs(self, name: str) -> str:
        return self._names.get(name, name)   # an unknown name: the store's own error names it

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._store.shape(self._theirs(name))

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        return self._store.get(self._theirs(name), dtype)

    def gpu_format(self, name: str) -> str | None:
        return self._store.gpu_format(self._theirs(name))

    def quantized(self, name: str, xp=np):
        return self._store.quantized(self._theirs(name), xp)

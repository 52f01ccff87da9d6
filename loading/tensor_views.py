"""A checkpoint view in which some tensors are computed from others: gpt-oss's stacked experts,
interleaved, transposed or in MXFP4, read as the graph's gate, up and down stacks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import FuselmError
from .tensor_store import TensorStore


@dataclass(frozen=True)
class View:
    """A tensor made from the checkpoint tensors `sources`: `shape` maps their shapes to its
    own, `take` their arrays (float32, or bytes with `codes`: MXFP4 blocks and scales) to it as
    floats, and `keep` (if given) the same bytes to a quant.QuantizedWeight in format `format`,
    for the GPU."""
    sources: tuple[str, ...]
    shape: Callable[..., tuple]
    take: Callable[..., np.ndarray]
    codes: bool = False
    keep: Callable[..., object] | None = None
    format: str | None = None


class TensorViews(TensorStore):
    """`store`, plus each name of `views` (models/__init__.checkpoint_views says which) as its
    View computes it. The views are read as floats: the GPU keeps none of them quantized."""

    def __init__(self, store: TensorStore, views: dict[str, View]):
        self._store, self.source = store, store.source
        have = set(store.names())
        self._views = {name: v for name, v in views.items() if all(s in have for s in v.sources)}

    def names(self) -> list[str]:
        return self._store.names() + list(self._views)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._views:
            return self._store.shape(name)
        view = self._views[name]
        shapes = [self._store.shape(s) for s in view.sources]
        try:
            return tuple(int(d) for d in view.shape(*shapes))
        except (IndexError, TypeError, ValueError):
            raise FuselmError(f"{self.source}: tensors {', '.join(view.sources)} of shapes {shapes} cannot "
                              f"make '{name}'") from None

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        if name not in self._views:
            return self._store.get(name, dtype)
        view = self._views[name]
        return np.ascontiguousarray(view.take(*self._sources(view)), dtype=dtype)

    def _sources(self, view: View) -> list[np.ndarray]:
        return [self._store.get(s, np.uint8 if view.codes else np.float32) for s in view.sources]

    def gpu_format(self, name: str) -> str | None:
        if name not in self._views:
            return self._store.gpu_format(name)
        return self._views[name].format

    def quantized(self, name: str, xp=np):
        if name not in self._views:
            return self._store.quantized(name, xp)
        view = self._views[name]
        if view.keep is None:
            return None
        try:
            return view.keep(*self._sources(view))
        except ValueError as e:
            raise FuselmError(f"{self.source}: tensors {', '.join(view.sources)}: {e}") from None

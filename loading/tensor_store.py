"""The read-only view of a checkpoint's tensors that every file format implements."""
from __future__ import annotations

import numpy as np


class TensorStore:
    """Tensors by their Hugging Face names; subclasses read one file format."""

    source: str = "?"  # the file or folder, for error messages

    def names(self) -> list[str]:
        """Every tensor name the checkpoint holds, in file order."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        """The numpy shape of `name`, read from the header only."""
        raise NotImplementedError

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        """Tensor `name` converted to `dtype` (may be a read-only view of a mapped file)."""
        raise NotImplementedError

    def gpu_format(self, name: str) -> str | None:
        """The quantized GPU format `quantized(name)` would give, from the header, or None."""
        return None

    def quantized(self, name: str, xp=np):
        """Tensor `name` as a quant.QuantizedWeight in its file's own quantized format, or None
        where the file holds it otherwise (then `get` reads it). With `xp` cupy, a store that can
        converts on the GPU and gives its bytes there; the others give numpy bytes."""
        return None

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

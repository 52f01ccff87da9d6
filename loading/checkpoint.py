"""Opening a checkpoint (Hugging Face folder or GGUF file) and loading the weights a graph asks for."""
from __future__ import annotations

import math
import os
import re
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..dsl import Graph
from ..errors import FuselmError
from ..models import checkpoint_rows, checkpoint_views, language_model
from ..models.config import DecoderConfig
from ..quant.layout import stack_experts
from .gguf_config import config_from_gguf, generation_from_gguf
from .gguf_store import GGUFStore, read_gguf
from .gguf_tokenizer import tokenizer_from_gguf
from .json_file import read_object
from .renamed_store import RenamedStore
from .row_views import RowViews
from .tensor_views import TensorViews
from .safetensors_store import open_safetensors_folder
from .tensor_store import TensorStore
from .tokenizer import TextTokenizer

__all__ = ["Checkpoint", "TensorStore", "open_checkpoint", "load_weights", "iter_weights", "gpu_formats"]


@dataclass
class Checkpoint:
    """An opened model: config, tensors (read on demand), tokenizer and generation defaults."""
    path: Path
    config: DecoderConfig
    tensors: TensorStore
    tokenizer: TextTokenizer
    generation: dict  # generation_config.json ({} if absent); for GGUF, the special ids it gives


# Reading weights (iter_weights): threads that read and convert tensors ahead of the one taken
# (numpy releases the GIL in its conversions), and the weights they may hold in flight.
READ_WORKERS = min(8, os.cpu_count() or 1)
READ_AHEAD = 1 << 28


def repack_margin(largest: int) -> int:
    """Bytes that repacking on the GPU (iter_weights with xp=cupy) holds beside the weights: the
    GGUF blocks of the tensor in hand (at most `largest` bytes, about its repacked size) and one
    band of temporaries (quant/layout.py)."""
    from ..quant.layout import REPACK_TEMP_BYTES, REPACK_WEIGHTS
    return largest + REPACK_TEMP_BYTES * REPACK_WEIGHTS


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a Hugging Face folder (config.json, safetensors, tokenizer.json) or a .gguf file.
    Reads headers and metadata only; tensors are read by load_weights. The config and the tokenizer
    (chat template compiled) are checked before the tensor headers."""
    path = Path(path)
    if not path.exists():
        raise FuselmError(f"{path}: no such file or folder")
    if path.is_dir():
        return _open_folder(path)
    with path.open("rb") as f:
        magic = f.read(4)
    if path.suffix.lower() == ".gguf" or magic == b"GGUF":
        return _open_gguf(path)
    raise FuselmError(f"{path}: not a checkpoint (expected a Hugging Face folder or a .gguf file)")


def _open_folder(folder: Path) -> Checkpoint:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FuselmError(f"{folder}: no config.json")
    raw, rename = language_model(read_object(cfg_path), str(cfg_path))   # a multimodal one's text model
    cfg = DecoderConfig.from_hf(raw, str(cfg_path))
    generation = read_object(folder / "generation_config.json", missing={})
    tokenizer = TextTokenizer.from_folder(folder, raw, generation)
    tensors = open_safetensors_folder(folder)
    return _checked(Checkpoint(folder, cfg, RenamedStore(tensors, rename) if rename else tensors, tokenizer,
                               generation))


def _open_gguf(path: Path) -> Checkpoint:
    reader = read_gguf(path)
    raw = config_from_gguf(reader, path)
    cfg = DecoderConfig.from_hf(raw, str(path))
    tokenizer = tokenizer_from_gguf(reader, path)
    store = GGUFStore(reader, path, cfg.num_heads, cfg.num_kv_heads)
    return _checked(Checkpoint(path, cfg, store, tokenizer, generation_from_gguf(raw)))


def _checked(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint (its tensors seen through the architecture's row views and computed views,
    if it has any: models.checkpoint_rows, checkpoint_views), once its config agrees with its
    tokenizer and its tensors' headers: every id the tokenizer makes has a row in the embedding,
    which has the config's shape, and the config's layer count is the tensors'. A mismatch is a corrupt file, named here before any weight is read."""
    cfg, where = ckpt.config, ckpt.path
    if views := checkpoint_rows(cfg):
        ckpt.tensors = RowViews(ckpt.tensors, views)
    if views := checkpoint_views(cfg, set(ckpt.tensors.names())):
        ckpt.tensors = TensorViews(ckpt.tensors, views)
    if ckpt.tokenizer.vocab_size > cfg.vocab_size:
        raise FuselmError(f"{where}: the tokenizer has {ckpt.tokenizer.vocab_size} tokens but vocab_size "
                          f"is {cfg.vocab_size}")
    names = ckpt.tensors.names()
    embed = "model.embed_tokens.weight"
    if embed in names and ckpt.tensors.shape(embed) != (cfg.vocab_size, cfg.hidden_size):
        raise FuselmError(f"{where}: tensor '{embed}' has shape {ckpt.tensors.shape(embed)} but vocab_size "
                          f"and hidden_size are ({cfg.vocab_size}, {cfg.hidden_size})")
    layers = {int(m[1]) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if layers and max(layers) + 1 != cfg.num_layers:
        raise FuselmError(f"{where}: the tensors hold {max(layers) + 1} layers but num_hidden_layers "
                          f"is {cfg.num_layers}")
    return ckpt


def gpu_formats(ckpt: Checkpoint, graph: Graph) -> dict[str, str]:
    """The quantized formats `ckpt`'s tensors keep on the GPU (from headers only), by weight name;
    a stack of experts ("*" in its name) keeps one where all its experts are in it."""
    from ..compiler.assign_formats import quantizable_shapes
    return {n: f for n, shape in quantizable_shapes(graph).items() if (f := _gpu_format(ckpt, n, shape))}


def _experts(name: str, shape: tuple) -> list[str]:
    """The tensor names of a stack of experts' weight node ("*" runs over 0 .. E-1, models/mixtral.py)."""
    return [name.replace("*", str(e)) for e in range(shape[0])]


def _gpu_format(ckpt: Checkpoint, name: str, shape: tuple) -> str | None:
    if "*" not in name:
        return ckpt.tensors.gpu_format(name)
    available = set(ckpt.tensors.names())
    if not all(n in available for n in _experts(name, shape)):
        return None          # iter_weights names the missing one
    formats = {ckpt.tensors.gpu_format(n) for n in _experts(name, shape)}
    return formats.pop() if len(formats) == 1 else None


def load_weights(ckpt: Checkpoint, graph: Graph, dtype=np.float32, progress: bool = True,
                 keep_quantized: bool = False) -> dict[str, np.ndarray]:
    """Every weight node of `graph`, read from the checkpoint as `dtype` and shape-checked. With
    `keep_quantized`, the GEMV matrices and embedding tables that the file holds in a format the
    GPU kernels read stay in it (quant.QuantizedWeight)."""
    nodes = graph.sources("weight")
    weights = iter_weights(ckpt, graph, dtype, keep_quantized)
    return dict(tqdm(weights, total=len(nodes), desc="loading weights", unit="tensor", disable=not progress,
                     leave=False))


def iter_weights(ckpt: Checkpoint, graph: Graph, dtype=np.float32, keep_quantized: bool = False,
                 workers: int = READ_WORKERS, xp=np):
    """(name, weight) for every weight node of `graph`, in graph order, as load_weights reads them;
    with `xp` cupy, the quantized ones that a store can convert on the GPU come as cupy bytes.
    `workers` threads read and convert (dequantize, repack) the next tensors while the caller takes
    this one, within READ_AHEAD weights in flight: a caller that moves each to the GPU before the
    next holds about that much in host memory, plus the largest tensor. Work on the GPU (xp not
    numpy) runs on the caller's thread only, one tensor at a time: CUDA's current device is the
    caller's, and CuPy's first use of a kernel from several threads at once is not to be relied on."""
    available = set(ckpt.tensors.names())
    quantizable = set()
    if keep_quantized:
        from ..compiler.assign_formats import quantizable_shapes
        quantizable = set(quantizable_shapes(graph))

    def read(node):
        stack = "*" in node.name   # a stack over experts (see _experts)
        if node.name in quantizable:
            names = _experts(node.name, node.shape) if stack else [node.name]
            for n in names:
                _load_one(ckpt, n, node.shape[1:] if stack else node.shape, available, None)   # present, right shape
            if _gpu_format(ckpt, node.name, node.shape):
                def convert():
                    parts = (ckpt.tensors.quantized(n, xp) for n in names)   # a stack's held once, not twice
                    return stack_experts(parts, len(names)) if stack else next(parts)
                return convert() if xp is np else _OnCaller(convert)
        if stack:
            return np.stack([_load_one(ckpt, n, node.shape[1:], available, dtype)
                             for n in _experts(node.name, node.shape)])
        return _load_one(ckpt, node.name, node.shape, available, dtype)

    nodes = graph.sources("weight")
    results = read_ahead(read, nodes, lambda node: math.prod(node.shape), workers, READ_AHEAD)
    for node, weight in zip(nodes, results):
        yield node.name, weight.convert() if isinstance(weight, _OnCaller) else weight


@dataclass
class _OnCaller:
    """A read left for iter_weights' caller's thread to finish (its work on the GPU)."""
    convert: Callable[[], object]


def read_ahead(read, items, size, workers: int, budget: int):
    """read(item) for each of `items`, in their order, by `workers` threads: a read starts while
    the sizes of those started and not yet taken stay within `budget` (the next one always starts
    when none is in flight). An error is raised where its item's result is taken; reads not
    started then never start."""
    if workers <= 1:
        yield from map(read, items)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="fuselm-read")
    pending, queued, i = deque(), 0, 0     # (future, size) in item order; their total size; next item
    try:
        while i < len(items) or pending:
            while i < len(items) and (not pending or queued + size(items[i]) <= budget):
                pending.append((pool.submit(read, items[i]), size(items[i])))
                queued += pending[-1][1]
                i += 1
            future, n = pending.popleft()
            queued -= n
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _load_one(ckpt: Checkpoint, name: str, expected: tuple, available: set, dtype) -> np.ndarray:
    """One tensor, checked for presence and shape (dtype None: only checked)."""
    if name not in available:
        raise FuselmError(f"{ckpt.path}: missing tensor '{name}' (the model needs it; "
                          f"the checkpoint has {len(available)} tensors)")
    shape = ckpt.tensors.shape(name)
    if shape != tuple(expected):
        raise FuselmError(f"{ckpt.path}: tensor '{name}' has shape {shape} in the checkpoint "
                          f"but the model expects {tuple(expected)}")
    return None if dtype is None else ckpt.tensors.get(name, dtype)

"""loading/row_views.py: tensors that are rows of a fused one (Phi-3's qkv_proj) read as parts,
kept quantized; the fused tensor is repacked once for all its views and let go after the last,
also when loader threads read the views of several tensors at once."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fuselm.loading.row_views import RowViews
from fuselm.loading.tensor_store import TensorStore
from fuselm.quant.layout import dequantize, random_weight


class Fused(TensorStore):
    """Two fused tensors of random Q8_0 rows; counts how often each is repacked."""
    source = "fused"

    def __init__(self):
        self.weights = {f"layer{i}.qkv": random_weight("q8_0", (12, 64), 0.1, seed=i) for i in range(2)}
        self.repacked = {n: 0 for n in self.weights}
        self.lock = threading.Lock()

    def names(self):
        return list(self.weights)

    def shape(self, name):
        return self.weights[name].shape

    def gpu_format(self, name):
        return "q8_0"

    def quantized(self, name, xp=np):
        with self.lock:
            self.repacked[name] += 1
        return self.weights[name]


def views():
    parts = {"q": np.arange(0, 4), "k": np.arange(4, 8), "v": np.arange(8, 12)}
    return {f"layer{i}.{p}": (f"layer{i}.qkv", rows) for i in range(2) for p, rows in parts.items()}


def test_views_of_a_fused_tensor_repack_it_once_and_let_it_go_after_the_last():
    store = Fused()
    rv = RowViews(store, views())
    whole = dequantize(store.weights["layer0.qkv"])
    for p, rows in (("q", slice(0, 4)), ("k", slice(4, 8)), ("v", slice(8, 12))):
        np.testing.assert_array_equal(dequantize(rv.quantized(f"layer0.{p}")), whole[rows])
    assert store.repacked["layer0.qkv"] == 1 and not rv._held


def test_threads_reading_views_of_several_tensors_get_each_its_own_rows():
    for _ in range(20):
        store = Fused()
        rv = RowViews(store, views())
        names = list(views())
        np.random.default_rng().shuffle(names)
        with ThreadPoolExecutor(4) as pool:
            got = dict(zip(names, pool.map(rv.quantized, names)))
        for name, (src, rows) in views().items():
            np.testing.assert_array_equal(dequantize(got[name]), dequantize(store.weights[src])[rows])
        assert all(n == 1 for n in store.repacked.values()) and not rv._held

"""Hypothesis strategies for random DSL graphs and tiny Llama configs, with their weights and feeds.

`random_graphs()` draws a `Case`: a DSL graph built from a random sequence of blocks over a pool of
values (so values get several consumers, some of them in later kernels), random weights of the
right shapes, feeds for T = 1..4 tokens at a random position, and initial state (KV caches filled
with random rows, so that a cache row written to the wrong place shows). The blocks:

- linears: 1-3 linears on one value (horizontal fusion), optionally behind an rmsnorm (of the
  whole row or of groups of it) that feeds
  them (prologue fusion), optionally with a bias weight [N] broadcast over tokens;
- unary elementwise ops (silu, gelu_tanh, scale, softcap) and binary ones (add, mul) on two values
  of one width, or a value and a [N] weight;
- rope (pos input, inv_freq constant; HF or interleaved layout, full or partial rotary) on a
  linear of heads * head_dim rows;
- an attention block: Q/K/V linears, optional rope, kv_write of K and V into state caches,
  attention over the caches (GQA);
- at the end, optionally softmax or argmax (reductions) of some value.

Widths are small and often odd. Norms are never graph outputs (see
test_compiler_passes.test_norm_output_is_not_a_gemv_prologue for why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from fuselm.dsl import Graph, Value

UNARY = ("silu", "gelu_tanh", "scale", "softcap")


@dataclass
class Case:
    graph: Graph
    weights: dict
    feeds: dict
    state: dict
    tokens: int
    notes: list = field(default_factory=list)

    def fresh_state(self) -> dict:
        return {k: v.copy() for k, v in self.state.items()}


class _Builder:
    """Draws blocks with `draw` and records every weight and state shape it creates."""

    def __init__(self, draw, name: str):
        self.draw, self.g = draw, Graph(name)
        self.pool: list[Value] = []          # values later blocks may read
        self.wid = 0
        self.pos: Value | None = None
        self.inv_freq: dict = {}
        self.palette: list | None = None

    def weight(self, shape) -> Value:
        self.wid += 1
        return self.g.weight(f"w{self.wid}", shape)

    def width(self, lo=1, hi=13) -> int:
        """Mostly one of a few widths per graph (so values meet in adds and muls), some odd."""
        if self.palette is None:
            self.palette = self.draw(st.lists(st.integers(2, 13), min_size=2, max_size=2))
        return self.draw(st.one_of(st.sampled_from(self.palette), st.integers(lo, hi)))

    def pick(self, width: int | None = None) -> Value | None:
        cands = [v for v in self.pool if width is None or v.shape[-1] == width]
        return self.draw(st.sampled_from(cands)) if cands else None

    def get_pos(self) -> Value:
        if self.pos is None:
            self.pos = self.g.input("pos", ("T",), "i32")
        return self.pos

    def get_inv_freq(self, half: int) -> Value:
        if half not in self.inv_freq:
            freqs = 1.0 / 100.0 ** (np.arange(half, dtype=np.float64) / max(half, 1))
            self.inv_freq[half] = self.g.constant(f"inv_freq{half}", freqs.astype(np.float32))
        return self.inv_freq[half]

    # ---- blocks ----
    def linears(self) -> None:
        x = self.pick()
        if self.draw(st.booleans()):
            width = x.shape[-1]
            groups = [d for d in range(1, width) if width % d == 0 and d > 1]
            group = self.draw(st.sampled_from([None] + groups)) if groups else None   # per-head norms too
            x = self.g.op("rmsnorm", x, self.weight((group or width,)), eps=1e-5, group=group)
            if self.draw(st.booleans()):
                self.pool.append(x)          # the norm may get other readers too
        n = self.draw(st.integers(1, 3))
        for _ in range(n):
            y = self.g.op("linear", x, self.weight((self.width(), x.shape[-1])))
            if self.draw(st.booleans()):
                y = y + self.weight((y.shape[-1],))
            self.pool.append(y)

    def moe(self) -> None:
        """Routed experts over a vector, often normalized first (the norm then feeds the router
        and the experts alike, as in a MoE layer)."""
        x = self.pick()
        d = x.shape[-1]
        if self.draw(st.booleans()):
            x = self.g.op("rmsnorm", x, self.weight((d,)), eps=1e-5)
            if self.draw(st.booleans()):
                self.pool.append(x)
        experts = self.draw(st.integers(1, 4))
        inter = self.width()
        logits = self.g.op("linear", x, self.weight((experts, d)))
        self.pool.append(self.g.op("moe_ffn", x, logits, self.weight((experts, inter, d)),
                                   self.weight((experts, inter, d)), self.weight((experts, d, inter)),
                                   top_k=self.draw(st.integers(1, experts)), norm_topk=self.draw(st.booleans())))

    def unary(self) -> None:
        x = self.pick()
        op = self.draw(st.sampled_from(UNARY))
        attrs = {}
        if op == "scale":
            attrs["factor"] = self.draw(st.sampled_from([0.5, -1.25, 2.0, 0.125]))
        elif op == "softcap":
            attrs["cap"] = self.draw(st.sampled_from([1.0, 3.0, 30.0]))
        self.pool.append(self.g.op(op, x, **attrs))

    def binary(self) -> None:
        a = self.pick()
        if self.draw(st.booleans()):
            b = self.weight((a.shape[-1],))
        else:
            b = self.pick(a.shape[-1])
        if self.draw(st.booleans()):
            a, b = b, a
        op = self.draw(st.sampled_from(["add", "mul"]))
        self.pool.append(self.g.op(op, a, b))

    def _rope(self, y: Value, hd: int) -> Value:
        half = self.draw(st.integers(1, hd // 2))      # partial rotary when < hd / 2
        return self.g.op("rope", y, self.get_pos(), self.get_inv_freq(half), head_dim=hd,
                         interleaved=self.draw(st.booleans()))

    def rope(self) -> None:
        x = self.pick()
        hd = 2 * self.draw(st.integers(1, 3))
        heads = self.draw(st.integers(1, 3))
        y = self.g.op("linear", x, self.weight((heads * hd, x.shape[-1])))
        self.pool.append(self._rope(y, hd))

    def attention(self, rows: int) -> None:
        x = self.pick()
        if self.draw(st.booleans()):
            x = self.g.op("rmsnorm", x, self.weight((x.shape[-1],)), eps=1e-5)
        hd = 2 * self.draw(st.integers(1, 3))
        kvh = self.draw(st.integers(1, 2))
        h = kvh * self.draw(st.integers(1, 2))
        q = self.g.op("linear", x, self.weight((h * hd, x.shape[-1])))
        k = self.g.op("linear", x, self.weight((kvh * hd, x.shape[-1])))
        v = self.g.op("linear", x, self.weight((kvh * hd, x.shape[-1])))
        if self.draw(st.booleans()):
            q, k = self._rope(q, hd), self._rope(k, hd)
        self.wid += 1
        kc = self.g.op("kv_write", self.g.state(f"kcache{self.wid}", ("S", kvh * hd)), k, self.get_pos())
        vc = self.g.op("kv_write", self.g.state(f"vcache{self.wid}", ("S", kvh * hd)), v, self.get_pos())
        a = self.g.op("attention", q, kc, vc, self.get_pos(), n_heads=h, n_kv_heads=kvh, head_dim=hd,
                      scale=hd ** -0.5, window=self.draw(st.sampled_from([0, 0, 2])))
        self.pool.append(a)


@st.composite
def random_graphs(draw, min_blocks: int = 2, max_blocks: int = 7, attention: bool = True) -> Case:
    b = _Builder(draw, "random")
    T = draw(st.integers(1, 4))
    start = draw(st.integers(0, 3))
    rows = start + T + draw(st.integers(0, 2))
    x = b.g.input("x", ("T", b.width(2, 13)))
    b.pool.append(x)
    blocks = ["linears", "linears", "unary", "binary", "rope", "moe"] + (["attention"] if attention else [])
    b.linears()                                     # at least one GEMV
    for _ in range(draw(st.integers(min_blocks - 1, max_blocks - 1))):
        kind = draw(st.sampled_from(blocks))
        b.attention(rows) if kind == "attention" else getattr(b, kind)()
    outs = {"out": b.pool[-1]}
    extra = [v for v in b.pool[1:-1] if b.g.nodes[v.name].op != "rmsnorm"]
    if extra and draw(st.booleans()):
        outs["mid"] = draw(st.sampled_from(extra))   # a value that is also an output mid-graph
    end = draw(st.sampled_from(["none", "softmax", "argmax"]))
    if end != "none":
        outs[end] = b.g.op(end, draw(st.sampled_from(b.pool[1:])))
    outs = {k: v for k, v in outs.items() if b.g.nodes[v.name].op != "rmsnorm"} or {
        "out": b.g.op("scale", b.pool[-1], factor=1.0)}
    b.g.output(**outs)

    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    weights = {}
    for node in b.g.sources("weight"):
        if len(node.shape) == 1:
            weights[node.name] = (1.0 + 0.3 * rng.standard_normal(node.shape)).astype(np.float32)
        else:
            weights[node.name] = (rng.standard_normal(node.shape) / np.sqrt(node.shape[-1])).astype(np.float32)
    feeds = {"x": rng.standard_normal((T, x.shape[-1])).astype(np.float32)}
    if b.pos is not None:
        feeds["pos"] = np.arange(start, start + T, dtype=np.int32)
    state = {n.name: rng.standard_normal((rows, n.shape[-1])).astype(np.float32)
             for n in b.g.sources("state")}
    return Case(b.g, weights, feeds, state, T)


# ---- tiny model configs ---------------------------------------------------------------------------

@st.composite
def tiny_llama_configs(draw) -> dict:
    """A Hugging Face style config.json dict of a tiny Llama/Mistral (the presets' structure)."""
    kvh = draw(st.integers(1, 2))
    heads = kvh * draw(st.integers(1, 3))
    hd = 2 * draw(st.integers(1, 4))
    d = dict(architectures=[draw(st.sampled_from(["LlamaForCausalLM", "MistralForCausalLM"]))],
             vocab_size=draw(st.integers(5, 40)),
             hidden_size=draw(st.sampled_from([heads * hd, draw(st.integers(3, 17))])),
             intermediate_size=draw(st.integers(1, 23)),
             num_hidden_layers=draw(st.integers(1, 2)),
             num_attention_heads=heads, num_key_value_heads=kvh, head_dim=hd,
             rms_norm_eps=1e-5, rope_theta=draw(st.sampled_from([10000.0, 500000.0])),
             tie_word_embeddings=draw(st.booleans()),
             attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()),
             max_position_embeddings=64)
    if draw(st.booleans()):
        d["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    if d["architectures"][0] == "MistralForCausalLM" and draw(st.booleans()):
        d["sliding_window"] = draw(st.integers(1, 3))
    return d


def model_weights(graph: Graph, seed: int) -> dict:
    """Random float32 weights that keep activations O(1): norms near 1, N(0, 1/fan_in) matrices."""
    rng = np.random.default_rng(seed)
    out = {}
    for node in graph.sources("weight"):
        if len(node.shape) == 1:
            w = 1.0 + 0.3 * rng.standard_normal(node.shape) if "norm" in node.name else \
                0.1 * rng.standard_normal(node.shape)
        elif "embed_tokens" in node.name:
            w = rng.standard_normal(node.shape)
        else:
            w = rng.standard_normal(node.shape) / np.sqrt(node.shape[-1])
        out[node.name] = w.astype(np.float32)
    return out

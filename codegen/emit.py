"""Code generation: one CUDA source per scheduled kernel, rendered from its family's template."""
from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path

import jinja2
import networkx as nx
import numpy as np

from ..dsl import Kind, get
from ..errors import FuselmError
from . import attention, gemm, gemv, moe, rowwise
from .kernel import KernelSource, Launch, Variant
from .knobs import env_set
from .params import Params, storage_of

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = {"gemv": gemv, "gemm": gemm, "rowwise": rowwise, "attention": attention, "moe": moe}
# Kernels that let the next one be scheduled before they wait (common.cuh: grid_release): row-wise
# and attention split + combine have few blocks, so the next kernel's blocks take no SM slots they
# would need, and the GEMV after them starts its weight stream sooner (measured: 4k context 1-2%
# faster, Gemma-2's post-norms 2%). Not the one-launch attention ("attention_single"): the O
# projection's early loads then compete with its own (short contexts 1-2% slower).
# FUSELM_EARLY_RELEASE lists them, comma-separated ("0": none).
EARLY_RELEASE = env_set("FUSELM_EARLY_RELEASE", "rowwise,attention", {"rowwise", "attention", "attention_single"},
                        "kernel kinds")


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja environment over codegen/templates (strict: an undefined variable is an error)."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), trim_blocks=True,
                              lstrip_blocks=True, undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def headers() -> dict[str, str]:
    """The .cuh helpers, handed to NVRTC in memory."""
    return {p.name: p.read_text() for p in sorted(TEMPLATES.glob("*.cuh"))}


def generate(G: nx.DiGraph, rows: int, weight_bytes: int = 2, tokens: int = 1) -> list[KernelSource]:
    """CUDA for every launch of the compiled graph `G`, with a KV cache of `rows` positions, for
    steps of `tokens` tokens: 1 (decode), or a chunk of a prompt (batched prefill: gemv kernels
    in their gemm form, attention one block per KV head and token; see prefill_unsupported)."""
    if tokens > 1 and (why := prefill_unsupported(G, tokens)):
        raise FuselmError(f"no steps of {tokens} tokens: {why}")
    out = []
    for launch in G.graph["schedule"]:
        params = Params(G)
        family = "gemm" if launch["family"] == "gemv" and tokens > 1 else launch["family"]
        mod = FAMILIES[family]
        if mod is attention:
            ctx = mod.context(G, launch, params, rows, tokens)
        elif mod in (gemm, moe):
            ctx = mod.context(G, launch, params, tokens)
        else:
            ctx = mod.context(G, launch, params)
        body = environment().get_template(f"{family}.cu.j2").render(
            name="KERNEL", params=params.decls, early_release=EARLY_RELEASE, **ctx)
        name = _name(family, ctx, body)
        body = body.replace("KERNEL", name)
        if family == "attention" and tokens > 1:
            launches = [Launch(f"{name}_prefill", (ctx["KV"], "T"), ctx["single_threads"], params.values)]
        elif family == "attention":
            launches = [Launch(f"{name}_split", (ctx["KV"], ctx["nchunk"]), ctx["threads"], params.values),
                        Launch(f"{name}_combine", (ctx["H"], 1), ctx["combine_threads"], params.values)]
        elif family == "moe":
            launches = [Launch(f"{name}_up", (ctx["grid_up"], 1), ctx["threads"], params.values),
                        Launch(f"{name}_down", (ctx["grid_down"], 1), ctx["threads"], params.values)]
        else:
            launches = [Launch(name, (ctx["grid"], ctx.get("splits", 1)), ctx["threads"], params.values)]
            if ctx.get("staged"):   # the gemm's vectors first, one block per token
                launches.insert(0, Launch(f"{name}_stage", (ctx["tokens"], 1), ctx["stage_threads"], params.values))
        read, written = _traffic(G, launch, rows, weight_bytes, tokens)
        k = KernelSource(name, family, body, launch["nodes"], launches, launch["layer"],
                         read, written, ctx.get("workspace_floats", 0), ctx.get("slab_floats", 0),
                         ctx.get("tile_counts", 0), ctx.get("staged_floats", 0))
        if family == "attention" and tokens == 1:
            k.variants = _attention_variants(name, ctx, params.values)
            k.notes["passes"] = {"split": ctx["split_pass"], "one launch": ctx["single_pass"],
                                 **({"wide split": ctx["wide"]["pass"]} if ctx["wide"] else {})}
        out.append(k)
    return out


def prefill_unsupported(G: nx.DiGraph, tokens: int) -> str | None:
    """Why the compiled graph `G` cannot run steps of `tokens` tokens (generate(tokens > 1)), or None."""
    for launch in G.graph["schedule"]:
        family = {"gemv": gemm, "moe": moe}.get(launch["family"])
        if family and (why := family.unsupported(G, launch, tokens)):
            return f"{launch['kernel']}: {why}"
    return None


def _attention_variants(name: str, ctx: dict, args: list[str]) -> list[Variant]:
    """Below single_until, one launch walking the whole context replaces split + combine; where
    the split's grid outgrows one wave, the wide split's (attention.wide_split) takes over."""
    out = []
    if ctx["single_until"] > 0:
        out.append(Variant("single", ctx["single_until"],
                           [Launch(f"{name}_single", (ctx["KV"], 1), ctx["single_threads"], args)],
                           "attention in one launch per layer, a block per KV head (<kernel>_single)"))
    wide = ctx["wide"]
    if wide and wide["from"] > ctx["single_until"]:
        split, combine = (Launch(f"{name}_{kind}", grid, threads, args) for kind, grid, threads in
                          (("split", (ctx["KV"], ctx["nchunk"]), ctx["threads"]),
                           ("combine", (ctx["H"], 1), ctx["combine_threads"])))
        out.append(Variant("split", wide["from"], [split, combine], "split + combine, as beyond the wide split"))
        out.append(Variant("wide", wide["until"],
                           [Launch(f"{name}_split_wide", (ctx["KV"], wide["nchunk"]), wide["threads"], args),
                            Launch(f"{name}_combine_wide", (ctx["H"], 1), ctx["combine_threads"], args)],
                           f"split + combine in chunks of {wide['chunk']} positions, one wave (<kernel>_split_wide)"))
    return out


SAMPLER_BLOCKS = 32   # blocks sharing the argmax over the vocabulary (one block took 26 us/token)


def sampler(vocab: int) -> KernelSource:
    """The sampling kernel that ends every decode step (see templates/sample.cu.j2). Its launch
    reads a runtime buffer "sampler_scratch" of sampler_scratch_words(vocab) zeroed uint32."""
    body = environment().get_template("sample.cu.j2").render(name="KERNEL", V=vocab, blocks=SAMPLER_BLOCKS)
    name = f"sample_v{vocab}"
    return KernelSource(name, "sample", body.replace("KERNEL", name), ["logits"],
                        [Launch(name, (SAMPLER_BLOCKS, 1), 1024,
                                ["logits", "seen", "sampling_args", "ids", "pos", "sampler_scratch"])],
                        None, vocab * 4, 8)


def sampler_scratch_words() -> int:
    """uint32 words of the sampler's scratch: a value and an index per block, and a counter."""
    return 2 * SAMPLER_BLOCKS + 1


def _name(family: str, ctx: dict, body: str) -> str:
    """family + its main shape constants + a hash of the body: same structure, same name."""
    digest = hashlib.sha1(body.encode()).hexdigest()[:8]
    if family in ("gemv", "gemm"):
        shape = f"k{ctx['K']}_" + "_".join(f"{len(z['members'])}x{z['N']}" for z in ctx["zips"])
        shape = ("norm_" if ctx["prologue"] else "") + shape + (f"_t{ctx['tokens']}" if family == "gemm" else "")
    elif family == "attention":
        shape = f"h{ctx['H']}_kv{ctx['KV']}_d{ctx['HD']}"
    elif family == "moe":
        shape = f"e{ctx['E']}_top{ctx['top_k']}_d{ctx['D']}_i{ctx['I']}"
    else:
        shape = f"{len(ctx['phases'])}ops"
    return re.sub(r"\W", "_", f"{family}_{shape}_{digest}")


def _traffic(G: nx.DiGraph, launch: dict, rows: int, weight_bytes: int, tokens: int = 1) -> tuple[int, int]:
    """Bytes a launch reads and writes per step of `tokens` tokens (KV cache counted at `rows`
    positions; activations as one token's, for a prefill step)."""
    def nbytes(v):
        d = G.nodes[v]
        shape = [1 if s == "T" else rows if s == "S" else s for s in d["shape"]]
        if any(G.nodes[n]["kind"] is Kind.EMBEDDING and G.nodes[n]["inputs"][0] == v for n in launch["nodes"]):
            shape = shape[1:]                       # an embedding reads one row of its table
        per = weight_bytes if d["op"] in ("weight", "state") else 4
        if d["op"] not in ("weight", "constant", "input", "state") and get(d["op"]).inplace_of is not None:
            per = weight_bytes
        return int(np.prod(shape)) * per
    read = sum(nbytes(v) for v in launch["reads"] if G.nodes[storage_of(G, v)]["op"] != "state"
               or launch["family"] == "attention")
    if launch["family"] == "moe" and tokens == 1:   # only the chosen experts' weights are streamed
        (n,) = launch["nodes"]
        experts = G.nodes[G.nodes[n]["inputs"][2]]["shape"][0]
        read -= sum(nbytes(w) for w in G.nodes[n]["inputs"][2:]) * (1 - G.nodes[n]["attrs"]["top_k"] / experts)
    written = sum(nbytes(v) for v in launch["writes"] if get(G.nodes[v]["op"]).inplace_of is None)
    return read, written

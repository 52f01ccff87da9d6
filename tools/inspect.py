"""`fuselm inspect`: the kernels and launch schedule fuselm generates for a model, without a GPU.

    fuselm inspect llama-3.2-1b                    the schedule as a table, then a summary
    fuselm inspect MODEL --out DIR                 every distinct kernel as DIR/<name>.cu, the headers
                                                   they include, schedule.txt and compile.sh
    fuselm inspect MODEL --json                    one JSON object: {"launches": [...], ...}
    fuselm inspect MODEL --compile --arch sm_80    also NVRTC: compile time, registers, spills, blocks
                                                   an SM holds and waves per launch
    fuselm inspect MODEL --tuning --tune gemv_warps=4   the tuning values the kernels were made with

MODEL is a preset name (models/presets.py), a Hugging Face folder or .gguf file (only its config
is read, never the weights), or a config.json file. The schedule is one decode step (T = 1 token)
with a KV cache of --ctx rows, exactly what the CUDA runtime replays per token, sampler included.

Bytes per launch come from the code generator (KernelSource.bytes_read / bytes_written, weights
at 2 bytes, activations at 4, the KV cache at --ctx rows). A kernel with several launches (the
attention split + combine) has its inputs on the first launch, its outputs on the last, and its
workspace (workspace_floats) written by the one and read by the other.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..codegen import Target, Tuning, build_program, headers, module_source
from ..codegen.attention import Pass
from ..codegen.build import ending_steps, prefill_steps
from ..codegen.nvrtc import compile_cubin, options, spills, static_smem
from ..codegen.tuning import PREFILL_STEP_RANGE
from ..errors import FuselmError

DEFAULT_CTX = 4096   # as api.load: min(model's maximum, 4096) unless --ctx is given


@dataclass
class Row:
    """One launch of the per-token schedule."""
    index: int
    kernel: str
    function: str
    family: str
    layer: int | None
    grid: tuple[int, int]
    block: int
    bytes_read: int
    bytes_written: int
    nodes: list[str]

    def as_json(self) -> dict:
        return {"index": self.index, "kernel": self.kernel, "function": self.function,
                "family": self.family, "layer": self.layer, "nodes": self.nodes,
                "grid": list(self.grid), "block": self.block, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written}


# ---- model -> config -> kernels -------------------------------------------------------------------

def load_config(model: str):
    """(DecoderConfig, description, weight formats) of a preset name (PRESET@SCHEME: its weights
    in a quantization scheme's formats), checkpoint path (the formats its tensors keep on the GPU)
    or config.json file."""
    from ..models import build_graph
    from ..models.config import DecoderConfig
    from ..models.presets import PRESETS, preset
    from ..quant.schemes import graph_formats

    path = Path(model)
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".json":
            from ..loading.json_file import read_object
            from ..models import language_model
            return DecoderConfig.from_hf(language_model(read_object(path), str(path))[0], str(path)), str(path), {}
        from ..loading.checkpoint import gpu_formats, open_checkpoint   # headers and metadata only
        ckpt = open_checkpoint(path)
        return ckpt.config, str(path), gpu_formats(ckpt, build_graph(ckpt.config))
    name, _, scheme = model.partition("@")
    if name in PRESETS:
        try:
            formats = graph_formats(build_graph(preset(name)), scheme) if scheme else {}
        except ValueError as e:
            raise FuselmError(f"'{model}': {e}") from None
        return preset(name), f"preset {model}", formats
    raise FuselmError(f"'{model}' is neither a file or folder nor a preset "
                      f"(presets: {', '.join(sorted(PRESETS))})")


def formats_text(cfg, formats: dict[str, str]) -> str:
    """How many matrices each format holds, e.g. "q4_1 x210, q8_0 x1, the rest bf16"."""
    if not formats:
        return "bf16"
    counts = {f: list(formats.values()).count(f) for f in sorted(set(formats.values()))}
    return ", ".join(f"{f} x{n}" for f, n in counts.items()) + ", the rest bf16"


def build(cfg, fuse: bool = True, ctx: int | None = None, dump: str | Path | None = None, prefill: int = 0,
          target: Target | None = None, tuning: Tuning | None = None, formats=None, ending: bool = False):
    """(compiled graph, kernels in launch order with the sampler last, ctx) as the runtime has them
    (codegen.build_program, nothing compiled); with `prefill` > 0, the batched-prefill graph's for
    steps of that many tokens (`ending`: its form that ends a prompt, with logits), or a one-line
    error saying why the model has none."""
    from ..models import build_graph

    ctx = ctx or min(cfg.max_position_embeddings, DEFAULT_CTX)
    target, tuning = target or Target(), tuning or Tuning.from_env()
    if prefill:
        steps = prefill_steps(build_graph(cfg), ctx, target, tuning, fuse, sizes=(prefill,), formats=formats)
        if isinstance(steps, str):
            raise FuselmError(f"{cfg.architecture} has no batched prefill (prompts go one token at a time): {steps}")
        if ending:
            steps = ending_steps(build_graph(cfg), ctx, target, tuning, [prefill], fuse, formats=formats)
            if not steps:
                raise FuselmError(f"{cfg.architecture} has no step of {prefill} tokens that ends a prompt")
        return steps[0].G, steps[0].kernels, ctx
    program = build_program(build_graph(cfg), ctx, target, tuning, fuse=fuse, prefill=False, compile=False,
                            dump=dump, formats=formats)
    return program.decode.G, program.decode.kernels, ctx


def schedule_rows(kernels, position: int | None = None, tokens: int = 1) -> list[Row]:
    """One Row per launch, in launch order (T in a grid is the step's `tokens`): the launches of a
    step at `position` (attention runs in one launch at short contexts), or with None the
    long-context schedule."""
    rows = []
    for k in kernels:
        launches = k.launches if position is None else k.launches_at(position)
        n, main = len(launches), _main_launch(k, launches)
        workspace = 4 * k.workspace_floats if n > 1 else 0
        for j, launch in enumerate(launches):
            read = (k.bytes_read if j == main else 0) + (workspace if j > 0 else 0)
            written = (k.bytes_written if j == n - 1 else 0) + (workspace if j < n - 1 else 0)
            grid = tuple(tokens if g == "T" else int(g) for g in launch.grid)
            rows.append(Row(len(rows), k.name, launch.function, k.family, k.layer, grid,
                            int(launch.block), read, written, list(k.nodes)))
    return rows


# ---- reports --------------------------------------------------------------------------------------

def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def table(rows: list[Row]) -> str:
    """The schedule as a fixed-width table, one line per launch."""
    head = ("#", "kernel function", "layer", "grid", "block", "read", "written", "graph nodes")
    cells = [(str(r.index), r.function, "-" if r.layer is None else str(r.layer), f"{r.grid[0]}x{r.grid[1]}",
              str(r.block), fmt_bytes(r.bytes_read), fmt_bytes(r.bytes_written), ", ".join(r.nodes))
             for r in rows]
    width = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head) - 1)]
    right = {0, 2, 4, 5, 6}

    def line(c):
        parts = [c[i].rjust(width[i]) if i in right else c[i].ljust(width[i]) for i in range(len(width))]
        return "  ".join(parts + [c[-1]]).rstrip()
    return "\n".join([line(head), line(["-" * w for w in width] + ["-" * 11])] + [line(c) for c in cells])


def _main_launch(k, launches) -> int:
    """The index of the launch that reads a kernel's weights: the one named after the kernel (a
    gemm after its vectors' stage), else the first (attention's split, a MoE's up)."""
    return next((j for j, l in enumerate(launches) if l.function in (k.name, f"{k.name}_up")), 0)


def _launch_label(function: str, kernel_name: str) -> str:
    """'attention combine' for the extra launch `<kernel name>_combine` of an attention kernel."""
    suffix = function[len(kernel_name):].lstrip("_") if function.startswith(kernel_name) else ""
    return f"{kernel_name.split('_')[0]} {suffix}" if suffix else function


def _pass_label(p: Pass) -> str:
    """A pass with where it runs (MmaPass on tensor cores, LanePass on CUDA cores) and, for an
    MmaPass with LATE_V, that its V rows go out after the queries."""
    kind = p.type.replace(", true>", ">")
    return f"{kind} on {'tensor' if p.on_tensor_cores else 'CUDA'} cores" + (", V rows after the queries" if p.late_v else "")


def summary(G, kernels, rows: list[Row], ctx: int, position: int | None = None, prefill: bool = False) -> list[str]:
    """Kernels and launches per layer (of a step at `position`, see schedule_rows), before and
    after the layers, and the arena; bytes per token for a decode step (not for a `prefill` step,
    whose codegen byte counts are per token)."""
    layers = sorted({k.layer for k in kernels if k.layer is not None})
    per_layer = {}
    for L in layers:
        ks = [k for k in kernels if k.layer == L]
        extra = [_launch_label(l.function, k.name) for k in ks
                 for launches in [k.launches if position is None else k.launches_at(position)]
                 for j, l in enumerate(launches) if j != _main_launch(k, launches)]
        kinds = Counter(extra)          # "+4 gemm stage", not the label four times
        label = f"{len(ks)}" + (" (" + ", ".join(f"+{n} {e}" for e, n in kinds.items()) + ")" if extra else "")
        per_layer[L] = label
    out = []
    counts = Counter(per_layer.values())
    if len(counts) == 1:
        out.append(f"kernels per layer: {next(iter(counts))}, x {len(layers)} layers")
    else:
        out += [f"kernels in layer {L}: {v}" for L, v in per_layer.items()]
    first_layer = next((i for i, k in enumerate(kernels) if k.layer is not None), len(kernels))
    before = kernels[:first_layer]
    after = [k for i, k in enumerate(kernels) if k.layer is None and i >= first_layer]
    for what, ks in (("before the layers", before), ("at the end", after)):
        if ks:
            n = sum(len(k.launches) for k in ks)
            out.append(f"{what}: {n} launch{'es' if n != 1 else ''}: "
                       + ", ".join(f"{k.name} ({', '.join(k.nodes)})" for k in ks))
    variants = Counter((v.until, v.note) for k in kernels for v in k.variants)
    for (until, note), n in sorted(variants.items()):
        out.append(f"at positions below {until}: {note} ({n} kernel{'s' if n != 1 else ''})")
    passes = Counter(tuple(k.passes.items()) for k in kernels if k.passes)
    for kinds, n in sorted(passes.items(), key=str):
        out.append("attention passes: " + ", ".join(f"{what} {_pass_label(p)}" for what, p in kinds)
                   + f" ({n} kernel{'s' if n != 1 else ''})")
    gemms = {k.name: k for k in kernels if k.family == "gemm"}
    for what, grid in (("split-K", "slices"), ("column tiles", "column tiles")):
        cut = {name: k.launches[-1].grid[1] for name, k in gemms.items()
               if k.launches[-1].grid[1] > 1 and (k.slab_floats > 0) == (what == "split-K")}
        if cut:   # a kernel whose blocks take part of the step's tokens slabs nothing (gemm.wgmma_plan)
            doing = "split their k" if what == "split-K" else "give a block part of the step's tokens"
            out.append(f"{what}: {len(cut)} of {len(gemms)} gemm kernels {doing} (grid: tiles x {grid}), "
                       + ", ".join(f"{name} x{n}" for name, n in sorted(cut.items())))
    total_r, total_w = sum(r.bytes_read for r in rows), sum(r.bytes_written for r in rows)
    out.append(f"launches per {'step' if prefill else 'token'}: {len(rows)} ({len(kernels)} kernels, "
               f"{len({k.name for k in kernels})} distinct)")
    if not prefill:
        out.append(f"bytes per token: {fmt_bytes(total_r)} read, {fmt_bytes(total_w)} written "
                   f"(KV cache counted at {ctx} positions)")
    out.append(f"activation arena: {G.graph['arena_bytes']:,} bytes with buffer reuse, "
               f"{G.graph['arena_bytes_no_reuse']:,} without")
    return out


def kernel_files(kernels) -> dict[str, str]:
    """File name -> text for every distinct kernel: its source headed by the graph nodes it implements
    in each layer that uses it (KernelSource.annotated() of the first use, the others listed above)."""
    uses: dict[str, list] = {}
    for k in kernels:
        uses.setdefault(k.name, []).append(k)
    files = {}
    for name, ks in uses.items():
        first = ks[0]
        launches = ", ".join(f"{l.function} <<<{'x'.join(str(g) for g in l.grid)}, {l.block}>>>"
                             for l in first.launches)
        head = [f"// launches: {launches}"]
        if len(ks) > 1:
            head.append(f"// used {len(ks)} times per token; graph nodes per use:")
            head += [f"//   layer {'-' if k.layer is None else k.layer}: {', '.join(k.nodes)}" for k in ks]
        files[f"{name}.cu"] = "\n".join(head) + "\n" + first.annotated()
    return files


def compile_script(names: list[str], arch: str) -> str:
    """compile.sh for a folder written by --out: each kernel file to a cubin with nvcc, the headers
    beside them the only include path (NVRTC takes the same options)."""
    flags = " ".join(o for o in options(arch) if not o.startswith("--gpu-architecture"))
    return ("#!/bin/sh\n# Each kernel to a cubin; the .cuh headers beside them are all they include.\n"
            f'cd "$(dirname "$0")"\nfor f in {" ".join(sorted(names))}; do\n'
            f'    nvcc -cubin -arch={arch} {flags} -I. "$f" -o "${{f%.cu}}.cubin" || exit 1\ndone\n')


# ---- NVRTC ----------------------------------------------------------------------------------------

_REGS = re.compile(r"Used (\d+) registers")
_STACK = re.compile(r"(\d+) bytes stack frame")


def compile_report(kernels, target: Target, tokens: int = 1) -> dict:
    """Compile the whole module with NVRTC (no cache): seconds, and per function registers, stack
    frame, spill and static shared-memory bytes from ptxas' resource report, and for its first
    launch the blocks an SM of `target` holds at once and the waves its grid takes (a step of
    `tokens` tokens)."""
    arch = target.arch
    t0 = time.perf_counter()
    cubin, log, _ = compile_cubin(module_source(kernels), headers(), options(arch, verbose=True),
                                  use_cache=False)
    seconds = time.perf_counter() - t0
    functions, fn = {}, None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line) or re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            fn = m.group(1)
            functions.setdefault(fn, {})
        elif fn:
            for key, rx in (("registers", _REGS), ("stack_bytes", _STACK)):
                r = rx.search(line)
                if r:
                    functions[fn][key] = int(r.group(1))
    for f, b in spills(log).items():
        functions.setdefault(f, {})["spill_bytes"] = b
    for f, b in static_smem(log).items():
        functions.setdefault(f, {})["static_smem"] = b
    launches = {}
    for launch in (l for k in kernels for l in k.all_launches()):
        launches.setdefault(launch.function, launch)
    for f, v in functions.items():
        launch = launches.get(f)
        if launch and "registers" in v:
            blocks = math.prod(tokens if g == "T" else g for g in launch.grid)
            v["blocks_per_sm"] = target.blocks_per_sm(launch.block, v["registers"], v.get("static_smem", 0) + launch.smem)
            v["waves"] = round(blocks / max(1, v["blocks_per_sm"] * target.sms), 2)
    return {"arch": arch, "seconds": round(seconds, 3), "cubin_bytes": len(cubin), "functions": functions}


def compile_lines(rep: dict) -> list[str]:
    fns = rep["functions"]
    spilling = {f: v["spill_bytes"] for f, v in fns.items() if v.get("spill_bytes")}
    out = [f"NVRTC {rep['arch']}: {len(fns)} functions compiled in {rep['seconds']:.2f} s "
           f"({rep['cubin_bytes']:,}-byte cubin); "
           + (f"{len(spilling)} spill: " + ", ".join(f"{f} {b} B" for f, b in spilling.items())
              if spilling else "no spills")]
    w = max((len(f) for f in fns), default=0)
    out += [f"  {f.ljust(w)}  {v.get('registers', '?'):>3} regs  {v.get('stack_bytes', '?'):>4} B stack  "
            f"{v.get('spill_bytes', '?'):>4} B spilled"
            + (f"  {v['blocks_per_sm']:>2} blocks/SM  {v['waves']:>5.2f} waves" if "waves" in v else "")
            for f, v in sorted(fns.items())]
    return out


# ---- command --------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """`fuselm inspect`'s options."""
    p.add_argument("model", metavar="MODEL",
                   help="preset name, HF checkpoint folder, .gguf file or config.json (weights are not read)")
    p.add_argument("--out", metavar="DIR", help="write every distinct kernel as DIR/<name>.cu with the "
                   "headers it includes, the schedule as DIR/schedule.txt and DIR/compile.sh")
    p.add_argument("--json", action="store_true", help="print the schedule as JSON")
    p.add_argument("--arch", default="sm_90", help="GPU architecture the kernels are made for (default sm_90)")
    p.add_argument("--sms", type=int, default=Target().sms, metavar="N",
                   help=f"SMs of that GPU: split-K and the attention wave (default {Target().sms}, the H200's)")
    add_tune_argument(p)
    p.add_argument("--tuning", action="store_true", help="list the tuning values the kernels were made with")
    p.add_argument("--compile", action="store_true",
                   help="compile the module with NVRTC: time, and per function registers, spills, "
                        "the blocks an SM holds and the waves of its grid")
    p.add_argument("--no-fuse", action="store_true", help="the schedule without fusion")
    p.add_argument("--dump", metavar="DIR", help="write the graph after each compiler pass (.txt, .dot)")
    p.add_argument("--ctx", type=int, metavar="N", help="KV cache rows the attention kernels are built "
                   "for (default min(model's maximum, 4096))")
    p.add_argument("--position", type=int, metavar="P", help="the schedule of a step at position P "
                   "(attention's launches depend on it; default: the long-context schedule)")
    p.add_argument("--tp", type=int, metavar="N", help="the model split over N tensor-parallel ranks "
                   "(compiler/partition.py): heads, weights and all-reduces per rank")
    p.add_argument("--prefill", action="store_true", help="the batched-prefill graph (a step of a "
                   "prompt's tokens, what the KV caches need) instead of the decode step")
    p.add_argument("--prefill-tokens", type=int, metavar="N", help="with --prefill: a step of N tokens "
                   "(default: the largest step size)")
    p.add_argument("--prefill-end", action="store_true", help="with --prefill: the step's form that ends "
                   "a prompt (the whole graph, with every token's logits)")


def add_tune_argument(p: argparse.ArgumentParser) -> None:
    """--tune, shared by inspect, bench and trace."""
    p.add_argument("--tune", metavar="NAME=V,...", default="",
                   help="tuning values to change, over $FUSELM_TUNE (see codegen/tuning.py; inspect --tuning lists them)")


def tuning_of(args: argparse.Namespace) -> Tuning:
    """The defaults, $FUSELM_TUNE, then --tune."""
    try:
        return Tuning.parse(args.tune, Tuning.from_env())
    except FuselmError as e:
        raise FuselmError(f"--tune: {e}") from None


def writable_folder(path: str, option: str) -> Path:
    """`path` as a folder to write into, created if missing; a one-line error naming `option`
    where it is a file or cannot be written."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise FuselmError(f"{option} {path}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fuselm-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise FuselmError(f"{option} {path}: cannot write there ({e.strerror or e})") from None
    return out


def tp_lines(cfg, source: str, ranks: int) -> list[str]:
    """What partition() makes of `cfg`'s graph over `ranks` ranks, for `inspect --tp`."""
    from ..compiler.partition import partition
    from ..models import build_graph
    graph = build_graph(cfg)
    shards = partition(graph, ranks)
    g = shards[0].graph
    full = {n.name: n for n in graph.sources("weight")}
    split = sorted(shards[0].split_axes)
    per_rank = sum(2 * math.prod(n.shape) for n in g.sources("weight"))
    total = sum(2 * math.prod(n.shape) for n in full.values())
    reduces = [n for n in g.nodes.values() if n.op == "all_reduce"]
    attention = next((n for n in g.nodes.values() if n.op == "attention"), None)
    lines = [f"{source}: {cfg.architecture} over {ranks} tensor-parallel ranks (compiler/partition.py)"]
    if attention is not None:
        lines.append(f"  attention per rank: {attention.attrs['n_heads']} of {cfg.num_heads} query heads, "
                     f"{attention.attrs['n_kv_heads']} of {cfg.num_kv_heads} KV heads")
    lines += [f"  weights per rank: {per_rank / 2**30:.2f} GiB of {total / 2**30:.2f} (bf16); "
              f"{len(split)} of {len(full)} split, the rest replicated",
              f"  all-reduces per step: {len(reduces)} ({len(reduces) // max(cfg.num_layers, 1)} a layer), "
              f"{reduces[0].shape[-1] * 4 if reduces else 0} bytes a token each"]
    first = [w for w in split if ".0." in w or "layers.0." in w]
    for w in first:
        axis = shards[0].split_axes[w]
        lines.append(f"    {w}: {full[w].shape} split along axis {axis} ({_split_role(w, full[w].shape, axis)})")
    lines += [f"    {w}: {full[w].shape} on rank 0 only (added once to the all-reduced sum)"
              for w in sorted(shards[0].first_rank_only) if ".0." in w]
    return lines


def _split_role(name: str, shape: tuple, axis: int) -> str:
    """What splitting weight `name` of `shape` along `axis` makes of it (compiler/partition.py)."""
    if len(shape) == 3 or ".experts." in name:   # experts: gate/up [E, I, D], biases [E, I], down [E, D, I]
        return "each expert's intermediate rows" if axis == 1 else "each expert's intermediate columns"
    if len(shape) == 2:
        return "output rows: column-parallel" if axis == 0 else "input columns: row-parallel"
    return "with its rows"


def main(args: argparse.Namespace) -> int:
    """`fuselm inspect`: print (or write with --out / --dump) what the compiler makes of a model."""
    if args.ctx is not None and args.ctx <= 0:
        raise FuselmError(f"--ctx must be a positive number of tokens, got {args.ctx}")
    if args.position is not None and args.position < 0:
        raise FuselmError(f"--position must be 0 or more, got {args.position}")
    if not re.fullmatch(r"sm_\d+[a-z]?", args.arch):
        raise FuselmError(f"--arch must look like sm_90, got '{args.arch}'")
    target = Target(args.arch, args.sms)
    tuning = tuning_of(args)
    tokens, prefill = 1, args.prefill
    if args.prefill_tokens is not None and not prefill:
        raise FuselmError("--prefill-tokens needs --prefill")
    if args.prefill_end and not prefill:
        raise FuselmError("--prefill-end needs --prefill")
    if prefill:
        tokens = tuning.prefill_tokens[0] if args.prefill_tokens is None else args.prefill_tokens
        low, high = PREFILL_STEP_RANGE
        if tokens % 8 or not low <= tokens <= high:
            raise FuselmError(f"--prefill-tokens takes a step of {low} to {high} tokens, a multiple of 8; got {tokens}")
    out = writable_folder(args.out, "--out") if args.out else None
    if args.dump:
        writable_folder(args.dump, "--dump")
    cfg, source, formats = load_config(args.model)
    if args.tp is not None:
        print("\n".join(tp_lines(cfg, source, args.tp)))
        return 0
    G, kernels, ctx = build(cfg, fuse=not args.no_fuse, ctx=args.ctx, dump=args.dump,
                            prefill=tokens if prefill else 0, target=target, tuning=tuning, formats=formats,
                            ending=args.prefill_end)
    rows = schedule_rows(kernels, args.position, tokens)
    at = f" at position {args.position}" if args.position is not None else ""
    step = (f"a prefill step of {tokens} tokens{' ending a prompt' if args.prefill_end else ''}" if prefill
            else "one decode token")
    title = (f"{source}: {cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
             f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, vocab {cfg.vocab_size}; "
             f"{'fused' if not args.no_fuse else 'unfused'}, ctx {ctx}; {step}{at}; "
             f"{target.arch} with {target.sms} SMs; weights {formats_text(cfg, formats)}")
    lines = summary(G, kernels, rows, ctx, args.position, prefill)
    if args.tuning:
        lines += ["tuning:"] + ["  " + line for line in tuning.lines()]
    rep = compile_report(kernels, target, tokens) if args.compile else None
    if out:
        files = kernel_files(kernels)
        for name, text in {**files, **headers()}.items():
            (out / name).write_text(text)
        (out / "compile.sh").write_text(compile_script(list(files), args.arch))
        (out / "schedule.txt").write_text("\n".join([title, "", table(rows), "", *lines,
                                                     *(compile_lines(rep) if rep else [])]) + "\n")
    if args.json:
        doc = {"model": source, "architecture": cfg.architecture, "fused": not args.no_fuse, "ctx": ctx,
               "tokens": tokens, "position": args.position, "arch": target.arch, "sms": target.sms,
               "tuning": tuning.changed(), "launches": [r.as_json() for r in rows],
               "arena_bytes": G.graph["arena_bytes"], "arena_bytes_no_reuse": G.graph["arena_bytes_no_reuse"]}
        if rep:
            doc["compile"] = rep
        print(json.dumps(doc, indent=1))
        return 0
    if out:
        print(title)
        print(f"wrote {len(files)} kernels, their {len(headers())} headers, compile.sh and schedule.txt to {args.out}")
    else:
        print(title + "\n\n" + table(rows) + "\n")
    print("\n".join(lines + (compile_lines(rep) if rep else [])))
    return 0

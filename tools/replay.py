"""Replay manifest: a hash of every preset's generated CUDA (decode and prefill steps), so that a
refactor proves it leaves the generated code unchanged, and a change meant to alter code shows
which kernels it altered.

    python -m fuselm.tools.replay            compare with the checked-in manifest, list what differs
    python -m fuselm.tools.replay --write    refresh the manifest (a change that means to alter code)

The manifest (tests/replay_manifest.json) holds the sha256 of the kernels the runtime launches
outside the schedules (the batch steps' row picks) and, per preset and step (decode; prefill_T for a
prefill step of T tokens; prefill_end_T for its form that ends a prompt, with logits; batch_T for
a continuous-batching step of T tokens), the sha256 of each distinct kernel's source and of the launch schedule
(functions, grids, blocks, arguments), and the sha256 of every .cuh header the kernels include.
Generated at the default tuning (codegen's Tuning) for sm_90, with each preset's default context;
QUANTIZED adds presets with weights in a quantization scheme's formats ("preset@scheme").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

MANIFEST = Path(__file__).resolve().parent.parent / "tests" / "replay_manifest.json"
QUANTIZED = ["llama-3.1-8b@q4_k_m", "llama-3.2-1b@q4_0", "llama-3.2-1b@q4_1", "llama-3.2-1b@q6_k",
             "llama-3.2-1b@q8_0", "smollm2-135m@q4_1", "gpt-oss-20b@mxfp4"]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _step_record(kernels) -> dict:
    """{"kernels": {name: sha}, "schedule": sha} of one step's kernels."""
    sources = {k.name: _sha(k.source) for k in kernels}
    launches = [(l.function, [str(g) for g in l.grid], l.block, l.args)
                for k in kernels for l in k.all_launches()]
    return {"kernels": dict(sorted(sources.items())), "schedule": _sha(json.dumps(launches))}


def steps_of(name: str) -> dict[str, list]:
    """Step label -> the kernels generated for preset `name` ("preset" or "preset@scheme") at its
    default context."""
    from ..codegen import Target, Tuning, build_program
    from ..codegen.build import build_batch
    from ..models import build_graph
    from ..models.presets import preset
    from ..quant.schemes import graph_formats

    base, _, scheme = name.partition("@")
    cfg = preset(base)
    graph = build_graph(cfg)
    ctx, formats = min(cfg.max_position_embeddings, 4096), graph_formats(graph, scheme) if scheme else None
    program = build_program(graph, ctx, Target(), Tuning(), compile=False, formats=formats)
    batch = build_batch(graph, ctx, Target(), Tuning(), formats=formats, compile=False)
    return {"decode": program.decode.kernels, **{f"prefill_{s.tokens}": s.kernels for s in program.prefill},
            **{f"prefill_end_{s.tokens}": s.kernels for s in program.prefill_ends},
            **{f"batch_{s.tokens}": s.kernels for s in batch}}


def manifest() -> dict:
    """The manifest of the tree as it is now (see the module docstring)."""
    from ..codegen import headers
    from ..codegen.sample import generate_row_picks
    from ..models import ARCHITECTURES
    from ..models.presets import PRESETS

    presets = sorted(n for n, d in PRESETS.items() if d["architectures"][0] in ARCHITECTURES) + QUANTIZED
    name, source = generate_row_picks()
    return {"headers": {n: _sha(t) for n, t in sorted(headers().items())},
            "runtime": {name: _sha(source)},
            "presets": {n: {step: _step_record(ks) for step, ks in steps_of(n).items()} for n in presets}}


def differences(old: dict, new: dict) -> list[str]:
    """One line per header, step schedule or kernel that differs between two manifests."""
    out = []
    for h in sorted(set(old["headers"]) | set(new["headers"])):
        if old["headers"].get(h) != new["headers"].get(h):
            out.append(f"header {h}: {old['headers'].get(h, 'absent')} -> {new['headers'].get(h, 'absent')}")
    a, b = old.get("runtime", {}), new.get("runtime", {})
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"runtime kernel {k}: {a.get(k, 'absent')} -> {b.get(k, 'absent')}")
    for p in sorted(set(old["presets"]) | set(new["presets"])):
        a, b = old["presets"].get(p, {}), new["presets"].get(p, {})
        for step in sorted(set(a) | set(b)):
            sa, sb = a.get(step), b.get(step)
            if sa is None or sb is None:
                out.append(f"{p} {step}: {'added' if sa is None else 'removed'}")
                continue
            if sa["schedule"] != sb["schedule"]:
                out.append(f"{p} {step}: launch schedule changed")
            for k in sorted(set(sa["kernels"]) - set(sb["kernels"])):
                out.append(f"{p} {step}: kernel {k} gone")
            for k in sorted(set(sb["kernels"]) - set(sa["kernels"])):
                out.append(f"{p} {step}: kernel {k} new")
            for k in sorted(set(sa["kernels"]) & set(sb["kernels"])):
                if sa["kernels"][k] != sb["kernels"][k]:
                    out.append(f"{p} {step}: kernel {k} source changed")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fuselm.tools.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="refresh the checked-in manifest")
    args = p.parse_args(argv)
    new = manifest()
    if args.write:
        MANIFEST.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        print(f"wrote {MANIFEST}")
        return 0
    diff = differences(json.loads(MANIFEST.read_text()), new)
    print("\n".join(diff) if diff else "generated code unchanged")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())

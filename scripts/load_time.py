"""How long a quantized GGUF takes to load onto the GPU, and the host and GPU memory it takes.

    python scripts/load_time.py --like .gpu_fixtures/smollm2-q4_1-6layers.gguf [--preset llama-3.1-8b]
        [--file /tmp/llama-3.1-8b-q4_k_m.gguf] [--json OUT] [--profile]

Writes (once) a GGUF of the preset's shapes in llama.cpp's Q4_K_M formats with random blocks,
its tokenizer and chat template copied from the `--like` file (so its vocabulary, and the
embedding and LM head rows, are that file's), then loads it with `fuselm.load(device="cuda")` in
fresh processes: the first with the page cache and the kernel cache cold, the next ones warm. Each
prints the load time, the file's GB/s, the process's peak resident memory and the GPU memory the
engine holds; `--profile` adds a warm run under cProfile and prints its costliest calls. No file
needs downloading, so it runs on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import gguf
import numpy as np
from gguf import GGUFValueType as T

Q = gguf.GGMLQuantizationType
# where each block's f16 scales sit (random bytes there would be NaN or infinite)
F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(kind, rows: int, k: int, rng) -> np.ndarray:
    """uint8 [rows, bytes] of GGUF blocks of `kind`: random codes, small finite f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        raw[..., at: at + 2] = np.full((rows, k // block), 1e-3, "<f2").view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


def write_like(like: str, preset_name: str, dst: str) -> None:
    """A GGUF of `preset_name`'s shapes in Q4_K_M (llama.cpp's choice per tensor), whose metadata
    but the shapes and every tokenizer field come from `like`."""
    from fuselm.models.presets import preset
    from fuselm.quant.schemes import _more_bits
    cfg = preset(preset_name)
    r = gguf.GGUFReader(like)
    arch = r.fields["general.architecture"].contents()
    vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    D, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if D % 256 or I % 256 or (H * hd) % 256:
        sys.exit(f"{preset_name}: rows of {D}, {I} and {H * hd} weights are not whole Q4_K super-blocks of 256")
    shapes = {f"{arch}.embedding_length": D, f"{arch}.feed_forward_length": I, f"{arch}.block_count": L,
              f"{arch}.attention.head_count": H, f"{arch}.attention.head_count_kv": KV,
              f"{arch}.context_length": cfg.max_position_embeddings, f"{arch}.rope.dimension_count": hd}
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        if key in shapes:
            w.add_key_value(key, shapes[key], T.UINT32)
        elif kind == T.ARRAY:
            w.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), kind)
    rng = np.random.default_rng(0)

    def matrix(name, rows, k, kind=Q.Q4_K):
        w.add_tensor(name, random_blocks(kind, rows, k, rng), raw_dtype=kind)

    def norm(name, n):
        w.add_tensor(name, np.ones(n, np.float32))
    matrix("token_embd.weight", vocab, D)
    for i in range(L):
        more = Q.Q6_K if _more_bits(i, L) else Q.Q4_K
        norm(f"blk.{i}.attn_norm.weight", D)
        matrix(f"blk.{i}.attn_q.weight", H * hd, D)
        matrix(f"blk.{i}.attn_k.weight", KV * hd, D)
        matrix(f"blk.{i}.attn_v.weight", KV * hd, D, more)
        matrix(f"blk.{i}.attn_output.weight", D, H * hd)
        norm(f"blk.{i}.ffn_norm.weight", D)
        matrix(f"blk.{i}.ffn_gate.weight", I, D)
        matrix(f"blk.{i}.ffn_up.weight", I, D)
        matrix(f"blk.{i}.ffn_down.weight", D, I, more)
    norm("output_norm.weight", D)
    matrix("output.weight", vocab, D, Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# peak resident memory counts the mapped file's pages the process touched; the anonymous part
# (heap, pinned buffers: what loading itself holds beyond the page cache) is sampled every 5 ms
MEASURE = """
import faulthandler, json, resource, sys, threading, time
faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)   # a hang prints every thread's stack
def anonymous_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
peak, done = [0], threading.Event()
def sample():
    while not done.wait(0.005):
        peak[0] = max(peak[0], anonymous_kib())
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
import cupy, fuselm
t1 = time.perf_counter()
if sys.argv[3] == "1":   # where the load's time goes: the calls taking the most of it, to stderr
    import cProfile, pstats
    prof = cProfile.Profile()
    model = prof.runcall(fuselm.load, sys.argv[1], device="cuda", ctx=4096, progress=False)
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
else:
    model = fuselm.load(sys.argv[1], device="cuda", ctx=4096, progress=False)
cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
done.set()
free, total = cupy.cuda.runtime.memGetInfo()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "peak_anon_gib": peak[0] / 2**20,
                  "gpu_pool_gib": cupy.get_default_memory_pool().total_bytes() / 2**30, "gpu_used_gib": (total - free) / 2**30}))
"""
RUN_LIMIT_S = 120   # a load that takes longer has hung (the cold 8B Q4_K_M took 14 s on an H100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, help="a llama-architecture GGUF whose tokenizer the file takes")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--file", default=None, help="where the GGUF goes (default /tmp/PRESET-q4_k_m.gguf)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="one more warm run under cProfile: its top calls")
    a = p.parse_args()
    path = a.file or f"/tmp/{a.preset}-q4_k_m.gguf"
    if not os.path.exists(path):
        t = time.perf_counter()
        write_like(a.like, a.preset, path)
        print(f"wrote {path}: {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s", flush=True)
    size = os.path.getsize(path)
    runs = []
    for i in range(a.runs + a.profile):
        profiled = i == a.runs
        try:
            out = subprocess.run([sys.executable, "-c", MEASURE, path, str(RUN_LIMIT_S - 20), str(int(profiled))],
                                 capture_output=True,
                                 text=True, timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            sys.exit(f"run {i}: no load after {RUN_LIMIT_S} s")
        if out.returncode:
            sys.exit(f"run {i}: load failed:\n{out.stderr[-6000:]}")
        run = json.loads(out.stdout.strip().splitlines()[-1])
        if profiled:
            print(f"profiled warm run: load {run['load_s']:.2f} s\n{out.stderr[-12000:]}", flush=True)
            continue
        runs.append(run)
        print(f"run {i} ({'cold' if i == 0 else 'warm'}): load {run['load_s']:.2f} s ({size / 1e9 / run['load_s']:.2f} GB/s "
              f"of the file), peak host memory {run['peak_rss_gib']:.2f} GiB "
              f"(anonymous {run['peak_anon_gib']:.2f} GiB), GPU pool {run['gpu_pool_gib']:.2f} GiB, "
              f"GPU in use {run['gpu_used_gib']:.2f} GiB (import {run['import_s']:.2f} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"preset": a.preset, "file_bytes": size, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

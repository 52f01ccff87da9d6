"""What kernels are generated for: the GPU (`Target`, facts read from the device) and the tuning
numbers (`Tuning`, every one in this file, validated, overridden in one place).

    Tuning()                                   the defaults (measured best on the H200)
    Tuning.parse("gemv_warps=4,attn_wide_warps=0")
    Tuning.from_env()                          the defaults, overridden by $FUSELM_TUNE (same syntax)
    fuselm inspect MODEL --tune gemv_warps=4   (bench and trace take --tune too)

A Tuning is passed explicitly to codegen.build_program and from there to every kernel family,
so a scope that wants other values builds with another Tuning; nothing reads it from globals.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from ..errors import FuselmError

SMEM_STATIC = 48 * 1024   # static shared memory a kernel may declare (CUDA's limit without opt-in)


@dataclass(frozen=True)
class Target:
    """The GPU kernels are generated for: its architecture (NVRTC's --gpu-architecture), its SM
    count, which sizes split-K and the attention split's wave, and the shared memory a block may
    opt into, which sets the wgmma gemm's pipeline depth; and what one SM holds at once (registers,
    shared memory, threads), which says how many blocks of a kernel run side by side."""
    arch: str = "sm_90"
    sms: int = 132          # the H200's: the default when inspecting without a GPU
    smem_per_block: int = 232448
    regs_per_sm: int = 65536       # per SM, the H200's too (of_device reads the GPU's own)
    smem_per_sm: int = 233472
    threads_per_sm: int = 2048

    def __post_init__(self):
        if not (self.arch.startswith("sm_") and self.arch[3:].rstrip("a").isdigit()):
            raise FuselmError(f"arch must look like sm_90, got '{self.arch}'")
        if not 1 <= self.sms <= 4096:
            raise FuselmError(f"sms must be 1 to 4096, got {self.sms}")

    @property
    def capability(self) -> int:
        """Compute capability as an integer (90 for sm_90)."""
        return int(self.arch[3:].rstrip("a"))

    def blocks_per_sm(self, threads: int, registers: int, smem: int) -> int:
        """Blocks of `threads` threads using `registers` registers a thread and `smem` bytes of
        shared memory (static and dynamic) that one SM holds at once, by CUDA's occupancy rules:
        registers are given to warps in units of 256, each block reserves 1 KiB of shared memory
        more, and an SM holds at most 32 blocks."""
        warps = -(-threads // 32)
        warp_regs = -(-max(registers, 1) * 32 // 256) * 256
        return max(0, min(32, self.threads_per_sm // (32 * warps), self.regs_per_sm // warp_regs // warps,
                          self.smem_per_sm // (smem + 1024)))

    @classmethod
    def of_device(cls) -> "Target":
        """The current CUDA device's architecture, SM count and per-SM limits."""
        import cupy
        device = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(device.id)
        return cls(f"sm_{device.compute_capability}", int(props["multiProcessorCount"]),
                   int(props["sharedMemPerBlockOptin"]), int(props["regsPerMultiprocessor"]),
                   int(props["sharedMemPerMultiprocessor"]), int(props["maxThreadsPerMultiProcessor"]))


# name -> (low, high, what it is); a power of two where the name is in POWERS_OF_TWO
_RANGES = {
    "gemv_warps": (1, 32, "warps per GEMV block"),
    "gemv_rows_per_warp": (1, 8, "rows a GEMV warp streams at once, sharing each load of the vector"),
    "gemv_warps_per_sm": (1, 1024, "streaming GEMV warps per SM before split-K stops"),
    "gemv_unroll": (1, 16, "16-byte loads in flight per GEMV lane and row"),
    "gemv_quant_rows_per_warp": (1, 8, "gemv_rows_per_warp where the weights are quantized"),
    "gemv_quant_unroll": (1, 16, "groups of 32 quantized weights in flight per GEMV lane and row"),
    "gemv_quant_blocks_per_sm": (1, 8, "float-path quantized GEMV blocks each SM must hold (registers capped to fit)"),
    "gemm_warps": (1, 8, "warps per gemm block, 16 rows of the tile each"),
    "gemm_quant_wgmma": (0, 1, "1: quantized prefill gemms on wgmma, dequantized to bf16 (0: float32-accurate mma.sync)"),
    "gemm_blocks": (1, 1 << 16, "blocks a gemm splits its k to reach"),
    "gemm_epilogue_batch": (1, 16, "epilogue rounds of a gemm block whose operand loads go out together, at most"),
    "gemm_min_chunks": (1, 1 << 10, "chunks of k (wgmma: 64-k slots) a gemm's split slice keeps at least"),
    "wgmma_copy_share": (1, 1000, "percent of a 128x256x64 wgmma slot's product time its copies take (wgmma_plan)"),
    "wgmma_block_overhead": (0, 10000, "a wgmma block's pipeline fill and epilogue, in percent of such a slot"),
    "wgmma_slab_cost": (0, 100000, "a split-K slab's write or read, in percent of such a slot"),
    "wgmma_min_columns": (16, 256, "fewest of a step's tokens a wgmma block takes (a column tile)"),
    "wgmma_vector_copy": (0, 4, "how wgmma producers copy the vectors: 0 cp.async, 1 a bulk copy a slot, "
                                "2 or 4 one multicast to a cluster of that many row tiles"),
    "attn_warps": (1, 32, "warps per attention split block"),
    "attn_rows": (1, 32, "cache rows per lane of the split's CUDA-core pass, at most"),
    "attn_combine_warps": (1, 32, "warps per attention combine block"),
    "attn_combine_group": (1, 64, "chunks per combine warp per round of loads"),
    "attn_single_warps": (1, 32, "warps per block of the one-launch attention"),
    "attn_single_passes": (0, 64, "longest walk of the one-launch attention, in passes (0: never)"),
    "attn_single_rows": (1, 32, "cache rows per lane of the one-launch CUDA-core pass, at most"),
    "attn_wide_warps": (0, 32, "warps per block of the wide split (0: none)"),
    "flash_warps": (4, 8, "warps per block of the flash prefill: 16 query rows each, one pass over the cache for all"),
    "attn_paged_warps": (1, 32, "warps per block of the paged (batch) attention; its chunk sets the KV page"),
    "sampler_blocks": (1, 1024, "blocks sharing the sampler's pass over the vocabulary"),
}
POWERS_OF_TWO = {"gemv_warps", "wgmma_vector_copy", "gemm_epilogue_batch"}   # (0 passes as one)
PREFILL_STEP_RANGE = (8, 1024)  # tokens a prefill step may take, a multiple of 8 (the mma's token tile)


@dataclass(frozen=True)
class Tuning:
    """Every tuning number of the generated kernels (see _RANGES for what each is). Defaults are
    the measured best on the H200 (docs/performance.md)."""
    gemv_warps: int = 8
    gemv_rows_per_warp: int = 2
    gemv_warps_per_sm: int = 16     # 16 keep HBM busy; 32 split more than needed
    gemv_unroll: int = 4
    gemv_quant_rows_per_warp: int = 8   # measured on the 8B Q4_K_M: 2 rows 160 tok/s, 4: 253, 8: 280 (unroll 1)
    gemv_quant_unroll: int = 1
    gemv_quant_blocks_per_sm: int = 2   # float path: 8B Q4_K_M 278 -> 328 tok/s, Q4_0 410 -> 427 (staged: no cap)
    gemm_warps: int = 4
    gemm_quant_wgmma: int = 1       # 8B Q4_K_M TTFT 512 113.1 -> 39.5 ms on the H100 (0: mma.sync)
    gemm_blocks: int = 512
    gemm_min_chunks: int = 4
    gemm_epilogue_batch: int = 8    # 1: a round's loads wait for the round before (not yet measured)
    # wgmma_plan's cost model, fitted to the H200's 8B profile (docs/kernels.md): copies of a
    # 128 x 256 slot take 1.2x its products (L2-bound, ~6 TB/s), a split-K slab 11 slots
    wgmma_copy_share: int = 120
    wgmma_block_overhead: int = 200
    wgmma_slab_cost: int = 1100
    wgmma_min_columns: int = 32
    wgmma_vector_copy: int = 0      # not yet measured against cp.async (docs/performance.md)
    attn_warps: int = 8
    attn_rows: int = 8
    attn_combine_warps: int = 8
    attn_combine_group: int = 4
    attn_single_warps: int = 8
    attn_single_passes: int = 2
    attn_single_rows: int = 4
    attn_wide_warps: int = 9
    flash_warps: int = 4            # not yet measured at 8 (docs/performance.md)
    attn_paged_warps: int = 2       # chunks of 32 (head size 128) or 64 rows: pages of 64 hold whole ones
    sampler_blocks: int = 32        # one block took 26 us a token
    prefill_tokens: tuple[int, ...] = (256, 64, 32)   # prefill step sizes, largest first: a module each

    def __post_init__(self):
        for name, (low, high, what) in _RANGES.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise FuselmError(f"tuning {name}={value!r}: {what} must be an integer from {low} to {high}")
            if name in POWERS_OF_TWO and value & (value - 1):
                raise FuselmError(f"tuning {name}={value}: {what} must be a power of 2")
        low, high = PREFILL_STEP_RANGE
        sizes = self.prefill_tokens
        if (not sizes or any(not isinstance(s, int) or s % 8 or not low <= s <= high for s in sizes)
                or list(sizes) != sorted(set(sizes), reverse=True)):
            raise FuselmError(f"tuning prefill_tokens={'/'.join(map(str, sizes))}: distinct step sizes, largest "
                              f"first, each a multiple of 8 from {low} to {high}")

    @classmethod
    def parse(cls, text: str, base: "Tuning | None" = None) -> "Tuning":
        """`base` (the defaults) with "name=value,name=value" applied; prefill_tokens takes sizes
        joined by "/" (prefill_tokens=256/64/32)."""
        known = {f.name for f in fields(cls)}
        changes = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, eq, raw = item.partition("=")
            name = name.strip()
            if not eq or name not in known:
                raise FuselmError(f"tuning '{item}': expected name=value with a name among {', '.join(sorted(known))}")
            try:
                changes[name] = (tuple(sorted({int(v) for v in raw.split("/")}, reverse=True))
                                 if name == "prefill_tokens" else int(raw))
            except ValueError:
                raise FuselmError(f"tuning '{item}': the value must be an integer") from None
        return replace(base or cls(), **changes)

    @classmethod
    def from_env(cls) -> "Tuning":
        """The defaults with $FUSELM_TUNE applied (one place to override tuning for a whole run)."""
        raw = os.environ.get("FUSELM_TUNE", "")
        try:
            return cls.parse(raw)
        except FuselmError as e:
            raise FuselmError(f"FUSELM_TUNE: {e}") from None

    def changed(self) -> dict[str, object]:
        """The values that differ from the defaults (for records and reports)."""
        default = Tuning()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def lines(self) -> list[str]:
        """One line per value, with what it is (for `fuselm inspect --tuning`)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            what = _RANGES.get(f.name, (0, 0, "prefill step sizes, largest first"))[2]
            mark = "" if value == getattr(Tuning(), f.name) else "  (changed)"
            out.append(f"{f.name} = {'/'.join(map(str, value)) if isinstance(value, tuple) else value}  # {what}{mark}")
        return out

"""How fast the SMs pull scattered rows: ordinary 16-byte loads, bulk copies, and rows already in L2.

The split attention kernel reads 128-byte cache rows 1 kB apart (one KV head's slice of each
position), each block 64 kB with every load issued at once; on the H200 its rows arrive ~3.2 us after
its blocks start (fuselm trace with a stamp after the first use of the rows), about 30 GB/s per SM.
This probe reads the same pattern without attention around it: N blocks of 256 threads, each with
its own 32 or 64 kB, by ordinary loads all in flight at once ("lsu"; "lsu512c": the block's rows
contiguous, as in a head-major cache; "h": with the L2::256B fetch-size hint), by one bulk copy per row into
shared memory completing on an mbarrier ("bulk", the copy engine beside each SM), and by ordinary
loads of rows that the previous run left in L2 ("L2"). Each kernel times itself with %globaltimer
(first block start to last block end), so launch gaps do not count. Results:
bench/results/2026-12-01-h200-probes.log.

Usage (GPU machine): python3 scripts/probe_sm_bandwidth.py   (prints one line per case)
"""
import sys

import cupy as cp
import numpy as np

THREADS = 256                    # rows are 128 bytes, 1024 apart (8 KV heads x 128), as in the 1B's cache

SOURCE = r"""
__device__ unsigned long long t_first, t_last;

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ void stamp_start() { if (threadIdx.x == 0) atomicMin(&t_first, now()); }
__device__ __forceinline__ void stamp_end() { __syncthreads(); if (threadIdx.x == 0) atomicMax(&t_last, now()); }

// Each block: ROWS rows of 128 bytes, STRIDE apart (1 kB: one KV head's rows in a position-major
// cache; 128: a head-major one), from its own region; 16-byte loads, all issued before any is used
// (like MmaPass: each lane's share of the rows at once). HINT: the L2::256B fetch-size hint.
template <int ROWS, int STRIDE = 1024, bool HINT = false>
__device__ void lsu_rows(const char* src, float* out) {
    stamp_start();
    constexpr int PER = ROWS * 8 / 256;                  // 16-byte pieces per thread (8 per row)
    const char* base = src + (size_t)blockIdx.x * ROWS * STRIDE;
    uint4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int piece = i * 256 + threadIdx.x, row = piece / 8, col = piece % 8;
        // asm volatile: all loads stay ahead of their first use, as in the attention pass
        const char* at = base + (size_t)row * STRIDE + col * 16;
        if constexpr (HINT)
            asm volatile("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w) : "l"(at));
        else
            asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w) : "l"(at));
    }
    // Every use waits for a value read after a barrier, so all loads stay in flight together.
    __shared__ unsigned seed;
    if (threadIdx.x == 0) seed = (unsigned)now();
    __syncthreads();
    unsigned x = seed;
#pragma unroll
    for (int i = 0; i < PER; i++) x = x * 31u + (v[i].x ^ v[i].y ^ v[i].z ^ v[i].w);
    if (x == 0x12345678u) out[0] = 1.0f;
    stamp_end();
}

// The same rows by bulk copies into shared memory (rows 144 bytes apart there), completing on
// one mbarrier; every thread issues ROWS / 256 copies.
template <int ROWS>
__device__ void bulk_rows(const char* src, float* out) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) unsigned long long bar;
    stamp_start();
    const char* base = src + (size_t)blockIdx.x * ROWS * 1024;
    const unsigned bar_s = (unsigned)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_s));
        asm volatile("fence.mbarrier_init.release.cluster;");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar_s), "r"(ROWS * 128));
    }
    __syncthreads();
    for (int row = threadIdx.x; row < ROWS; row += blockDim.x) {
        const unsigned dst = (unsigned)__cvta_generic_to_shared(smem + row * 144);
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 128, [%2];"
                     :: "r"(dst), "l"(base + (size_t)row * 1024), "r"(bar_s) : "memory");
    }
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar_s) : "memory");
    unsigned x = 0;
    for (int i = threadIdx.x; i < ROWS * 8; i += blockDim.x)
        x ^= reinterpret_cast<const uint4*>(smem + (i / 8) * 144)[i % 8].x;
    if (x == 0x12345678u) out[0] = 1.0f;
    stamp_end();
}

// The same rows by the tensor memory accelerator: a 2D tensor map over the source (1 kB rows; boxes
// of 128 bytes x 256 rows), thread 0 issuing one copy per 256 rows into shared memory, all
// completing on one mbarrier. The map lives in global memory (written before the launch).
template <int ROWS>
__device__ void tma_rows(const void* tmap, int y0, float* out) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) unsigned long long bar;
    stamp_start();
    const unsigned bar_s = (unsigned)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_s));
        asm volatile("fence.mbarrier_init.release.cluster;");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar_s), "r"(ROWS * 128));
        for (int b = 0; b < ROWS / 256; b++) {
            const unsigned dst = (unsigned)__cvta_generic_to_shared(smem + b * 256 * 128);
            const int y = y0 + blockIdx.x * ROWS + b * 256;
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                         " [%0], [%1, {%2, %3}], [%4];"
                         :: "r"(dst), "l"(tmap), "r"(0), "r"(y), "r"(bar_s) : "memory");
        }
    }
    __syncthreads();
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar_s) : "memory");
    unsigned x = 0;
    for (int i = threadIdx.x; i < ROWS * 8; i += blockDim.x) x ^= reinterpret_cast<const uint4*>(smem)[i].x;
    if (x == 0x12345678u) out[0] = 1.0f;
    stamp_end();
}

extern "C" __global__ void __launch_bounds__(256) lsu256(const char* s, float* o) { lsu_rows<256>(s, o); }
extern "C" __global__ void __launch_bounds__(256) lsu512(const char* s, float* o) { lsu_rows<512>(s, o); }
extern "C" __global__ void __launch_bounds__(256) lsu512c(const char* s, float* o) { lsu_rows<512, 128>(s, o); }
extern "C" __global__ void __launch_bounds__(256) lsu512h(const char* s, float* o) { lsu_rows<512, 1024, true>(s, o); }
extern "C" __global__ void __launch_bounds__(256) lsu512ch(const char* s, float* o) { lsu_rows<512, 128, true>(s, o); }
extern "C" __global__ void __launch_bounds__(256) bulk256(const char* s, float* o) { bulk_rows<256>(s, o); }
extern "C" __global__ void __launch_bounds__(256) bulk512(const char* s, float* o) { bulk_rows<512>(s, o); }
extern "C" __global__ void __launch_bounds__(256) tma256(const void* m, int y0, float* o) { tma_rows<256>(m, y0, o); }
extern "C" __global__ void __launch_bounds__(256) tma512(const void* m, int y0, float* o) { tma_rows<512>(m, y0, o); }
"""


def tensor_map(src, promotion: int):
    """A CUtensorMap (128 bytes, on the device) over `src` as rows of 1 kB, boxes of 128 bytes x 256
    rows (cuTensorMapEncodeTiled; promotion: 0 none, 1 64B, 2 128B, 3 256B L2 fetches)."""
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    tmap = (ctypes.c_uint64 * 16)()
    dims, strides = (ctypes.c_uint64 * 2)(1024, src.size // 1024), (ctypes.c_uint64 * 1)(1024)
    box, step = (ctypes.c_uint32 * 2)(128, 256), (ctypes.c_uint32 * 2)(1, 1)
    err = lib.cuTensorMapEncodeTiled(ctypes.byref(tmap), 0, 2, ctypes.c_void_p(src.data.ptr), dims, strides,
                                     box, step, 0, 0, promotion, 0)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err})")
    return cp.asarray(np.frombuffer(bytes(tmap), np.uint8))


def main() -> None:
    module = cp.RawModule(code=SOURCE, options=("--std=c++17",), name_expressions=None)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    src = cp.zeros(1 << 30, cp.uint8)                   # 1 GiB: far beyond L2, fresh rows each run
    out = cp.zeros(1, cp.float32)
    first = cp.ndarray((1,), cp.uint64, module.get_global("t_first"))
    last = cp.ndarray((1,), cp.uint64, module.get_global("t_last"))
    cases = [("lsu256", 256, False, 0), ("bulk256", 256, False, 0), ("lsu512", 512, False, 0),
             ("bulk512", 512, False, 0), ("lsu512", 512, True, 0), ("lsu512c", 512, False, 0),
             ("lsu512h", 512, False, 0), ("lsu512ch", 512, False, 0)]
    cases += [("tma256", 256, False, 0), ("tma512", 512, False, 0), ("tma512", 512, False, 2),
              ("tma512", 512, False, 3), ("tma512", 512, True, 0)]
    if "--tma" in sys.argv:          # the tensor-map cases and the ordinary loads they compare with
        cases = [c for c in cases if c[0].startswith("tma") or c[:3] == ("lsu512", 512, False)]
    maps = {}
    for name, rows, l2, promotion in cases:
        fn = module.get_function(name)
        tma = name.startswith("tma")
        smem = rows * (128 if tma else 144) if tma or name.startswith("bulk") else 0
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        if tma and promotion not in maps:
            maps[promotion] = tensor_map(src, promotion)
        for blocks in (sms, sms // 2, sms // 4, 2 * sms):
            spans = []
            region = blocks * rows * (128 if name.startswith("lsu512c") else 1024)
            for rep in range(12):
                offset = 0 if l2 else (rep * region) % ((1 << 30) - region) // 1024 * 1024   # l2: rows read before
                first.fill(np.uint64(2 ** 64 - 1))
                last.fill(0)
                args = (maps[promotion], np.int32(offset // 1024), out) if tma else (src[offset:], out)
                fn((blocks,), (THREADS,), args, shared_mem=smem)
                cp.cuda.Device().synchronize()
                spans.append(int(last.get()[0]) - int(first.get()[0]))
            us = float(np.median(spans[2:])) / 1e3
            moved = blocks * rows * 128
            label = name + (f" p{promotion}" if tma else "") + (" L2" if l2 else "")
            print(f"{label:12s} blocks {blocks:4d} ({moved / 1e6:5.2f} MB): {us:6.2f} us, "
                  f"{moved / us / 1e3:7.1f} GB/s, {moved / us / 1e3 / min(blocks, sms):5.1f} GB/s per SM")

if __name__ == "__main__":
    main()

"""Do cache rows asked of L2 survive a layer's weight stream? (the 1B at 4k context)

The split attention's rows arrive from HBM in ~3.1 us, from L2 in ~1.5 (probe_sm_bandwidth.py).
A split could ask L2 for the next layer's rows once its own are in, but between two splits the
1B streams ~121 MB of weights (__ldcs: evict-first) through the 50 MB L2. This probe asks L2 for
8.65 MB of rows laid out as the 1B's cache (128-byte rows 1 kB apart, 132 blocks), streams S MB
through L2 as the GEMVs do, then times an ordinary read of the rows (first block start to last
block end, %globaltimer). Cases: no prefetch (HBM), `prefetch.global.L2`, and
`prefetch.global.L2::evict_last`, each with the persisting set-aside (cudaLimitPersistingL2CacheSize)
at 0 and at the device's maximum. Results: bench/results/2026-12-02-h200-probes.log
(asked-for rows survive; evict_last ones arrive in 2.27 us against 3.4 from HBM).

Usage (GPU machine): python3 scripts/probe_l2_survival.py   (prints one line per case)
"""
import cupy as cp
import numpy as np

ROWS = 512                        # rows per block: 64 kB, as the split's block reads at 4k

SOURCE = r"""
__device__ unsigned long long t_first, t_last;

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}

// Ask L2 for the block's rows, one 128-byte line per thread at a time (MODE 1 plain, 2 evict_last).
template <int MODE>
__device__ void prefetch_rows(const char* src) {
    const char* base = src + (size_t)blockIdx.x * 512 * 1024;
    for (int row = threadIdx.x; row < 512; row += blockDim.x) {
        const char* line = base + (size_t)row * 1024;
        if constexpr (MODE == 2) asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(line));
        else asm volatile("prefetch.global.L2 [%0];" :: "l"(line));
    }
}
extern "C" __global__ void prefetch_plain(const char* s) { prefetch_rows<1>(s); }
extern "C" __global__ void prefetch_last(const char* s) { prefetch_rows<2>(s); }

// The weight stream: every byte once, 16-byte streaming loads (ld.global.cs, as the GEMVs).
extern "C" __global__ void stream(const uint4* w, size_t n, unsigned* out) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(w + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) out[0] = x;
}

// The split's read: each thread's share of the block's rows (16-byte pieces), all in flight at once.
extern "C" __global__ void __launch_bounds__(256) read_rows(const char* src, unsigned* out) {
    if (threadIdx.x == 0) atomicMin(&t_first, now());
    constexpr int PER = 512 * 8 / 256;
    const char* base = src + (size_t)blockIdx.x * 512 * 1024;
    uint4 v[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int piece = i * 256 + threadIdx.x, row = piece / 8, col = piece % 8;
        asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w) : "l"(base + (size_t)row * 1024 + col * 16));
    }
    unsigned x = 0;
#pragma unroll
    for (int i = 0; i < PER; i++) x = x * 31u + (v[i].x ^ v[i].y ^ v[i].z ^ v[i].w);
    if (x == 0x12345678u) out[0] = x;
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(&t_last, now());
}
"""


def main() -> None:
    module = cp.RawModule(code=SOURCE, options=("--std=c++17",))
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    sms, l2, most = props["multiProcessorCount"], props["l2CacheSize"], props.get("persistingL2CacheMaxSize", 0)
    print(f"{sms} SMs, L2 {l2 / 2**20:.1f} MiB, persisting set-aside at most {most / 2**20:.1f} MiB")
    rows = cp.zeros(1 << 30, cp.uint8)                 # 1 GiB of rows: a fresh region each repeat
    weights = cp.zeros(1 << 31, cp.uint8)              # 2 GiB of weights: a fresh stretch each repeat
    out = cp.zeros(1, cp.uint32)
    first = cp.ndarray((1,), cp.uint64, module.get_global("t_first"))
    last = cp.ndarray((1,), cp.uint64, module.get_global("t_last"))
    fetch = {"none": None, "plain": module.get_function("prefetch_plain"),
             "evict_last": module.get_function("prefetch_last")}
    stream, read = module.get_function("stream"), module.get_function("read_rows")
    region = sms * ROWS * 1024
    for aside in (0, most):
        cp.cuda.runtime.deviceSetLimit(0x06, aside)      # cudaLimitPersistingL2CacheSize
        for streamed_mb in (0, 32, 121):
            n = streamed_mb * 2**20 // 16
            for name, fn in fetch.items():
                spans = []
                for rep in range(12):
                    offset = (rep * region) % ((1 << 30) - region) // 1024 * 1024
                    w_off = (rep * n * 16) % ((1 << 31) - n * 16 - 16) // 16 * 16
                    if fn is not None:
                        fn((sms,), (256,), (rows[offset:],))
                    if n:
                        stream((4 * sms,), (512,), (weights[w_off:], np.uint64(n), out))
                    first.fill(np.uint64(2 ** 64 - 1))
                    last.fill(0)
                    read((sms,), (256,), (rows[offset:], out))
                    cp.cuda.Device().synchronize()
                    spans.append(int(last.get()[0]) - int(first.get()[0]))
                us = float(np.median(spans[2:])) / 1e3
                print(f"set-aside {aside / 2**20:5.1f} MiB, streamed {streamed_mb:4d} MB, prefetch {name:10s}: "
                      f"rows in {us:5.2f} us ({region // 8 / us / 1e3:6.1f} GB/s)")


if __name__ == "__main__":
    main()

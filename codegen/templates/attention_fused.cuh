// Decode attention's split inside the GEMV kernel that writes its queries and this step's cache
// rows (the "fused" variant; codegen/attention.py: fused_context). Block a of that kernel, for a
// below KV x NCHUNK, also takes chunk a / KV of KV head a % KV.
//
// Why: launched on its own, the split can start only as the GEMV's blocks leave the SMs, and then
// waits about 3 us for its cache rows (8.7 MB a layer on Llama-3.2-1B at 4k positions), behind a
// grid completion. Here the block copies its chunk's rows into shared memory (cp.async, no
// registers held) as it starts, they arrive while the GEMV streams its weights, and the scores
// start once every block of the kernel has counted its tile in.
//
// No deadlock: the blocks wait for each other only after their own tile, and the runtime launches
// this kernel only where its whole grid fits on the GPU at once (CudaEngine: fused_fits).
#pragma once
#include "attention.cuh"

// cp.async of 16 bytes, zero-filled where `valid` is false (src then is not read).
__device__ __forceinline__ void copy16_async(uint4* to, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"((unsigned)__cvta_generic_to_shared(to)), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// The block's writes are done: count it in (the release half of the kernel's one barrier).
__device__ __forceinline__ void count_block_in(unsigned* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
    }
}

// Until `target` blocks have counted in; their writes are then visible to the whole block
// (read them through L2: __ldcg, since L1 is not coherent with other SMs' writes).
__device__ __forceinline__ void wait_for_blocks(const unsigned* count, unsigned target, unsigned sleep_ns) {
    if (threadIdx.x == 0) {
        unsigned seen;
        while (true) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
            if (seen >= target) break;
            if (sleep_ns) __nanosleep(sleep_ns);
        }
    }
    __syncthreads();
}

// The chunk task that block b of `grid` takes, or -1: task a rides on block a * grid / tasks.
// Why spread: a kernel's blocks land on the SMs in runs of consecutive indices as slots free up,
// and tasks on blocks 0, 1, 2, ... shared SMs three to one (Llama-3.2-1B at 4k: 136 tasks on 46
// SMs), whose copies of 64 kB of rows each then delayed the blocks' own GEMV tiles.
__device__ __forceinline__ int task_of_block(int b, int grid, int tasks) {
    const int a = (int)(((long long)b * tasks + grid - 1) / grid);
    return a < tasks && (long long)a * grid / tasks == b ? a : -1;
}

// One chunk task of the split over MmaPass, its rows in shared memory: each lane's K and V slices
// sit in slots of its own (slot j of the lane at rows[32 j]), written by its own cp.async and read
// back by itself, so no barrier stands between the copies and their use.
template <int H, int KV, int HD, int WARPS, int NCHUNK>
struct SharedChunk {
    using P = MmaPass<KV, HD, WARPS, H / KV>;
    static constexpr int G = H / KV, KSLOTS = P::NT * (HD / 32), VSLOTS = P::NU * 4 * (HD / 64);
    static constexpr int BYTES = WARPS * (KSLOTS + VSLOTS) * 32 * (int)sizeof(uint4);   // dynamic shared memory
    static_assert(sizeof(typename P::Merge) <= BYTES, "the block merge reuses the rows' shared memory");
    P pass;                  // positions and fragment layout (its register slices stay unused)
    uint4* base;             // the block's shared memory
    uint4* rows;             // this lane's slots
    int kv, chunk, pos;

    __device__ __forceinline__ const bf16_t* row(const bf16_t* cache, int p) const {
        return cache + (size_t)p * P::W + kv * HD;
    }
    __device__ __forceinline__ bool live(int p) const { return p >= pass.start && p < pass.end; }

    // Start copying the chunk's rows but `pos` (this step's, not written yet); false when the chunk
    // holds no position up to `pos` (nothing to do).
    __device__ __forceinline__ bool copy_rows(const bf16_t* kc, const bf16_t* vc, uint4* smem, int task, int pos_,
                                              int window) {
        kv = task % KV, chunk = task / KV, pos = pos_;
        const int lo = window > 0 ? max(0, pos - window + 1) : 0;
        const int start = max(chunk * P::CHUNK, lo), end = min(chunk * P::CHUNK + P::CHUNK, pos + 1);
        if (start >= end) return false;
        pass.first = chunk * P::CHUNK + (threadIdx.x >> 5) * P::NP, pass.start = start, pass.end = end;
        base = smem;
        rows = smem + (threadIdx.x >> 5) * (KSLOTS + VSLOTS) * 32 + (threadIdx.x & 31);
#pragma unroll
        for (int t = 0; t < P::NT; t++)
#pragma unroll
            for (int j = 0; j < HD / 32; j++) {
                const int p = pass.k_row(t);
                const bool ok = live(p) && p != pos;
                copy16_async(rows + 32 * (t * (HD / 32) + j), ok ? row(kc, p) + P::c() * (HD / 4) + 8 * j : kc, ok);
            }
#pragma unroll
        for (int u = 0; u < P::NU; u++)
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int q4 = 0; q4 < HD / 64; q4++) {
                    const int p = pass.v_row(u, i);
                    const bool ok = live(p) && p != pos;
                    copy16_async(rows + 32 * (KSLOTS + (u * 4 + i) * (HD / 64) + q4),
                                 ok ? row(vc, p) + P::r() * P::VDIMS + 8 * q4 : vc, ok);
                }
        return true;
    }

    // Once every block has counted in: this step's row, the queries, the scores and the block's
    // softmax states, left in the workspace as attention_chunk leaves them.
    __device__ __forceinline__ void attend(const float* q, const bf16_t* kc, const bf16_t* vc, float scale,
                                           float softcap, float* ws) {
        asm volatile("cp.async.wait_all;" ::: "memory");
        const auto l2 = [](const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); };
        if (live(pos)) {   // row pos: written by a block of this kernel
#pragma unroll
            for (int t = 0; t < P::NT; t++)
#pragma unroll
                for (int j = 0; j < HD / 32; j++)
                    if (pass.k_row(t) == pos)
                        rows[32 * (t * (HD / 32) + j)] = __ldcg(reinterpret_cast<const uint4*>(row(kc, pos) + P::c() * (HD / 4) + 8 * j));
#pragma unroll
            for (int u = 0; u < P::NU; u++)
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int q4 = 0; q4 < HD / 64; q4++)
                        if (pass.v_row(u, i) == pos)
                            rows[32 * (KSLOTS + (u * 4 + i) * (HD / 64) + q4)] =
                                __ldcg(reinterpret_cast<const uint4*>(row(vc, pos) + P::r() * P::VDIMS + 8 * q4));
        }
        pass.load_queries(q, scale, kv, l2);
        typename P::State st;
        pass.softmax(softcap, st, [&](int t, int j) { return rows[32 * (t * (HD / 32) + j)]; },
                     [&](int u, int i, int q4) { return rows[32 * (KSLOTS + (u * 4 + i) * (HD / 64) + q4)]; });
        __syncthreads();   // every warp is done with the rows: the merge takes their memory
        P::block_merge(*reinterpret_cast<typename P::Merge*>(base), st, [&](int g, int d, float m, float l, float a) {
            float* out = ws + ((size_t)(kv * G + g) * NCHUNK + chunk) * Record<HD>::FLOATS;
            out[d] = a;
            if (d == 0) { out[Record<HD>::MAX_AT] = m; out[Record<HD>::SUM_AT] = l; }
        });
    }
};

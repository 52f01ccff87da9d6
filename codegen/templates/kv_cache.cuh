// The KV cache's two layouts, as the attention passes read them (KvBf16, KvFp8), and the fp8
// writes of the GEMV / gemm epilogues and the row-wise kernels (dsl/kv_dtype.py has the rule).
//
// fp8 row of position p (STRIDE bytes, a multiple of 32 so no sector holds two rows): the
// e4m3 codes of the W = KV x HD values, then at SCALE_AT one float32 scale per KV head.
#pragma once
#include "common.cuh"

// The pool row of position p of a sequence whose page table (pages of `page` rows) is `table`.
__device__ __forceinline__ int paged_row(const int* table, int page, int p) { return table[p / page] * page + p % page; }

// bf16 rows of W values.
struct KvBf16 {
    using Elem = bf16_t;
    static constexpr bool FP8 = false;
    template <int W>
    static constexpr int STEP = W;              // elements from one row to the next
    template <int W>
    __device__ __forceinline__ static const Elem* row(const Elem* cache, int p) { return cache + (size_t)p * W; }
    template <int W>
    __device__ __forceinline__ static float scale(const Elem*, int, int) { return 1.0f; }
};

template <int STRIDE, int SCALE_AT>
struct KvFp8 {
    using Elem = unsigned char;
    static constexpr bool FP8 = true;
    static_assert(STRIDE % 32 == 0 && SCALE_AT % 4 == 0, "fp8 KV rows: whole sectors, aligned scales");
    template <int W>
    static constexpr int STEP = STRIDE;
    template <int W>
    __device__ __forceinline__ static const Elem* row(const Elem* cache, int p) { return cache + (size_t)p * STRIDE; }
    // The scale of KV head h in row p.
    template <int W>
    __device__ __forceinline__ static float scale(const Elem* cache, int p, int h) {
        return *reinterpret_cast<const float*>(cache + (size_t)p * STRIDE + SCALE_AT + 4 * h);
    }
};

// One warp writes one head of HD values (value(d), d = 0 .. HD-1) as codes at `codes` and its
// scale at `scale`: amax over the head, codes of value * (448 / amax), scale amax / 448.
template <int HD, class Value>
__device__ __forceinline__ void kv_fp8_head(unsigned char* codes, float* scale, Value value) {
    const int lane = threadIdx.x & 31;
    float amax = 0.0f;
    for (int d = lane; d < HD; d += 32) amax = fmaxf(amax, fabsf(value(d)));
    amax = warp_max(amax);
    const float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
    for (int d = lane; d < HD; d += 32) codes[d] = f32_to_e4m3(value(d) * inv);
    if (lane == 0) *scale = amax / 448.0f;
}

// The pool rows of a step's tokens over paged caches, as kv_fp8_epilogue indexes its rows (else
// by position: `pos` itself): token t's position through its sequence's page table (TABLE
// entries a token, pages of PAGE rows).
template <int PAGE, int TABLE>
struct PagedPositions {
    const int* pages;
    const int* pos;
    __device__ __forceinline__ int operator[](int t) const { return paged_row(pages + (size_t)t * TABLE, PAGE, pos[t]); }
};

// The fp8 cache write of a GEMV / gemm epilogue, called by every thread of the block: thread
// slot `row` (where `active`) holds value v of token t. A tile holds TU units (RoPE pairs, UNIT
// 2, or rows, UNIT 1) of N / UNIT, a head HD / UNIT of them, so a head's values come from
// several blocks: each block stages its values (stage [T][N] floats) and counts itself in per
// (token, head) (counts [T][KV], zero between steps); the last block of a head reads the head
// back and writes it (kv_fp8_head), leaving the count at 0. This round's tokens: t0 .. t0 +
// NTOK - 1, whose cache rows are rows[t] (their positions, or PagedPositions); threads 0 .. live - 1
// run it (a gemm's producer warps have left).
template <int HD, int UNIT, int TU, int N, int NTOK, int STRIDE, int SCALE_AT, class Rows>
__device__ __forceinline__ void kv_fp8_epilogue(unsigned char* cache, float* stage, unsigned* counts, const Rows& rows,
                                                int t0, int tile, bool active, int row, int t, float v,
                                                int live) {
    constexpr int KV = N / HD, UH = HD / UNIT, UNITS = N / UNIT, NJ = NTOK * (TU / UH + 2);
    __shared__ int last[NJ];                     // [token of the round][head of the tile] this block writes it
    if (active) stage[(size_t)t * N + row] = v;
    __threadfence();                             // the staged values before the count (any block may read them)
    __syncthreads();
    const int u0 = tile * TU, h0 = u0 / UH, nh = (min(u0 + TU, UNITS) - 1) / UH - h0 + 1;
    for (int j = threadIdx.x; j < NTOK * nh; j += live) {
        const int h = h0 + j % nh, tiles = (h * UH + UH - 1) / TU - h * UH / TU + 1;
        last[j] = tiles == 1 || atomicAdd(counts + (t0 + j / nh) * KV + h, 1u) == (unsigned)(tiles - 1);
    }
    __syncthreads();
    for (int j = threadIdx.x >> 5; j < NTOK * nh; j += live >> 5) {
        if (!last[j]) continue;
        const int h = h0 + j % nh, tt = t0 + j / nh;
        __threadfence();                         // the other blocks' values, counted in, are visible
        const float* src = stage + (size_t)tt * N + h * HD;
        unsigned char* dst = cache + (size_t)rows[tt] * STRIDE;
        kv_fp8_head<HD>(dst + h * HD, reinterpret_cast<float*>(dst + SCALE_AT) + h,
                        [src](int d) { return __ldcg(src + d); });   // through L2: other SMs wrote them
        if ((threadIdx.x & 31) == 0) counts[tt * KV + h] = 0u;
    }
}

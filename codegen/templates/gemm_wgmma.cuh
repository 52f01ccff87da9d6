// Prefill GEMM tiles on Hopper's warpgroup tensor cores (wgmma, sm_90a): the gemm family's
// products where the weights are bf16, for steps of TT tokens (a multiple of 32, at most 256).
//
// A block is two warpgroups over a tile of 128 weight rows (R slots of each of M members, M R =
// 128, member-major: A row i is slot i % R of member i / R) and all TT tokens: warpgroup g
// computes rows 64 g .. 64 g + 63 against every token as one m64nTTk16 wgmma per 16 k. Both
// operands are K-major in shared memory, copied there by every thread with cp.async in slots of
// 64 k (128-byte swizzled rows, wgmma.cuh): STAGES slots, D = STAGES - 2 copies in flight ahead
// of the products (the slot being overwritten is the one two steps back, which every warpgroup
// has finished: each waits for all but its newest wgmma group before the next barrier).
// The tokens' vectors come as bf16 from the stage launch (stage_bf16), so a product is one
// multiply of bf16 values with float accumulation, as in a bf16 transformers run.
#pragma once
#include "cp_async.cuh"
#include "gemm.cuh"            // splitk_gather
#include "gemv.cuh"            // slot_row, load_f32x8, apply_gain8
#include "wgmma.cuh"

// d += A B for this warpgroup (m64nNk16, wgmma.cuh): emitted per N by the kernel (wgmma.j2).
template <int N>
__device__ void wgmma_m64k16(float (&d)[N / 2], unsigned long long a, unsigned long long b);

// Where stage_bf16 leaves a step's vectors: [TT][K] bf16, then TT floats, each token's sum of
// x^2 over all of K (the norm prologue's).
template <int K, int TT>
struct StagedBf16 {
    static __device__ __forceinline__ float* sums(float* words) { return words + (size_t)TT * K / 2; }
    static __device__ __forceinline__ const float* sums(const float* words) { return words + (size_t)TT * K / 2; }
};

// The stage kernel's block t: token t's vector times the norm gain (where NORMED) in bf16,
// rounded to nearest, and its sum of squares.
template <int K, int TT, bool NORMED, int THREADS>
__device__ __forceinline__ void stage_bf16(const float* x, const weight_t* gain, float gain_offset, float* words) {
    constexpr int PER = (K / 8 + THREADS - 1) / THREADS;
    const int t = blockIdx.x;
    uint4* out = reinterpret_cast<uint4*>(words) + (size_t)t * K / 8;
    float v[PER][8];
    load_entries<K, THREADS>(x + (size_t)t * K, v);
    float sumsq = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int g = i * THREADS + threadIdx.x;
        if (g >= K / 8) continue;
        if constexpr (NORMED) apply_gain8(v[i], gain, 8 * g, gain_offset, sumsq);
        out[g] = make_uint4(pack_bf16x2(v[i][0], v[i][1]), pack_bf16x2(v[i][2], v[i][3]),
                            pack_bf16x2(v[i][4], v[i][5]), pack_bf16x2(v[i][6], v[i][7]));
    }
    if constexpr (NORMED) {
        sumsq = block_sum(sumsq);
        if (threadIdx.x == 0) StagedBf16<K, TT>::sums(words)[t] = sumsq;
    }
}

// The tile's weight rows as this thread copies them: 16-byte chunk c = thread % 8 (k 8c .. 8c + 8
// of each 64) of A rows thread / 8 + (THREADS / 8) j. Slots past the end read row 0 (the epilogue
// skips them).
template <int K, int M, int R, int N, int HD, bool INTERLEAVED, int THREADS>
struct WgmmaRows {
    static constexpr int BM = M * R, PER = BM * 8 / THREADS;
    static_assert(BM == 128 && THREADS == 256, "two warpgroups over 128 rows");
    const weight_t* row[PER];
    __device__ __forceinline__ WgmmaRows(const weight_t* const (&W)[M], int tile) {
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int i = threadIdx.x / 8 + (THREADS / 8) * j;
            int pair;
            const int r = slot_row<R, N, HD, INTERLEAVED>(tile, i % R, pair);
            row[j] = W[i / R] + (size_t)max(r, 0) * K + 8 * (threadIdx.x % 8);
        }
    }
};

// Bytes of one pipeline slot: the A rows, then the TT tokens' rows, 64 k each.
template <int BM, int TT>
struct WgmmaSlot {
    static constexpr int A = BM * 128, BYTES = (BM + TT) * 128;
};

// tile_out[i (TT + 1) + t] = A row i . token t over k in [k0, k0 + KS) (KS a multiple of 8: the last
// slot's chunks past k0 + KS are zeros), from the staged bf16 vectors
// `staged` ([TT][K], StagedBf16), through `smem` (STAGES slots, 1024-byte aligned, which
// tile_out may share: the slots are read no more once it is written). The block waits for the
// previous kernel (grid_wait_then_release) once its first slots' weights are in flight: they are
// no kernel's output, and their round trip then overlaps the previous kernel's tail.
template <int K, int KS, int TT, int STAGES, int THREADS, class Rows>
__device__ __forceinline__ void wgmma_tile(const Rows& rows, int k0, const float* staged, unsigned char* smem,
                                           float* tile_out) {
    constexpr int BM = Rows::BM, KT = (KS + 63) / 64, D = STAGES - 2, X_PER = TT * 8 / THREADS;
    using Slot = WgmmaSlot<BM, TT>;
    static_assert(FUSELM_SM90A || !FUSELM_SM90, "wgmma needs sm_90a (nvrtc.options compiles sm_90 as sm_90a)");
    static_assert(KS % 8 == 0 && K % KS == 0 && TT % 32 == 0 && TT <= 256 && D >= 1, "wgmma tile shape");
    const int c = threadIdx.x % 8, r0 = threadIdx.x / 8;
    const bf16_t* x = reinterpret_cast<const bf16_t*>(staged) + (size_t)r0 * K + 8 * c;
    auto copy_rows = [&](int kt) {
        unsigned char* slot = smem + (kt % STAGES) * Slot::BYTES;
        const bool full = KS % 64 == 0 || 64 * kt + 8 * c < KS;
#pragma unroll
        for (int j = 0; j < Rows::PER; j++)
            cp_async_16_cg_or_zero(slot + sw128_offset(r0 + (THREADS / 8) * j, c), rows.row[j] + k0 + 64 * kt, full);
    };
    auto copy_vectors = [&](int kt) {   // .cg: the stage launch's writes, through L2
        unsigned char* slot = smem + (kt % STAGES) * Slot::BYTES + Slot::A;
        const bool full = KS % 64 == 0 || 64 * kt + 8 * c < KS;
#pragma unroll
        for (int j = 0; j < X_PER; j++)
            cp_async_16_cg_or_zero(slot + sw128_offset(r0 + (THREADS / 8) * j, c),
                                   x + (size_t)(THREADS / 8) * j * K + k0 + 64 * kt, full);
    };
    // The first D slots: every weight copy, then the wait, then the vectors (group s completes slot s).
#pragma unroll
    for (int s = 0; s < D; s++)
        if (s < KT) copy_rows(s);
    grid_wait_then_release();
#pragma unroll
    for (int s = 0; s < D; s++) {
        if (s < KT) copy_vectors(s);
        cp_async_commit();
    }
    float acc[TT / 2] = {};   // warpgroup g's rows 64 g .. 64 g + 63 x the TT tokens (wgmma's layout)
    const int wg = threadIdx.x / 128;
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait_group<D - 1>();   // this thread's copies of slot kt are done ...
        fence_proxy_async();            // ... and visible to wgmma
        __syncthreads();                // everyone's; every warpgroup is past the products of kt - 2
        if (kt + D < KT) {
            copy_rows(kt + D);          // into the slot of kt - 2
            copy_vectors(kt + D);
        }
        cp_async_commit();
        const unsigned char* slot = smem + (kt % STAGES) * Slot::BYTES;
        const unsigned long long a = wgmma_desc_sw128(slot + wg * 64 * 128), b = wgmma_desc_sw128(slot + Slot::A);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_m64k16<TT>(acc, a + 2 * kk, b + 2 * kk);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    __syncthreads();                    // every warpgroup's products are done with the slots
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    constexpr int TS = TT + 1;          // rows one float apart: the epilogue reads down a token's column
    float* out = tile_out + (wg * 64 + 16 * warp + lane / 4) * TS + 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < TT / 8; nt++) {
        out[8 * nt] = acc[4 * nt];
        out[8 * nt + 1] = acc[4 * nt + 1];
        out[8 * TS + 8 * nt] = acc[4 * nt + 2];
        out[8 * TS + 8 * nt + 1] = acc[4 * nt + 3];
    }
    __syncthreads();
}

// The dynamic shared memory of a kernel, from its first 1024-byte boundary (the swizzle's
// alignment; the launch asks for 1024 bytes more than the slots need).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* smem) {
    const unsigned offset = (unsigned)__cvta_generic_to_shared(smem);
    return smem + ((1024 - (offset & 1023)) & 1023);
}

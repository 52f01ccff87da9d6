// The moe family's batched-prefill form (moe.cuh says why every expert streams once per step):
// GEMMs per expert over the step's tokens that chose it, on gemm.cuh's tiles. Prefill modules only.
#pragma once
#include "gemm.cuh"
#include "moe.cuh"

// One expert's M matrices [N rows][K] from stacks of E: bf16 (F = void; a stack is [E][N][K]
// elements) or in quantized format F (a stack is E buffers of EXPERT_BYTES, quant/formats.py), as
// the gemm tile that reads them and whether it takes its vectors GROUPED.
template <class F, int K, int M, int R, int N, long long EXPERT_BYTES>
struct ExpertTile {
    static constexpr bool GROUPED = true;
    using Tile = QuantTile<F, K, M, R, N, 0, false>;
    static __device__ __forceinline__ Tile of(const unsigned char* const (&stacks)[M], int e, int tile) {
        const unsigned char* W[M];
#pragma unroll
        for (int m = 0; m < M; m++) W[m] = stacks[m] + (size_t)e * EXPERT_BYTES;
        return Tile(W, tile);
    }
};
template <int K, int M, int R, int N, long long EXPERT_BYTES>
struct ExpertTile<void, K, M, R, N, EXPERT_BYTES> {
    static constexpr bool GROUPED = false;
    using Tile = Bf16Tile<K, M, R, N, 0, false>;
    static __device__ __forceinline__ Tile of(const weight_t* const (&stacks)[M], int e, int tile) {
        const weight_t* W[M];
#pragma unroll
        for (int m = 0; m < M; m++) W[m] = stacks[m] + (size_t)e * N * K;
        return Tile(W, tile);
    }
};

// Batched prefill, gate and up: block (expert e, tile of R = 16 x warps rows), in a grid of E x
// ceil(I / R) blocks, writes glu(e, row, gate, up) of each token that chose e (route_step's
// entries t TOPK + k, `expert`) into its entry's row of the workspace act [TT TOPK][I], taking
// those tokens TB at a time (a block whose expert no token chose returns at once). F,
// EXPERT_BYTES: the experts' format (ExpertTile); W their pointers. NORMED: x goes through an
// RMSNorm first (gain, gain_offset, eps), each token's scale applied to its dot products
// (gemm_tile gathers the sums of squares as it stages x).
template <int E, int TOPK, int I, int D, int TT, int TB, int KC, int THREADS, class F, long long EXPERT_BYTES,
          bool NORMED, class W, class Glu>
__device__ __forceinline__ void moe_up_tokens(const float* x, const int* expert, const W* w_gate, const W* w_up,
                                              float* act, Glu glu, const weight_t* gain, float gain_offset, float eps) {
    constexpr int R = 16 * (THREADS / 32), TILES = (I + R - 1) / R;
    using Experts = ExpertTile<F, D, 2, R, I, EXPERT_BYTES>;
    __shared__ union {
        StagedChunk<TB, KC, Experts::GROUPED> x;   // the k loop's chunk of the tokens' vectors
        float tile[2 * R * TB];                    // then [gate, up][R][TB] dot products
    } smem;
    __shared__ float ss[TB];                 // each token's sum of x^2 (NORMED)
    __shared__ int entry_of[TT], token_of[TT];
    const int e = blockIdx.x / TILES, tile = blockIdx.x % TILES;
    const int count = entries_routed_to<TT, TOPK, THREADS>(expert, e, entry_of);
    if (count == 0) return;
    for (int n = threadIdx.x; n < count; n += THREADS) token_of[n] = entry_of[n] / TOPK;
    __syncthreads();
    const W* const stacks[2] = {w_gate, w_up};
    const auto rows = Experts::of(stacks, e, tile);
    for (int n0 = 0; n0 < count; n0 += TB) {       // hot experts: the tile's weights again, from L2
        const int n = min(TB, count - n0);
        VectorsFromX<D, TB, KC, NORMED, THREADS, Experts::GROUPED> vectors{x, gain, gain_offset, token_of + n0, n};
        gemm_tile<D, D, TB, KC, THREADS, false>(rows, 0, vectors, smem.x, smem.tile, ss, n);
        for (int i = threadIdx.x; i < R * n; i += THREADS) {
            const int s = i % R, j = i / R, row = tile * R + s;
            const float scale = NORMED ? rms_scale(ss[j], D, eps) : 1.0f;
            if (row < I)
                act[(size_t)entry_of[n0 + j] * I + row] =
                    glu(e, row, smem.tile[s * TB + j] * scale, smem.tile[(R + s) * TB + j] * scale);
        }
        __syncthreads();                     // the tile is read before the next pass stages over it
    }
}

// Batched prefill, down: block (expert e, tile of R rows) multiplies the act rows of the entries
// that chose e (TB at a time) and writes each product, times its router weight, into the entry's
// row of `terms` [TT TOPK][D]: every row is written by the one expert that fills it, and
// moe_sum_tokens adds a token's rows in pick order, so the sum does not depend on the order the
// blocks ran in (as atomic adds would, for TOPK > 2). bias(e, row): the expert's down bias
// (gpt-oss; 0 for the others).
template <int E, int TOPK, int I, int D, int TT, int TB, int KC, int THREADS, class F, long long EXPERT_BYTES,
          class W, class Bias>
__device__ __forceinline__ void moe_down_tokens(const int* expert, const float* weight, const W* w_down,
                                                const float* act, float* terms, Bias bias) {
    constexpr int R = 16 * (THREADS / 32), TILES = (D + R - 1) / R;
    using Experts = ExpertTile<F, I, 1, R, D, EXPERT_BYTES>;
    __shared__ union {
        StagedChunk<TB, KC, Experts::GROUPED> x;
        float tile[R * TB];
    } smem;
    __shared__ float ss[TB];
    __shared__ int entry_of[TT];
    const int e = blockIdx.x / TILES, tile = blockIdx.x % TILES;
    const int count = entries_routed_to<TT, TOPK, THREADS>(expert, e, entry_of);
    if (count == 0) return;
    const W* const stacks[1] = {w_down};
    const auto rows = Experts::of(stacks, e, tile);
    for (int n0 = 0; n0 < count; n0 += TB) {
        const int n = min(TB, count - n0);
        VectorsFromX<I, TB, KC, false, THREADS, Experts::GROUPED> vectors{act, nullptr, 0.0f, entry_of + n0, n};
        gemm_tile<I, I, TB, KC, THREADS, false>(rows, 0, vectors, smem.x, smem.tile, ss, n);
        for (int i = threadIdx.x; i < R * n; i += THREADS) {
            const int s = i % R, j = i / R, row = tile * R + s, entry = entry_of[n0 + j];
            if (row < D) terms[(size_t)entry * D + row] = weight[entry] * (smem.tile[s * TB + j] + bias(e, row));
        }
        __syncthreads();
    }
}

// Batched prefill, the sum: each token's TOPK terms of moe_down_tokens added in pick order, handed
// with its token and row to epilogue(t, row, sum), which stores it (after the fused ops, if any).
template <int TOPK, int D, int TT, class Epilogue>
__device__ __forceinline__ void moe_sum_tokens(const float* terms, Epilogue epilogue) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < TT * D; i += gridDim.x * blockDim.x) {
        const float* term = terms + (size_t)(i / D) * TOPK * D + i % D;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < TOPK; k++) sum += term[k * D];
        epilogue(i / D, i % D, sum);
    }
}

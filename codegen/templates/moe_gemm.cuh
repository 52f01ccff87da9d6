// The moe family's batched-prefill form (moe.cuh says why every expert streams once per step):
// GEMMs per expert over all the step's tokens, on gemm.cuh's tiles. Prefill modules only.
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
// ceil(I / R) blocks, writes glu(e, row, gate, up) of every token of the step into the workspace ws
// [E][TT][I]; an expert no token chose is skipped. F, EXPERT_BYTES: the experts' format
// (ExpertTile); W their pointers; NORM: the router's renormalised top-K (route_token). NORMED: x
// goes through an RMSNorm first (gain, gain_offset, eps), each token's scale applied to its dot
// products (gemm_tile gathers the sums of squares as it stages x).
template <int E, int TOPK, bool NORM, int I, int D, int TT, int KC, int THREADS, class F, long long EXPERT_BYTES,
          bool NORMED, class W, class Glu>
__device__ __forceinline__ void moe_up_tokens(const float* x, const float* logits, const W* w_gate, const W* w_up,
                                              float* ws, Glu glu, const weight_t* gain, float gain_offset, float eps) {
    constexpr int R = 16 * (THREADS / 32), TILES = (I + R - 1) / R;
    using Experts = ExpertTile<F, D, 2, R, I, EXPERT_BYTES>;
    static_assert(TT <= THREADS, "route_tokens_to: a thread per token");
    __shared__ union {
        StagedChunk<TT, KC, Experts::GROUPED> x;   // the k loop's chunk of the tokens' vectors
        float tile[2 * R * TT];                    // then [gate, up][R][TT] dot products
    } smem;
    __shared__ float ss[TT];                 // each token's sum of x^2 (NORMED)
    __shared__ float weight_of[TT];
    __shared__ int slot_of[TT];
    const int e = blockIdx.x / TILES, tile = blockIdx.x % TILES;
    if (!route_tokens_to<E, TOPK, NORM, TT>(logits, e, weight_of, slot_of)) return;
    const W* const stacks[2] = {w_gate, w_up};
    VectorsFromX<D, TT, KC, NORMED, THREADS, Experts::GROUPED> vectors{x, gain, gain_offset};
    const auto rows = Experts::of(stacks, e, tile);
    gemm_tile<D, D, TT, KC, THREADS, false>(rows, 0, vectors, smem.x, smem.tile, ss);
    for (int i = threadIdx.x; i < R * TT; i += THREADS) {
        const int s = i % R, t = i / R, row = tile * R + s;
        const float scale = NORMED ? rms_scale(ss[t], D, eps) : 1.0f;
        if (row < I)
            ws[((size_t)e * TT + t) * I + row] = glu(e, row, smem.tile[s * TT + t] * scale, smem.tile[(R + s) * TT + t] * scale);
    }
}

// Batched prefill, down: block (expert e, tile of R rows) writes each token's product, times its
// weight for e, into that token's slot for e in `terms` [TT][TOPK][D]: every slot is written by
// the one expert that fills it, and moe_sum_tokens adds them in slot order, so the sum does not
// depend on the order the blocks ran in (as atomic adds would, for TOPK > 2). bias(e, row): the
// expert's down bias (gpt-oss; 0 for the others).
template <int E, int TOPK, bool NORM, int I, int D, int TT, int KC, int THREADS, class F, long long EXPERT_BYTES,
          class W, class Bias>
__device__ __forceinline__ void moe_down_tokens(const float* logits, const W* w_down, const float* ws, float* terms,
                                                Bias bias) {
    constexpr int R = 16 * (THREADS / 32), TILES = (D + R - 1) / R;
    using Experts = ExpertTile<F, I, 1, R, D, EXPERT_BYTES>;
    static_assert(TT <= THREADS, "route_tokens_to: a thread per token");
    __shared__ union {
        StagedChunk<TT, KC, Experts::GROUPED> x;
        float tile[R * TT];
    } smem;
    __shared__ float ss[TT];
    __shared__ float weight_of[TT];
    __shared__ int slot_of[TT];
    const int e = blockIdx.x / TILES, tile = blockIdx.x % TILES;
    if (!route_tokens_to<E, TOPK, NORM, TT>(logits, e, weight_of, slot_of)) return;
    const W* const stacks[1] = {w_down};
    VectorsFromX<I, TT, KC, false, THREADS, Experts::GROUPED> vectors{ws + (size_t)e * TT * I, nullptr, 0.0f};
    const auto rows = Experts::of(stacks, e, tile);
    gemm_tile<I, I, TT, KC, THREADS, false>(rows, 0, vectors, smem.x, smem.tile, ss);
    for (int i = threadIdx.x; i < R * TT; i += THREADS) {
        const int s = i % R, t = i / R, row = tile * R + s;
        if (row < D && slot_of[t] >= 0)
            terms[((size_t)t * TOPK + slot_of[t]) * D + row] = weight_of[t] * (smem.tile[s * TT + t] + bias(e, row));
    }
}

// Batched prefill, the sum: each token's TOPK terms of moe_down_tokens added in slot order, handed
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

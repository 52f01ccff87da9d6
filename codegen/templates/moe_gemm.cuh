// The moe family's batched-prefill form (moe.cuh says why every expert streams once per step):
// GEMMs per expert over all the step's tokens, on gemm.cuh's tiles. Prefill modules only.
#pragma once
#include "gemm.cuh"
#include "moe.cuh"

// Batched prefill, gate and up: block (expert e, tile of R = 16 x warps rows), in a grid of E x
// ceil(I / R) blocks, writes glu(gate, up) of every token of the step into the workspace ws
// [E][TT][I]; an expert no token chose is skipped. The blocks also zero out [TT][D], which
// moe_down_tokens adds into.
template <int E, int TOPK, int I, int D, int TT, int KC, int THREADS, class Glu>
__device__ __forceinline__ void moe_up_tokens(const float* x, const float* logits, const weight_t* w_gate,
                                              const weight_t* w_up, float* ws, float* out, Glu glu) {
    constexpr int R = 16 * (THREADS / 32), TILES = (I + R - 1) / R;
    static_assert(TT <= THREADS, "route_tokens_to: a thread per token");
    __shared__ union {
        StagedChunk<TT, KC> x;                   // the k loop's chunk of the tokens' vectors
        float tile[2 * R * TT];               // then [gate, up][R][TT] dot products
    } smem;
    __shared__ float ss[TT];                 // (no norm prologue: unused)
    __shared__ float weight_of[TT];
    const int e = blockIdx.x / TILES, tile = blockIdx.x % TILES;
    for (int i = blockIdx.x * THREADS + threadIdx.x; i < TT * D; i += gridDim.x * THREADS) out[i] = 0.0f;
    if (!route_tokens_to<E, TOPK, TT>(logits, e, weight_of)) return;
    const weight_t* const W[2] = {w_gate + (size_t)e * I * D, w_up + (size_t)e * I * D};
    VectorsFromX<D, TT, KC, false, THREADS> vectors{x, nullptr, 0.0f};
    const Bf16Tile<D, 2, R, I, 0, false> rows(W, tile);
    gemm_tile<D, D, TT, KC, THREADS, false>(rows, 0, vectors, smem.x, smem.tile, ss);
    for (int i = threadIdx.x; i < R * TT; i += THREADS) {
        const int s = i % R, t = i / R, row = tile * R + s;
        if (row < I) ws[((size_t)e * TT + t) * I + row] = glu(smem.tile[s * TT + t], smem.tile[(R + s) * TT + t]);
    }
}

// Batched prefill, down: block (expert e, tile of R rows) adds each token's product, times its
// weight for e, into out. Only tokens that chose e add (at most TOPK terms per output, so with
// TOPK 2 the sum is the same in either order).
template <int E, int TOPK, int I, int D, int TT, int KC, int THREADS>
__device__ __forceinline__ void moe_down_tokens(const float* logits, const weight_t* w_down, const float* ws,
                                                float* out) {
    constexpr int R = 16 * (THREADS / 32), TILES = (D + R - 1) / R;
    static_assert(TT <= THREADS, "route_tokens_to: a thread per token");
    __shared__ union {
        StagedChunk<TT, KC> x;
        float tile[R * TT];
    } smem;
    __shared__ float ss[TT];
    __shared__ float weight_of[TT];
    const int e = blockIdx.x / TILES, tile = blockIdx.x % TILES;
    if (!route_tokens_to<E, TOPK, TT>(logits, e, weight_of)) return;
    const weight_t* const W[1] = {w_down + (size_t)e * D * I};
    VectorsFromX<I, TT, KC, false, THREADS> vectors{ws + (size_t)e * TT * I, nullptr, 0.0f};
    const Bf16Tile<I, 1, R, D, 0, false> rows(W, tile);
    gemm_tile<I, I, TT, KC, THREADS, false>(rows, 0, vectors, smem.x, smem.tile, ss);
    for (int i = threadIdx.x; i < R * TT; i += THREADS) {
        const int s = i % R, t = i / R, row = tile * R + s;
        if (row < D && weight_of[t] != 0.0f) atomicAdd(out + t * D + row, weight_of[t] * smem.tile[s * TT + t]);
    }
}

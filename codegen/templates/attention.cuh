// Decode attention over a bf16 KV cache, split over the context (flash-decoding): each block
// scores one chunk of positions for one query head and leaves (max, sum, weighted values) in a
// workspace; a combine kernel merges the chunks of every head.
#pragma once
#include "common.cuh"

// Workspace per (head, chunk): [0] = running max, [1] = sum of exp, [2 : 2 + HD] = sum of exp * v.
template <int H, int KV, int HD, int CHUNK, int NCHUNK>  // blockDim.x == 128
__device__ __forceinline__ void attention_chunk(const float* q, const bf16_t* kc, const bf16_t* vc, int pos,
                                                int window, float scale, float softcap, float* ws) {
    constexpr int W = KV * HD;                  // floats per cache row
    const int h = blockIdx.x, c = blockIdx.y, kvh = h / (H / KV);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    float* out = ws + ((size_t)h * NCHUNK + c) * (HD + 2);
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int start = max(c * CHUNK, lo), end = min(c * CHUNK + CHUNK, pos + 1);
    if (start >= end) {                         // nothing to attend in this chunk
        if (threadIdx.x == 0) { out[0] = NEG_INF; out[1] = 0.0f; }
        return;
    }
    __shared__ float qs[HD];
    __shared__ float score[CHUNK];
    __shared__ float partial[4][HD];               // per-warp sums of exp * v (blockDim.x == 128)
    for (int d = threadIdx.x; d < HD; d += blockDim.x) qs[d] = q[h * HD + d] * scale;
    __syncthreads();
    // Scores: one lane per position, the whole head row in 16-byte loads (latency hides across lanes).
    for (int p = start + threadIdx.x; p < end; p += blockDim.x) {
        const bf16_t* k = kc + (size_t)p * W + kvh * HD;
        float s = 0.0f;
        if constexpr (HD % 8 == 0) {              // rows and heads 16-byte aligned
#pragma unroll
            for (int d = 0; d < HD; d += 8) {
                const uint4 raw = __ldg(reinterpret_cast<const uint4*>(k + d));
                const bf16_t* kv = reinterpret_cast<const bf16_t*>(&raw);
#pragma unroll
                for (int i = 0; i < 8; i++) s = fmaf(qs[d + i], bf16_to_f32(kv[i]), s);
            }
        } else {
            for (int d = 0; d < HD; d++) s = fmaf(qs[d], bf16_to_f32(k[d]), s);
        }
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        score[p - start] = s;
    }
    __syncthreads();
    float m = NEG_INF;
    for (int i = threadIdx.x; i < end - start; i += blockDim.x) m = fmaxf(m, score[i]);
    m = block_max(m);
    float l = 0.0f;
    for (int i = threadIdx.x; i < end - start; i += blockDim.x) {
        const float e = __expf(score[i] - m);
        score[i] = e;
        l += e;
    }
    l = block_sum(l);                           // its barriers also publish score[]
    // Values: LPP lanes share a position, each owning 8 consecutive dims (one 16-byte load), so a
    // warp reads 32 / LPP whole value rows per step; partial sums meet through shuffles and smem.
    if constexpr (HD % 8 == 0 && 32 % (HD / 8) == 0) {
        constexpr int LPP = HD / 8, PPW = 32 / LPP;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        const int sub = lane / LPP, d0 = (lane % LPP) * 8;
#pragma unroll 4
        for (int p = start + warp * PPW + sub; p < end; p += warps * PPW) {
            const float e = score[p - start];
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(vc + (size_t)p * W + kvh * HD + d0));
            const bf16_t* v = reinterpret_cast<const bf16_t*>(&raw);
#pragma unroll
            for (int j = 0; j < 8; j++) acc[j] = fmaf(e, bf16_to_f32(v[j]), acc[j]);
        }
#pragma unroll
        for (int o = LPP; o < 32; o <<= 1)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
        if (sub == 0)
#pragma unroll
            for (int j = 0; j < 8; j++) partial[warp][d0 + j] = acc[j];
    } else {                                     // any head size: one dim per lane, 2-byte loads
        constexpr int PER = (HD + 31) / 32;
        float acc[PER];
#pragma unroll
        for (int j = 0; j < PER; j++) acc[j] = 0.0f;
        for (int p = start + warp; p < end; p += warps) {
            const float e = score[p - start];
            const bf16_t* v = vc + (size_t)p * W + kvh * HD;
#pragma unroll
            for (int j = 0; j < PER; j++)
                if (lane + 32 * j < HD) acc[j] = fmaf(e, bf16_to_f32(v[lane + 32 * j]), acc[j]);
        }
#pragma unroll
        for (int j = 0; j < PER; j++)
            if (lane + 32 * j < HD) partial[warp][lane + 32 * j] = acc[j];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += blockDim.x)
        out[2 + d] = partial[0][d] + partial[1][d] + partial[2][d] + partial[3][d];
    if (threadIdx.x == 0) { out[0] = m; out[1] = l; }
}

template <int HD, int NCHUNK>
__device__ __forceinline__ void attention_combine(const float* ws, float* o) {
    const int h = blockIdx.x;
    const float* part = ws + (size_t)h * NCHUNK * (HD + 2);
    float m = NEG_INF;
    for (int c = 0; c < NCHUNK; c++)
        if (part[c * (HD + 2) + 1] > 0.0f) m = fmaxf(m, part[c * (HD + 2)]);
    float l = 0.0f;
    for (int c = 0; c < NCHUNK; c++)
        if (part[c * (HD + 2) + 1] > 0.0f) l += part[c * (HD + 2) + 1] * __expf(part[c * (HD + 2)] - m);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float acc = 0.0f;
        for (int c = 0; c < NCHUNK; c++)   // chunks past the position hold no values: skip them
            if (part[c * (HD + 2) + 1] > 0.0f) acc += part[c * (HD + 2) + 2 + d] * __expf(part[c * (HD + 2)] - m);
        o[h * HD + d] = acc / l;
    }
}

// Decode attention over a bf16 KV cache, split over the context (flash-decoding): each block
// scores one chunk of positions for the query heads of one KV head and leaves (max, sum,
// weighted values) in a workspace; a combine kernel merges the chunks of every head.
#pragma once
#include "common.cuh"

// Workspace per (query head, chunk): [0] = max score, [1] = sum of exp, [2 : 2 + HD] = sum of exp * v.
// One block per (KV head, chunk) serves all G = H / KV query heads of the group, so each cached
// K and V row is read once per token, not once per query head.
template <int H, int KV, int HD, int CHUNK, int NCHUNK>   // blockDim.x == 128
__device__ __forceinline__ void attention_chunk(const float* q, const bf16_t* kc, const bf16_t* vc, int pos,
                                                int window, float scale, float softcap, float* ws) {
    constexpr int W = KV * HD, G = H / KV;      // floats per cache row; query heads per KV head
    const int kvh = blockIdx.x, c = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int start = max(c * CHUNK, lo), end = min(c * CHUNK + CHUNK, pos + 1);
    if (start >= end) {                         // nothing to attend in this chunk
        if (threadIdx.x < G) ws[((size_t)(kvh * G + threadIdx.x) * NCHUNK + c) * (HD + 2) + 1] = 0.0f;
        return;
    }
    __shared__ float qs[G][HD];
    __shared__ float score[G][CHUNK];
    __shared__ float partial[4][G][HD];         // per-warp sums of exp * v
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) qs[i / HD][i % HD] = q[kvh * G * HD + i] * scale;
    __syncthreads();
    // Scores: one thread per position, the K row in 16-byte loads, every query head of the group.
    for (int p = start + threadIdx.x; p < end; p += blockDim.x) {
        const bf16_t* k = kc + (size_t)p * W + kvh * HD;
        float s[G];
#pragma unroll
        for (int g = 0; g < G; g++) s[g] = 0.0f;
        if constexpr (HD % 8 == 0) {
#pragma unroll 4
            for (int d = 0; d < HD; d += 8) {
                const uint4 raw = *reinterpret_cast<const uint4*>(k + d);
                const bf16_t* kv = reinterpret_cast<const bf16_t*>(&raw);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float kf = bf16_to_f32(kv[i]);
#pragma unroll
                    for (int g = 0; g < G; g++) s[g] = fmaf(qs[g][d + i], kf, s[g]);
                }
            }
        } else {
            for (int d = 0; d < HD; d++) {
                const float kf = bf16_to_f32(k[d]);
#pragma unroll
                for (int g = 0; g < G; g++) s[g] = fmaf(qs[g][d], kf, s[g]);
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++) score[g][p - start] = softcap > 0.0f ? softcap * tanhf(s[g] / softcap) : s[g];
    }
    __syncthreads();
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        float mg = NEG_INF;
        for (int i = threadIdx.x; i < end - start; i += blockDim.x) mg = fmaxf(mg, score[g][i]);
        m[g] = block_max(mg);
        float lg = 0.0f;
        for (int i = threadIdx.x; i < end - start; i += blockDim.x) {
            const float e = __expf(score[g][i] - m[g]);
            score[g][i] = e;
            lg += e;
        }
        l[g] = block_sum(lg);                   // its barriers also publish score[g]
    }
    // Values: LPP lanes share a position, each owning 8 consecutive dims (one 16-byte load), so a
    // warp reads 32 / LPP whole value rows per step; partial sums meet through shuffles and smem.
    if constexpr (HD % 8 == 0 && 32 % (HD / 8) == 0) {
        constexpr int LPP = HD / 8, PPW = 32 / LPP;
        float acc[G][8];
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[g][j] = 0.0f;
        const int sub = lane / LPP, d0 = (lane % LPP) * 8;
#pragma unroll 2
        for (int p = start + warp * PPW + sub; p < end; p += warps * PPW) {
            const uint4 raw = *reinterpret_cast<const uint4*>(vc + (size_t)p * W + kvh * HD + d0);
            const bf16_t* v = reinterpret_cast<const bf16_t*>(&raw);
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float e = score[g][p - start];
#pragma unroll
                for (int j = 0; j < 8; j++) acc[g][j] = fmaf(e, bf16_to_f32(v[j]), acc[g][j]);
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float a = acc[g][j];
#pragma unroll
                for (int o = LPP; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                if (sub == 0) partial[warp][g][d0 + j] = a;
            }
    } else {                                     // any head size: one dim per lane, 2-byte loads
        for (int g = 0; g < G; g++)
            for (int d = lane; d < HD; d += 32) {
                float a = 0.0f;
                for (int p = start + warp; p < end; p += warps)
                    a = fmaf(score[g][p - start], bf16_to_f32(vc[(size_t)p * W + kvh * HD + d]), a);
                partial[warp][g][d] = a;
            }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        float* out = ws + ((size_t)(kvh * G + g) * NCHUNK + c) * (HD + 2);
        out[2 + d] = partial[0][g][d] + partial[1][g][d] + partial[2][g][d] + partial[3][g][d];
        if (d == 0) { out[0] = m[g]; out[1] = l[g]; }
    }
}

// Merge the chunks of one query head: chunks [c0, c1] are the ones the split kernel filled.
// Chunk weights go through shared memory so that the per-dimension sums issue independent loads.
template <int HD, int CHUNK, int NCHUNK>
__device__ __forceinline__ void attention_combine(const float* ws, float* o, int pos, int window) {
    __shared__ float weight[NCHUNK];
    const int h = blockIdx.x;
    const int c0 = (window > 0 ? max(0, pos - window + 1) : 0) / CHUNK, c1 = pos / CHUNK;
    const float* part = ws + (size_t)h * NCHUNK * (HD + 2);
    float m = NEG_INF;
    for (int c = c0 + threadIdx.x; c <= c1; c += blockDim.x) m = fmaxf(m, part[c * (HD + 2)]);
    m = block_max(m);
    float l = 0.0f;
    for (int c = c0 + threadIdx.x; c <= c1; c += blockDim.x) {
        const float w = __expf(part[c * (HD + 2)] - m);
        weight[c] = w;
        l += w * part[c * (HD + 2) + 1];
    }
    l = block_sum(l);                           // its barriers also publish weight[]
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 8
        for (int c = c0; c <= c1; c++) acc = fmaf(weight[c], part[c * (HD + 2) + 2 + d], acc);
        o[h * HD + d] = acc / l;
    }
}

// Row-wise building blocks: one block owns one token's row and runs the kernel's ops in turn.
#pragma once
#include "common.cuh"
#include "kv_cache.cuh"

// A row that other blocks of this kernel wrote (a gemv kernel's tail reads its GEMVs' results),
// read through L2: L1 is not kept coherent with other SMs' writes. The helpers below take it
// wherever they take a row pointer (Row: const float* or RowFromL2).
struct RowFromL2 {
    const float* p;
    __device__ __forceinline__ float operator[](int i) const { return __ldcg(p + i); }
};

// Index of the largest element of x[0:n] (the first one on ties), for the whole block.
template <class Row>
__device__ __forceinline__ int block_argmax(const Row x, int n) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    float v = NEG_INF;
    int idx = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (x[i] > v) { v = x[i]; idx = i; }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) { best_v[warp] = v; best_i[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? best_v[lane] : NEG_INF;
        idx = lane < warps ? best_i[lane] : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
        }
        if (lane == 0) best_i[0] = idx;
    }
    __syncthreads();
    return best_i[0];
}

// RMSNorm of x[0:n] in groups of `group` (group == n: the whole row), weight w[group]. Groups
// (per-head norms) go one per warp, all at once: a block-wide reduction per group would run them
// one after another.
template <class Row>
__device__ __forceinline__ void rmsnorm_row(const Row x, const weight_t* w, float* out, int n, int group,
                                            float eps, float offset) {
    if (group < n) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
        for (int g0 = warp * group; g0 < n; g0 += warps * group) {
            float ss = 0.0f;
            for (int i = lane; i < group; i += 32) ss += x[g0 + i] * x[g0 + i];
            const float scale = rms_scale(warp_sum(ss), group, eps);
            for (int i = lane; i < group; i += 32) out[g0 + i] = x[g0 + i] * scale * (w2f(w[i]) + offset);
        }
        return;
    }
    for (int g0 = 0; g0 < n; g0 += group) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < group; i += blockDim.x) ss += x[g0 + i] * x[g0 + i];
        const float scale = rms_scale(block_sum(ss), group, eps);
        for (int i = threadIdx.x; i < group; i += blockDim.x)
            out[g0 + i] = x[g0 + i] * scale * (w2f(w[i]) + offset);
    }
}

template <class Row>
__device__ __forceinline__ void softmax_row(const Row x, float* out, int n) {
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, x[i]);
    m = block_max(m);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += __expf(x[i] - m);
    const float inv = 1.0f / block_sum(sum);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __expf(x[i] - m) * inv;
}

// RoPE over a row of heads of `hd`: element i pairs with i +- rot/2 (or its odd/even neighbour).
// Not inlined: sincosf's slow path (angles past ~1e5 radians) keeps a stack frame, and inlined
// twice into a GEMV's tail (Q's and K's RoPE) it made ptxas spill around it.
template <class Row>
__device__ __noinline__ void rope_row(const Row x, float* out, int n, int hd, int pairs,
                                         bool interleaved, int pos, const float* inv_freq) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int j = i % hd, base = i - j;
        int pair, partner;
        bool second;
        if (interleaved) { pair = j >> 1; second = j & 1; partner = base + (j ^ 1); }
        else { second = j >= pairs; pair = second ? j - pairs : j; partner = base + (second ? j - pairs : j + pairs); }
        out[i] = pair < pairs ? rope_rotate(x[i], x[partner], second, (float)pos * inv_freq[pair]) : x[i];
    }
}

// GEMV building blocks: one warp computes one output row, streaming the weight row with 16-byte
// loads that bypass L1 (__ldcs: each weight byte is read once per token) while the input vector
// comes through L1, since every warp of the block re-reads it. The vector is read with plain
// loads, never __ldg: it is the previous kernel's output, and a load marked invariant may be
// hoisted above the wait for that kernel (see grid_wait_then_release).
#pragma once
#include "common.cuh"
#include "kv_cache.cuh"

// x[k .. k + 8) of a vector, 16-byte aligned, as two plain 16-byte loads (never __ldg: see above).
__device__ __forceinline__ void load_f32x8(const float* x, int k, float (&v)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(x + k);
    const float4 b = *reinterpret_cast<const float4*>(x + k + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// The norm prologue on x[k .. k + 8) in v: their squares added to ss, then each times its gain
// gain[k + i] + offset. The gain is a weight, written by no kernel: __ldg is safe before the wait.
__device__ __forceinline__ void apply_gain8(float (&v)[8], const weight_t* gain, int k, float offset, float& ss) {
    float g[8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(gain + k)), g);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        ss = fmaf(v[i], v[i], ss);
        v[i] *= g[i] + offset;
    }
}

// The input vector as the GEMV sees it: x itself ...
struct PlainVector {
    static constexpr bool NORMED = false;
    const float* x;
    __device__ __forceinline__ PlainVector from(int k0) const { return {x + k0}; }
    __device__ __forceinline__ void load8(int k, float (&v)[8], float&) const { load_f32x8(x, k, v); }
    __device__ __forceinline__ float at(int k, float&) const { return x[k]; }
};

// ... or RMSNorm(x) without its 1/rms factor: the prologue. dot(W, x * s * g) = s * dot(W, x * g),
// so the block applies s = 1/rms(x) to the finished dot products, and the weight stream starts at
// once instead of waiting for a block-wide reduction. The sum of squares for s is gathered from
// the very x values the dot products load (into `ss`), not by a second pass over x.
struct NormedVector {
    static constexpr bool NORMED = true;
    const float* x;
    const weight_t* w;
    float offset;   // 1 for norms that multiply by (1 + w)
    __device__ __forceinline__ NormedVector from(int k0) const { return {x + k0, w + k0, offset}; }
    __device__ __forceinline__ void load8(int k, float (&v)[8], float& ss) const {
        load_f32x8(x, k, v);
        apply_gain8(v, w, k, offset, ss);
    }
    __device__ __forceinline__ float at(int k, float& ss) const {
        ss = fmaf(x[k], x[k], ss);
        return x[k] * (w2f(w[k]) + offset);
    }
};

// A value whose K-slices were computed by different warps: the slices added in slice order, so
// that the sum has the same bits whichever warp finished first (atomics would add in arrival order).
template <int S, int N>
__device__ __forceinline__ float slices_sum(const float (&part)[S][N], int i) {
    float sum = part[0][i];
#pragma unroll
    for (int k = 1; k < S; k++) sum += part[k][i];
    return sum;
}
template <int S>
__device__ __forceinline__ float slices_sum(const float (&part)[S]) {
    float sum = part[0];
#pragma unroll
    for (int k = 1; k < S; k++) sum += part[k];
    return sum;
}

// acc[r] += dot(the 8 weights in q[r], xv) for each of NR rows.
template <int NR>
__device__ __forceinline__ void fma8_rows(const uint4 (&q)[NR], const float (&xv)[8], float (&acc)[NR]) {
#pragma unroll
    for (int r = 0; r < NR; r++) {
        float w[8];
        unpack8(q[r], w);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[r] = fmaf(w[i], xv[i], acc[r]);
    }
}

// acc[r] = dot(W[rows[r], 0:K], v) for NR rows at once, by the calling warp; every lane gets the
// results, and for a normed vector `sumsq` = the sum of x^2 over its K elements. Each lane keeps
// UNROLL x NR independent 16-byte loads in flight, and each chunk of the vector it loads serves
// all NR rows (fewer L1 reads per weight byte). While `pending`, the previous kernel may still be
// running: the first weight loads are issued, then the thread waits for it
// (grid_wait_then_release) before the vector, its output, is read.
template <int K, int UNROLL, int NR, class Vector>
__device__ __forceinline__ void warp_dot_rows(const weight_t* const (&rows)[NR], const Vector& v, float (&acc)[NR],
                                              bool& pending, float& sumsq) {
    constexpr int CHUNK = 8;                         // weights per 16-byte load
    constexpr int STEP = 32 * CHUNK;                 // weights per warp-wide load
    constexpr int FULL = K % CHUNK ? 0 : K / (STEP * UNROLL) * (STEP * UNROLL);
    const int lane = threadIdx.x & 31;
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    if constexpr (K % CHUNK != 0) {                  // rows are not 16-byte aligned: scalar loads
        if (pending) { grid_wait_then_release(); pending = false; }
        for (int k = lane; k < K; k += 32) {
            const float xk = v.at(k, ss);
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r] = fmaf(w2f(rows[r][k]), xk, acc[r]);
        }
    } else {
        for (int base = 0; base < FULL; base += STEP * UNROLL) {
            uint4 q[UNROLL][NR];
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
#pragma unroll
                for (int r = 0; r < NR; r++)
                    q[u][r] = __ldcs(reinterpret_cast<const uint4*>(rows[r] + base + u * STEP + lane * CHUNK));
            if (pending) { grid_wait_then_release(); pending = false; }   // weights in flight meanwhile
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                float xv[8];
                v.load8(base + u * STEP + lane * CHUNK, xv, ss);
                fma8_rows(q[u], xv, acc);
            }
        }
        // The rest (all of it for rows shorter than STEP * UNROLL): every load first, then the
        // wait (if still pending), then the arithmetic.
        constexpr int REM = (K - FULL + STEP - 1) / STEP;
        if constexpr (REM > 0) {
            uint4 q[REM][NR];
#pragma unroll
            for (int j = 0; j < REM; j++) {
                const int k = FULL + j * STEP + lane * CHUNK;
#pragma unroll
                for (int r = 0; r < NR; r++)
                    q[j][r] = k < K ? __ldcs(reinterpret_cast<const uint4*>(rows[r] + k)) : uint4{0u, 0u, 0u, 0u};
            }
            if (pending) { grid_wait_then_release(); pending = false; }
#pragma unroll
            for (int j = 0; j < REM; j++) {
                const int k = FULL + j * STEP + lane * CHUNK;
                if (k < K) {
                    float xv[8];
                    v.load8(k, xv, ss);
                    fma8_rows(q[j], xv, acc);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = warp_sum(acc[r]);
    sumsq = Vector::NORMED ? warp_sum(ss) : 0.0f;
}

template <int K, int UNROLL, int NR, class Vector>
__device__ __forceinline__ void warp_dot_rows(const weight_t* const (&rows)[NR], const Vector& v, float (&acc)[NR],
                                              bool& pending) {
    float unused;
    warp_dot_rows<K, UNROLL, NR>(rows, v, acc, pending, unused);
}

// Which output row slot `s` of tile `tile` computes. Contiguous tiles own rows [tile*R, tile*R+R);
// paired tiles (for RoPE over heads of HD) own R/2 rotation pairs, partners in adjacent slots
// (s, s^1), so a row-local epilogue finds its partner in the same block. `pair` gets the index
// of the pair within its head (the RoPE frequency). Returns -1 past the end.
template <int R, int N, int HD, bool INTERLEAVED>
__device__ __forceinline__ int slot_row(int tile, int s, int& pair) {
    if constexpr (HD == 0) {
        pair = 0;
        int row = tile * R + s;
        return row < N ? row : -1;
    } else {
        constexpr int HALF = HD / 2;
        int p = tile * (R / 2) + (s >> 1);
        if (p >= N / 2) return -1;
        int head = p / HALF;
        pair = p % HALF;
        return INTERLEAVED ? head * HD + 2 * pair + (s & 1) : head * HD + pair + (s & 1) * HALF;
    }
}


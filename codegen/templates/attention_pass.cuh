// Building blocks of decode attention: the softmax state of a query head, merged across passes,
// lanes and warps, and LanePass, one pass of a block over a range of cache rows on CUDA cores
// (attention_mma.cuh has the tensor-core pass). attention.cuh assembles the kernels from a pass.
//
// A pass type P offers: CHUNK (positions per pass), State (this lane's softmax states, with
// merge: fold in another pass's), load / before_wait / after_wait (issue the loads of a pass),
// load_queries, softmax (the states over the loaded rows) and block_merge (the warps' states meet
// in shared memory; emit(g, d, max, sum, weighted value) per head and dim).
#pragma once
#include "common.cuh"
#include "kv_cache.cuh"

// LPR lanes share one cache row, each owning 8 consecutive dims (a 16-byte load when rows are
// 16-byte aligned); a warp covers PPL = 32 / LPR rows per load. LPR is a power of two, so lanes
// past the head dim (HD not a power of two) own nothing.
template <int HD>
struct RowLanes {
    static_assert(HD <= 256, "head_dim > 256");
    static constexpr int LPR = HD <= 8 ? 1 : HD <= 16 ? 2 : HD <= 32 ? 4 : HD <= 64 ? 8 : HD <= 128 ? 16 : 32;
    static constexpr int PPL = 32 / LPR;
};

// Dims d0 .. d0 + 7 of a bf16 row, as raw bits (zero past HD).
template <int HD>
__device__ __forceinline__ uint4 load_dims8(const bf16_t* row, int d0) {
    if (d0 >= HD) return make_uint4(0u, 0u, 0u, 0u);
    if constexpr (HD % 8 == 0) {
        return *reinterpret_cast<const uint4*>(row + d0);
    } else {
        unsigned h[8];
#pragma unroll
        for (int i = 0; i < 8; i++) h[i] = d0 + i < HD ? row[d0 + i] : 0u;
        return make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
    }
}

// Dims d0 .. d0 + 7 of an fp8 row's codes (zero past HD).
template <int HD>
__device__ __forceinline__ uint2 load_codes8(const unsigned char* row, int d0) {
    if (d0 >= HD) return make_uint2(0u, 0u);
    if constexpr (HD % 8 == 0) {
        return *reinterpret_cast<const uint2*>(row + d0);
    } else {
        unsigned b[8];
#pragma unroll
        for (int i = 0; i < 8; i++) b[i] = d0 + i < HD ? row[d0 + i] : 0u;
        return make_uint2(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24);
    }
}

// The 8 e4m3 codes of one 8-byte load, as float32.
__device__ __forceinline__ void unpack8_e4m3(uint2 q, float (&out)[8]) {
    float a[4], b[4];
    e4m3x4_to_f32(q.x, a);
    e4m3x4_to_f32(q.y, b);
#pragma unroll
    for (int i = 0; i < 4; i++) { out[i] = a[i]; out[4 + i] = b[i]; }
}

// Sum (or max) over the lanes whose index differs only in the bits FROM .. 16.
template <int FROM>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
    for (int o = FROM; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <int FROM>
__device__ __forceinline__ float lanes_max(float v) {
#pragma unroll
    for (int o = FROM; o < 32; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// 8 dims of a cache row as a pass holds them: bf16 (16 bytes) or fp8 codes (8 bytes).
template <bool FP8> struct Cells { using T = uint4; };
template <> struct Cells<true> { using T = uint2; };

// Softmax state of one query head over the rows seen so far: max score, sum of exp(score - m),
// and this lane's N dims of the exp-weighted sum of values.
template <int N>
struct Softmax {
    float m = NEG_INF, l = 0.0f, acc[N] = {};

    // Fold in another state (rescaling whichever has the smaller max).
    __device__ __forceinline__ void merge(const Softmax& o) {
        const float mx = fmaxf(m, o.m);
        if (mx == NEG_INF) return;
        const float a = __expf(m - mx), b = __expf(o.m - mx);   // exp(-inf) = 0
        l = l * a + o.l * b;
#pragma unroll
        for (int i = 0; i < N; i++) acc[i] = acc[i] * a + o.acc[i] * b;
        m = mx;
    }
};

// The warps' states of G query heads in shared memory ([warp][head] max and sum, [warp][head][dim]
// weighted values, rows HDP floats apart), merged per head and dim: emit(g, d, m, l, a). The
// caller fills them and syncs first.
template <int G, int HD, int WARPS, int HDP>
struct WarpStates {
    float m[WARPS][G], l[WARPS][G], acc[WARPS][G][HDP];

    template <class Emit>
    __device__ __forceinline__ void merge(Emit emit) const {
        for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
            const int g = i / HD, d = i % HD;
            float mx = NEG_INF;
#pragma unroll
            for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, m[w][g]);
            float sum = 0.0f, a = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; w++) {
                const float f = m[w][g] == NEG_INF ? 0.0f : __expf(m[w][g] - mx);
                sum = fmaf(f, l[w][g], sum);
                a = fmaf(f, acc[w][g][d], a);
            }
            emit(g, d, mx, sum, a);
        }
    }
};

// One pass of a block over cache rows [base, base + CHUNK) for KV head blockIdx.x and its G query
// heads (each cached K and V row is read once per token, not once per query head), on CUDA cores.
// Row r goes to warp (r / PPL) % WARPS, step r / (PPL * WARPS) of its J, lane group r % PPL; rows
// outside [start, end) are masked. blockDim.x == 32 * WARPS. C: the cache layout (kv_cache.cuh);
// fp8 rows' scales multiply the scores and, folded into the probabilities, the values.
template <int KV, int HD, int WARPS, int J, int G, class C = KvBf16>
struct LanePass {
    using L = RowLanes<HD>;
    static constexpr int CHUNK = WARPS * L::PPL * J, W = KV * HD;
    struct State {
        Softmax<8> h[G];
        __device__ __forceinline__ void merge(const State& o) {
#pragma unroll
            for (int g = 0; g < G; g++) h[g].merge(o.h[g]);
        }
    };
    using Cache = C;                             // the KV rows' policy (kv_cache.cuh)
    using Elem = typename C::Elem;
    typename Cells<C::FP8>::T k[J], v[J];        // 8 dims of a row: bf16 (uint4) or fp8 codes (uint2)
    bool valid[J];
    float ks[J], vs[J];                          // fp8: the rows' scales
    float qv[G][8];                              // this lane's dims of each query head, times scale

    __device__ __forceinline__ static int row(int base, int j) {
        return base + (j * WARPS + (threadIdx.x >> 5)) * L::PPL + (threadIdx.x & 31) / L::LPR;
    }
    __device__ __forceinline__ static const Elem* at(const Elem* cache, int p) {
        return C::template row<W>(cache, p) + blockIdx.x * HD;
    }
    __device__ __forceinline__ static typename Cells<C::FP8>::T dims8(const Elem* row, int d0) {
        if constexpr (C::FP8) return load_codes8<HD>(row, d0);
        else return load_dims8<HD>(row, d0);
    }
    __device__ __forceinline__ static void unpack(const typename Cells<C::FP8>::T& x, float (&out)[8]) {
        if constexpr (C::FP8) unpack8_e4m3(x, out);
        else unpack8_bf16(x, out);
    }
    // fp8: the scales of row p (zero where it is not loaded).
    __device__ __forceinline__ void load_scales(const Elem* kc, const Elem* vc, int j, int p, bool now) {
        if constexpr (C::FP8) {
            ks[j] = now ? C::template scale<W>(kc, p, blockIdx.x) : 0.0f;
            vs[j] = now ? C::template scale<W>(vc, p, blockIdx.x) : 0.0f;
        }
    }
    // Rows before pos were written by earlier steps, so their loads may go out before the wait for
    // the previous kernel, which writes row pos. Only where row slices are whole 32-byte sectors:
    // otherwise a sector read early could hold part of row pos and be served stale from L1.
    // fp8 rows are whole sectors (kv_cache.cuh) whatever HD.
    static constexpr bool EARLY = C::FP8 || HD % 16 == 0;
    __device__ __forceinline__ void before_wait(const Elem* kc, const Elem* vc, int base, int start, int end,
                                                int pos) {
        if (EARLY) load(kc, vc, base, start, end, pos);
    }
    __device__ __forceinline__ void after_wait(const Elem* kc, const Elem* vc, int base, int start, int end,
                                               int pos) {
        if (EARLY) load_row(kc, vc, base, pos);
        else load(kc, vc, base, start, end, -1);
    }
    // Issue every load of this lane's rows, but row `skip` (the previous kernel may still write it).
    __device__ __forceinline__ void load(const Elem* kc, const Elem* vc, int base, int start, int end, int skip) {
        const int d0 = (threadIdx.x & 31) % L::LPR * 8;
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int p = row(base, j);
            valid[j] = p >= start && p < end;
            const bool now = valid[j] && p != skip;
            k[j] = now ? dims8(at(kc, p), d0) : typename Cells<C::FP8>::T{};
            v[j] = now ? dims8(at(vc, p), d0) : typename Cells<C::FP8>::T{};
            load_scales(kc, vc, j, p, now);
        }
    }
    // The row skipped by load(), once the previous kernel has finished.
    __device__ __forceinline__ void load_row(const Elem* kc, const Elem* vc, int base, int p) {
        const int d0 = (threadIdx.x & 31) % L::LPR * 8;
#pragma unroll
        for (int j = 0; j < J; j++)
            if (row(base, j) == p) {
                k[j] = dims8(at(kc, p), d0);
                v[j] = dims8(at(vc, p), d0);
                load_scales(kc, vc, j, p, true);
            }
    }
    // The G query heads of KV head blockIdx.x, times `scale`: dims d0 .. d0 + 7 of each, for this lane.
    __device__ __forceinline__ void load_queries(const float* q, float scale) {
        const int d0 = (threadIdx.x & 31) % L::LPR * 8;
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int i = 0; i < 8; i++) qv[g][i] = d0 + i < HD ? q[(blockIdx.x * G + g) * HD + d0 + i] * scale : 0.0f;
    }
    // The warp's softmax state of each query head over this pass's rows.
    __device__ __forceinline__ void softmax(float softcap, State& out) const {
        float s[J][G];                           // scores, summed over the LPR lanes of each row
#pragma unroll
        for (int j = 0; j < J; j++) {
            float kf[8];
            unpack(k[j], kf);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float a = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) a = fmaf(qv[g][i], kf[i], a);
#pragma unroll
                for (int o = 1; o < L::LPR; o <<= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                if constexpr (C::FP8) a *= ks[j];
                s[j][g] = !valid[j] ? NEG_INF : softcap > 0.0f ? softcap * tanhf(a / softcap) : a;
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            Softmax<8>& o = out.h[g];
            o = Softmax<8>{};
#pragma unroll
            for (int j = 0; j < J; j++) o.m = fmaxf(o.m, s[j][g]);
            o.m = lanes_max<L::LPR>(o.m);
#pragma unroll
            for (int j = 0; j < J; j++) {
                const float e = valid[j] ? __expf(s[j][g] - o.m) : 0.0f;   // o.m is finite where any row is valid
                float vf[8];
                unpack(v[j], vf);
                o.l += e;
                const float ev = C::FP8 ? e * vs[j] : e;   // fp8: the row's value scale
#pragma unroll
                for (int i = 0; i < 8; i++) o.acc[i] = fmaf(ev, vf[i], o.acc[i]);
            }
            o.l = lanes_sum<L::LPR>(o.l);
#pragma unroll
            for (int i = 0; i < 8; i++) o.acc[i] = lanes_sum<L::LPR>(o.acc[i]);
        }
    }
    // Lane group 0 of each warp holds the warp's sums.
    template <class Emit>
    __device__ __forceinline__ static void block_merge(const State& st, Emit emit) {
        __shared__ WarpStates<G, HD, WARPS, L::LPR * 8> ws;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        if (lane < L::LPR) {
#pragma unroll
            for (int g = 0; g < G; g++) {
#pragma unroll
                for (int i = 0; i < 8; i++) ws.acc[warp][g][lane * 8 + i] = st.h[g].acc[i];
                if (lane == 0) { ws.m[warp][g] = st.h[g].m; ws.l[warp][g] = st.h[g].l; }
            }
        }
        __syncthreads();
        ws.merge(emit);
    }
};

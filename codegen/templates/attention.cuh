// Decode attention over a bf16 KV cache, three kernels built from a pass type (LanePass on CUDA
// cores in attention_pass.cuh, MmaPass on tensor cores in attention_mma.cuh):
// - attention_chunk, the flash-decoding split: each block scores one chunk of positions for the
//   query heads of one KV head and leaves (max, sum, weighted values) in a workspace;
// - attention_combine merges the chunks of every query head;
// - attention_project, where the compiler fused the output projection in: the merge of each KV
//   head's chunks, multiplied straight into its share of the projection (no combine launch);
// - attention_single, for short contexts: one block per KV head walks every position and writes
//   the output itself, one launch instead of two.
// Decode attention is short: at a few hundred positions its time is latency, not bytes. So each
// lane issues every load it will need at once (its slices of the pass's cache rows, K and V),
// before the wait for the previous kernel where it can.
#pragma once
#include "attention_mma.cuh"

// Workspace record per (query head, chunk), 16-byte aligned: [0 : HD] = sum of exp * v, then at
// MAX_AT the max score and at SUM_AT the sum of exp.
template <int HD>
struct Record {
    static constexpr int MAX_AT = (HD + 3) / 4 * 4, SUM_AT = MAX_AT + 1, FLOATS = MAX_AT + 4;
};

// Flash-decoding split: block (KV head, chunk blockIdx.y) leaves its chunk's softmax state of each
// query head in the workspace for the merge; false for a chunk without positions (no records).
template <int H, int KV, int HD, class P, int NCHUNK>
__device__ __forceinline__ bool attention_chunk(const float* q, const bf16_t* kc, const bf16_t* vc, const int* pos_p,
                                                int window, float scale, float softcap, float* ws) {
    constexpr int G = H / KV;
    const int c = blockIdx.y;
    // A graph input, read before the wait: the previous step's sampler wrote it, and has finished,
    // since a kernel that releases its successor only after waiting (the Q, K, V GEMV) lies between.
    const int pos = *pos_p;
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int start = max(c * P::CHUNK, lo), end = min(c * P::CHUNK + P::CHUNK, pos + 1);
    if (start >= end) return false;             // the merge reads only chunks with positions
    P pass;
    pass.before_wait(kc, vc, c * P::CHUNK, start, end, pos);
    grid_wait_then_release();
    pass.after_wait(kc, vc, c * P::CHUNK, start, end, pos);
    pass.load_queries(q, scale);
    typename P::State st;
    pass.softmax(softcap, st);
    P::block_merge(st, [&](int g, int d, float m, float l, float a) {
        float* out = ws + ((size_t)(blockIdx.x * G + g) * NCHUNK + c) * Record<HD>::FLOATS;
        out[d] = a;
        if (d == 0) { out[Record<HD>::MAX_AT] = m; out[Record<HD>::SUM_AT] = l; }
    });
    return true;
}

// Short contexts: one block per KV head walks every position in passes and writes the attention
// output itself; no workspace, no combine launch. The first pass's loads go out before the wait.
template <int H, int KV, int HD, class P>
__device__ __forceinline__ void attention_single(const float* q, const bf16_t* kc, const bf16_t* vc, const int* pos_p,
                                                 int window, float scale, float softcap, float* o) {
    constexpr int G = H / KV;
    const int pos = *pos_p;                      // see attention_chunk
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    int base = lo / P::CHUNK * P::CHUNK;
    P pass;
    pass.before_wait(kc, vc, base, lo, min(base + P::CHUNK, pos + 1), pos);
    grid_wait_then_release();
    pass.after_wait(kc, vc, base, lo, min(base + P::CHUNK, pos + 1), pos);
    pass.load_queries(q, scale);
    typename P::State st, part;
    pass.softmax(softcap, st);
    for (base += P::CHUNK; base <= pos; base += P::CHUNK) {
        pass.load(kc, vc, base, base, min(base + P::CHUNK, pos + 1), -1);
        pass.softmax(softcap, part);
        st.merge(part);
    }
    P::block_merge(st, [&](int g, int d, float, float l, float a) {
        o[(blockIdx.x * G + g) * HD + d] = a / l;
    });
}

// Merge the chunks c0 .. c1 of query head blockIdx.x (the ones the split kernel filled). At long
// contexts there are dozens of chunks, so each warp takes every WARPS-th chunk, GROUP at a time
// with all their loads issued together (4 dims per lane), keeps a running softmax state, and
// the warps' states meet once in shared memory.
template <int HD, int CHUNK, int NCHUNK, int WARPS, int GROUP>   // blockDim.x == 32 * WARPS
__device__ __forceinline__ void attention_combine(const float* ws, float* o, int pos, int window) {
    using R = Record<HD>;
    constexpr int DSTEPS = (HD + 127) / 128;                // float4s per lane
    __shared__ float wm[WARPS], wl[WARPS], wacc[WARPS][R::MAX_AT];
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (window > 0 ? max(0, pos - window + 1) : 0) / CHUNK, c1 = pos / CHUNK;
    const float* part = ws + (size_t)h * NCHUNK * R::FLOATS;
    float m = NEG_INF, l = 0.0f, acc[DSTEPS][4] = {};
    for (int c = c0 + warp; c <= c1; c += WARPS * GROUP) {
        float mc[GROUP], lc[GROUP], v[GROUP][DSTEPS][4];
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            const int cc = c + g * WARPS;
            const float* rec = part + (size_t)cc * R::FLOATS;
            mc[g] = cc <= c1 ? rec[R::MAX_AT] : NEG_INF;
            lc[g] = cc <= c1 ? rec[R::SUM_AT] : 0.0f;
#pragma unroll
            for (int t = 0; t < DSTEPS; t++) {
                const int d = t * 128 + lane * 4;
                if constexpr (HD % 4 == 0) {
                    const float4 x = cc <= c1 && d < HD ? *reinterpret_cast<const float4*>(rec + d)
                                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    v[g][t][0] = x.x; v[g][t][1] = x.y; v[g][t][2] = x.z; v[g][t][3] = x.w;
                } else {
#pragma unroll
                    for (int i = 0; i < 4; i++) v[g][t][i] = cc <= c1 && d + i < HD ? rec[d + i] : 0.0f;
                }
            }
        }
        float mx = m;
#pragma unroll
        for (int g = 0; g < GROUP; g++) mx = fmaxf(mx, mc[g]);
        const float rescale = __expf(m - mx);                 // 0 on the first round (m = -inf)
        l *= rescale;
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            const float e = __expf(mc[g] - mx);               // 0 for chunks past c1
            l = fmaf(e, lc[g], l);
#pragma unroll
            for (int t = 0; t < DSTEPS; t++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[t][i] = fmaf(e, v[g][t][i], g == 0 ? acc[t][i] * rescale : acc[t][i]);
        }
        m = mx;
    }
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
#pragma unroll
    for (int t = 0; t < DSTEPS; t++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (t * 128 + lane * 4 + i < R::MAX_AT) wacc[warp][t * 128 + lane * 4 + i] = acc[t][i];
    __syncthreads();
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, wm[w]);
    float den = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) den = fmaf(wm[w] == NEG_INF ? 0.0f : __expf(wm[w] - mx), wl[w], den);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float num = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) num = fmaf(wm[w] == NEG_INF ? 0.0f : __expf(wm[w] - mx), wacc[w][d], num);
        o[h * HD + d] = num / den;
    }
}

// The G query heads of KV head blockIdx.x, merged from their chunks c0 .. c1 into o[G * HD]
// (shared memory), by all THREADS threads: lanes work in groups of LANES, one float4 of a record
// each; GPH groups per head take every GPH-th chunk, ROUND at a time with all their loads issued
// together (one round of L2 loads at a few thousand positions), and the groups' states meet in
// shared memory. The caller syncs before reading o.
template <int H, int KV, int HD, int NCHUNK, int THREADS>
__device__ __forceinline__ void merge_kv_head(const float* ws, int c0, int c1, float* o) {
    using R = Record<HD>;
    constexpr int G = H / KV, LANES = R::MAX_AT / 4, GROUPS = THREADS / LANES;
    static_assert(GROUPS > 0, "merge_kv_head: a record is wider than the block");
    constexpr int GPH = GROUPS / G > 0 ? GROUPS / G : 1, SLOTS = GROUPS / GPH;   // heads merged at once
    constexpr int ROUND = (NCHUNK + GPH - 1) / GPH < 8 ? (NCHUNK + GPH - 1) / GPH : 8;
    __shared__ float sm[G][GPH], sl[G][GPH], sacc[G][GPH][R::MAX_AT];
    const int gi = threadIdx.x / LANES, d = threadIdx.x % LANES * 4, part = gi % GPH;
    if (gi < SLOTS * GPH) {
        for (int g = gi / GPH; g < G; g += SLOTS) {
            const float* recs = ws + (size_t)(blockIdx.x * G + g) * NCHUNK * R::FLOATS;
            float m = NEG_INF, l = 0.0f, acc[4] = {};
            for (int c = c0 + part; c <= c1; c += GPH * ROUND) {   // chunk c has positions: m finite
                float4 st[ROUND], v[ROUND];                         // (max, sum, -, -), values d .. d+3
#pragma unroll
                for (int r = 0; r < ROUND; r++) {
                    const int cc = c + r * GPH;
                    const float* rec = recs + (size_t)cc * R::FLOATS;
                    st[r] = cc <= c1 ? *reinterpret_cast<const float4*>(rec + R::MAX_AT) : make_float4(NEG_INF, 0.0f, 0.0f, 0.0f);
                    v[r] = cc <= c1 ? *reinterpret_cast<const float4*>(rec + d) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
                float mx = m;
#pragma unroll
                for (int r = 0; r < ROUND; r++) mx = fmaxf(mx, st[r].x);
                const float rescale = __expf(m - mx);             // 0 on the first round (m = -inf)
                l *= rescale;
#pragma unroll
                for (int i = 0; i < 4; i++) acc[i] *= rescale;
#pragma unroll
                for (int r = 0; r < ROUND; r++) {
                    const float e = __expf(st[r].x - mx);         // 0 past c1
                    l = fmaf(e, st[r].y, l);
                    acc[0] = fmaf(e, v[r].x, acc[0]); acc[1] = fmaf(e, v[r].y, acc[1]);
                    acc[2] = fmaf(e, v[r].z, acc[2]); acc[3] = fmaf(e, v[r].w, acc[3]);
                }
                m = mx;
            }
#pragma unroll
            for (int i = 0; i < 4; i++) sacc[g][part][d + i] = acc[i];
            if (d == 0) { sm[g][part] = m; sl[g][part] = l; }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += THREADS) {
        const int g = i / HD, dd = i % HD;
        float mx = NEG_INF;
#pragma unroll
        for (int p = 0; p < GPH; p++) mx = fmaxf(mx, sm[g][p]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int p = 0; p < GPH; p++) {
            const float e = sm[g][p] == NEG_INF ? 0.0f : __expf(sm[g][p] - mx);   // groups without chunks
            den = fmaf(e, sl[g][p], den);
            num = fmaf(e, sacc[g][p][dd], num);
        }
        o[i] = num / den;
    }
}

// out[0 : N] = residual, shared by the KV split blocks that run it (one per KV head): the fused
// projection adds its partial dot products into out.
template <int N, int KV>
__device__ __forceinline__ void seed_output(const float* residual, float* out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += KV * blockDim.x) out[i] = residual[i];
}

// The attention output projection fused with the merge of the split's chunks: block (KV head
// blockIdx.x, tile blockIdx.y of WARPS * RW output rows) loads its rows' slice of W [N, H * HD]
// (the columns of its G query heads) before the wait, merges its heads' chunks into shared
// memory, and adds its share of each row's dot product into out, which the split started at the
// residual. A row's sum over the KV heads thus lands by atomics, in no fixed order.
template <int H, int KV, int HD, int CHUNK, int NCHUNK, int N, int RW>
__device__ __forceinline__ void attention_project(const float* ws, const weight_t* __restrict__ W, float* out,
                                                  const int* pos_p, int window) {
    constexpr int G = H / KV, GHD = G * HD, K = H * HD, WARPS = 8, PIECES = (GHD / 8 + 31) / 32;
    static_assert(HD % 8 == 0, "attention_project: 16-byte pieces of the head dim");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.y * WARPS + warp) * RW;
    const weight_t* w_cols = W + blockIdx.x * GHD;
    uint4 w[RW][PIECES];                          // [row][piece]: columns 8 (lane + 32 piece) .. + 7
#pragma unroll
    for (int r = 0; r < RW; r++)
#pragma unroll
        for (int p = 0; p < PIECES; p++) {
            const int row = row0 + r, piece = lane + 32 * p;
            w[r][p] = row < N && piece < GHD / 8 ? __ldcs(reinterpret_cast<const uint4*>(w_cols + (size_t)row * K + piece * 8))
                                                 : make_uint4(0u, 0u, 0u, 0u);
        }
    grid_wait_then_release();                     // the split's records, and out seeded
    const int pos = *pos_p;
    const int c0 = (window > 0 ? max(0, pos - window + 1) : 0) / CHUNK, c1 = pos / CHUNK;
    __shared__ __align__(16) float o[GHD];
    merge_kv_head<H, KV, HD, NCHUNK, WARPS * 32>(ws, c0, c1, o);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < RW; r++) {
        float acc = 0.0f;
#pragma unroll
        for (int p = 0; p < PIECES; p++) {
            const int piece = lane + 32 * p;
            if (piece < GHD / 8) {
                float wv[8];
                unpack8(w[r][p], wv);
                const float4 a = *reinterpret_cast<const float4*>(o + piece * 8);
                const float4 b = *reinterpret_cast<const float4*>(o + piece * 8 + 4);
                acc = fmaf(wv[0], a.x, acc); acc = fmaf(wv[1], a.y, acc); acc = fmaf(wv[2], a.z, acc);
                acc = fmaf(wv[3], a.w, acc); acc = fmaf(wv[4], b.x, acc); acc = fmaf(wv[5], b.y, acc);
                acc = fmaf(wv[6], b.z, acc); acc = fmaf(wv[7], b.w, acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0 && row0 + r < N) atomicAdd(out + row0 + r, acc);
    }
}

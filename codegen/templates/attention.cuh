// Decode attention over a bf16 KV cache, four kernels built from attention_pass.cuh:
// - attention_chunk, the flash-decoding split: each block scores one chunk of positions for the
//   query heads of one KV head and leaves (max, sum, weighted values) in a workspace;
// - attention_combine merges the chunks of every query head;
// - attention_merge, for medium contexts: the split, whose last block per KV head merges;
// - attention_single, for short contexts: one block per KV head walks every position and writes
//   the output itself, one launch instead of two.
// Decode attention is short: at a few hundred positions its time is latency, not bytes. So each
// lane issues every load it will need at once (its slices of J cache rows, K and V), before the
// wait for the previous kernel where it can, and the softmax is reduced with shuffles.
#pragma once
#include "attention_pass.cuh"

// Workspace record per (query head, chunk), 16-byte aligned: [0 : HD] = sum of exp * v, then at
// MAX_AT the max score and at SUM_AT the sum of exp.
template <int HD>
struct Record {
    static constexpr int MAX_AT = (HD + 3) / 4 * 4, SUM_AT = MAX_AT + 1, FLOATS = MAX_AT + 4;
};

// Flash-decoding split: block (KV head, chunk blockIdx.y) leaves its chunk's softmax state of each
// query head in the workspace for the merge; false for a chunk without positions (no wait then).
template <int H, int KV, int HD, int WARPS, int J, int NCHUNK>
__device__ __forceinline__ bool attention_chunk(const float* q, const bf16_t* kc, const bf16_t* vc, const int* pos_p,
                                                int window, float scale, float softcap, float* ws) {
    constexpr int G = H / KV;
    using P = Pass<KV, HD, WARPS, J>;
    const int c = blockIdx.y;
    const int pos = *pos_p;   // a graph input: written by the previous step's sampler, not by this step
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int start = max(c * P::CHUNK, lo), end = min(c * P::CHUNK + P::CHUNK, pos + 1);
    if (start >= end) return false;             // the merge reads only chunks with positions
    P pass;
    pass.before_wait(kc, vc, c * P::CHUNK, start, end, pos);
    grid_wait_then_release();
    pass.after_wait(kc, vc, c * P::CHUNK, start, end, pos);
    float qv[G][8];
    load_queries<G, HD>(q, scale, qv);
    Softmax st[G];
    pass_softmax<G>(pass, qv, softcap, st);
    block_softmax<G, HD, WARPS>(st, [&](int g, int d, float m, float l, float a) {
        float* out = ws + ((size_t)(blockIdx.x * G + g) * NCHUNK + c) * Record<HD>::FLOATS;
        out[d] = a;
        if (d == 0) { out[Record<HD>::MAX_AT] = m; out[Record<HD>::SUM_AT] = l; }
    });
    return true;
}

// Short contexts: one block per KV head walks every position in passes and writes the attention
// output itself; no workspace, no combine launch. The first pass's loads go out before the wait.
template <int H, int KV, int HD, int WARPS, int J>
__device__ __forceinline__ void attention_single(const float* q, const bf16_t* kc, const bf16_t* vc, const int* pos_p,
                                                 int window, float scale, float softcap, float* o) {
    constexpr int G = H / KV;
    using P = Pass<KV, HD, WARPS, J>;
    const int pos = *pos_p;                      // see attention_chunk
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    int base = lo / P::CHUNK * P::CHUNK;
    P pass;
    pass.before_wait(kc, vc, base, lo, min(base + P::CHUNK, pos + 1), pos);
    grid_wait_then_release();
    pass.after_wait(kc, vc, base, lo, min(base + P::CHUNK, pos + 1), pos);
    float qv[G][8];
    load_queries<G, HD>(q, scale, qv);
    Softmax st[G], part[G];
    pass_softmax<G>(pass, qv, softcap, st);
    for (base += P::CHUNK; base <= pos; base += P::CHUNK) {
        pass.load(kc, vc, base, base, min(base + P::CHUNK, pos + 1), -1);
        pass_softmax<G>(pass, qv, softcap, part);
#pragma unroll
        for (int g = 0; g < G; g++) st[g].merge(part[g]);
    }
    block_softmax<G, HD, WARPS>(st, [&](int g, int d, float, float l, float a) {
        o[(blockIdx.x * G + g) * HD + d] = a / l;
    });
}

// One warp's running softmax merge of chunk records: chunks c, c + stride, ... up to c1 of one
// query head, GROUP at a time with all their loads issued together (4 dims per lane). Records are
// read through L2 (__ldcg): other blocks wrote them, maybe in this very launch (attention_merge).
template <int HD, int GROUP>
struct RecordMerge {
    using R = Record<HD>;
    static constexpr int DSTEPS = (HD + 127) / 128;           // float4s per lane
    float m = NEG_INF, l = 0.0f, acc[DSTEPS][4] = {};

    __device__ __forceinline__ void run(const float* part, int c, int c1, int stride) {
        const int lane = threadIdx.x & 31;
        for (; c <= c1; c += stride * GROUP) {
            float mc[GROUP], lc[GROUP], v[GROUP][DSTEPS][4];
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                const int cc = c + g * stride;
                const float* rec = part + (size_t)cc * R::FLOATS;
                mc[g] = cc <= c1 ? __ldcg(rec + R::MAX_AT) : NEG_INF;
                lc[g] = cc <= c1 ? __ldcg(rec + R::SUM_AT) : 0.0f;
#pragma unroll
                for (int t = 0; t < DSTEPS; t++) {
                    const int d = t * 128 + lane * 4;
                    if constexpr (HD % 4 == 0) {
                        const float4 x = cc <= c1 && d < HD ? __ldcg(reinterpret_cast<const float4*>(rec + d))
                                                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        v[g][t][0] = x.x; v[g][t][1] = x.y; v[g][t][2] = x.z; v[g][t][3] = x.w;
                    } else {
#pragma unroll
                        for (int i = 0; i < 4; i++) v[g][t][i] = cc <= c1 && d + i < HD ? __ldcg(rec + d + i) : 0.0f;
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
    }
    // This lane's dims of the merged value, acc / l, into o[0 : HD].
    __device__ __forceinline__ void write(float* o) const {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int t = 0; t < DSTEPS; t++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (t * 128 + lane * 4 + i < HD) o[t * 128 + lane * 4 + i] = acc[t][i] / l;
    }
};

// Merge chunks c0 .. c1 of the NH query heads h0 .. h0 + NH - 1 into o. With fewer heads than
// warps, S = WARPS / NH warps share a head, each taking every S-th chunk, and their states meet
// in shared memory; otherwise each warp merges whole heads and writes them itself.
template <int HD, int NH, int WARPS, int NCHUNK, int GROUP>   // blockDim.x == 32 * WARPS
__device__ __forceinline__ void merge_chunks(const float* ws, int h0, int c0, int c1, float* o) {
    using R = Record<HD>;
    constexpr int S = WARPS / NH > 0 ? WARPS / NH : 1;
    __shared__ float wm[WARPS], wl[WARPS], wacc[S > 1 ? WARPS : 1][R::MAX_AT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int task = warp; task < NH * S; task += WARPS) {
        const int g = task % NH, slice = task / NH;
        RecordMerge<HD, GROUP> st;
        st.run(ws + (size_t)(h0 + g) * NCHUNK * R::FLOATS, c0 + slice, c1, S);
        if constexpr (S == 1) {
            st.write(o + (h0 + g) * HD);
        } else {
            if (lane == 0) { wm[task] = st.m; wl[task] = st.l; }
#pragma unroll
            for (int t = 0; t < st.DSTEPS; t++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    if (t * 128 + lane * 4 + i < R::MAX_AT) wacc[task][t * 128 + lane * 4 + i] = st.acc[t][i];
        }
    }
    if constexpr (S > 1) {
        __syncthreads();
        for (int i = threadIdx.x; i < NH * HD; i += blockDim.x) {
            const int g = i / HD, d = i % HD;                 // head g's states: tasks g, g + NH, ...
            float mx = NEG_INF;
#pragma unroll
            for (int s = 0; s < S; s++) mx = fmaxf(mx, wm[g + s * NH]);
            float den = 0.0f, num = 0.0f;
#pragma unroll
            for (int s = 0; s < S; s++) {
                const float f = wm[g + s * NH] == NEG_INF ? 0.0f : __expf(wm[g + s * NH] - mx);
                den = fmaf(f, wl[g + s * NH], den);
                num = fmaf(f, wacc[g + s * NH][d], num);
            }
            o[(h0 + g) * HD + d] = num / den;
        }
    }
}

// The combine launch: block blockIdx.x merges the chunks of its query head that the split launch
// filled (dozens at long contexts, spread over the block's warps).
template <int HD, int CHUNK, int NCHUNK, int WARPS>
__device__ __forceinline__ void attention_combine(const float* ws, float* o, int pos, int window) {
    const int c0 = (window > 0 ? max(0, pos - window + 1) : 0) / CHUNK, c1 = pos / CHUNK;
    merge_chunks<HD, 1, WARPS, NCHUNK, 8>(ws, blockIdx.x, c0, c1, o);
}

// Medium contexts: the split launch merges too. Every block runs attention_chunk, then counts
// itself done for its KV head (done[blockIdx.x]); the last of that head's chunks to finish merges
// them for the head's G query heads, one kernel boundary less than a combine launch. The records
// are still in L2. The count goes back to 0 for the next launch.
template <int H, int KV, int HD, int WARPS, int J, int NCHUNK, int GROUP>
__device__ __forceinline__ void attention_merge(const float* q, const bf16_t* kc, const bf16_t* vc, const int* pos_p,
                                                int window, float scale, float softcap, float* ws, int* done,
                                                float* o) {
    constexpr int G = H / KV, CHUNK = Pass<KV, HD, WARPS, J>::CHUNK;
    if (!attention_chunk<H, KV, HD, WARPS, J, NCHUNK>(q, kc, vc, pos_p, window, scale, softcap, ws))
        return;                                 // a chunk without positions: not counted
    const int pos = *pos_p;
    const int c0 = (window > 0 ? max(0, pos - window + 1) : 0) / CHUNK, c1 = pos / CHUNK;
    __shared__ bool last;
    __threadfence();                            // this block's records, before it counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&done[blockIdx.x], 1) == c1 - c0;
        if (last) done[blockIdx.x] = 0;
        __threadfence();                        // the other blocks' records, after their counts
    }
    __syncthreads();
    if (last) merge_chunks<HD, G, WARPS, NCHUNK, GROUP>(ws, blockIdx.x * G, c0, c1, o);
}

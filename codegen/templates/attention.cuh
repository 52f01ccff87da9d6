// Decode attention over the KV cache (bf16 or fp8 rows, kv_cache.cuh), three kernels built from a pass type (LanePass on CUDA
// cores in attention_pass.cuh, MmaPass on tensor cores in attention_mma.cuh):
// - attention_chunk, the flash-decoding split: each block scores one chunk of positions for the
//   query heads of one KV head and leaves (max, sum, weighted values) in a workspace;
// - attention_combine merges the chunks of every query head;
// - attention_single, for short contexts: one block per KV head walks every position and writes
//   the output itself, one launch instead of two.
// Decode attention is short: at a few hundred positions its time is latency, not bytes. So each
// lane issues every load it will need at once (its slices of the pass's cache rows, K and V),
// before the wait for the previous kernel where it can.
#pragma once
#include "attention_mma.cuh"
#include "attention_sinks.cuh"

// Workspace record per (query head, chunk), 16-byte aligned: [0 : HD] = sum of exp * v, then at
// MAX_AT the max score and at SUM_AT the sum of exp.
template <int HD>
struct Record {
    static constexpr int MAX_AT = (HD + 3) / 4 * 4, SUM_AT = MAX_AT + 1, FLOATS = MAX_AT + 4;
};

// Where a pass finds the cache rows of positions base .. base + CHUNK - 1: in one cache of rows
// by position ...
struct ContiguousRows {
    template <class P>
    __device__ __forceinline__ const typename P::Elem* moved(const typename P::Elem* cache, int) const { return cache; }
};

// ... or on pages of PAGE rows (a multiple of the pass's chunk) through a sequence's page table:
// the pointer that puts those positions on their page's rows (pass P's cache rows: bf16 or fp8).
template <int PAGE>
struct PagedRows {
    const int* table;
    template <class P>
    __device__ __forceinline__ const typename P::Elem* moved(const typename P::Elem* cache, int base) const {
        constexpr int STEP = P::Cache::template STEP<P::W>;
        return cache + ((long long)table[base / PAGE] * PAGE + base % PAGE - base) * STEP;
    }
};

// Flash-decoding split: block (KV head, chunk blockIdx.y) leaves its chunk's softmax state of each
// query head in the workspace for attention_combine. `rows`: where the chunk's cache rows are.
template <int H, int KV, int HD, class P, int NCHUNK, class Rows = ContiguousRows>
__device__ __forceinline__ void attention_chunk(const float* q, const typename P::Elem* kc, const typename P::Elem* vc, const int* pos_p,
                                                int window, float scale, float softcap, float* ws, Rows rows = {}) {
    constexpr int G = H / KV;
    const int c = blockIdx.y;
    // A graph input, read before the wait: the previous step's sampler wrote it, and has finished,
    // since a kernel that releases its successor only after waiting (the Q, K, V GEMV) lies between.
    const int pos = *pos_p;
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int start = max(c * P::CHUNK, lo), end = min(c * P::CHUNK + P::CHUNK, pos + 1);
    if (start >= end) return;                   // the combine reads only chunks with positions
    kc = rows.template moved<P>(kc, c * P::CHUNK);
    vc = rows.template moved<P>(vc, c * P::CHUNK);
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
}

// The passes after the first (at `base`) up to position `last`, merged into st.
template <class P>
__device__ __forceinline__ void walk_on(P& pass, typename P::State& st, const typename P::Elem* kc, const typename P::Elem* vc, int base,
                                        int last, float softcap) {
    typename P::State part;
    for (base += P::CHUNK; base <= last; base += P::CHUNK) {
        pass.load(kc, vc, base, base, min(base + P::CHUNK, last + 1), -1);
        pass.softmax(softcap, part);
        st.merge(part);
    }
}

// Short contexts: one block per KV head walks every position in passes and writes the attention
// output itself; no workspace, no combine launch. The first pass's loads go out before the wait.
template <int H, int KV, int HD, class P, class Sinks = NoSinks>
__device__ __forceinline__ void attention_single(const float* q, const typename P::Elem* kc, const typename P::Elem* vc, const int* pos_p,
                                                 int window, float scale, float softcap, float* o, Sinks sinks = {}) {
    constexpr int G = H / KV;
    const int pos = *pos_p;                      // see attention_chunk
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    int base = lo / P::CHUNK * P::CHUNK;
    P pass;
    pass.before_wait(kc, vc, base, lo, min(base + P::CHUNK, pos + 1), pos);
    grid_wait_then_release();
    pass.after_wait(kc, vc, base, lo, min(base + P::CHUNK, pos + 1), pos);
    pass.load_queries(q, scale);
    typename P::State st;
    pass.softmax(softcap, st);
    walk_on(pass, st, kc, vc, base, pos, softcap);
    P::block_merge(st, [&](int g, int d, float m, float l, float a) {
        o[(blockIdx.x * G + g) * HD + d] = a / (l + sinks(blockIdx.x * G + g, m));
    });
}

// Batched prefill on tensor cores: block (KV head, y) takes TOKENS consecutive tokens of the step,
// from its token TOKENS y (q, pos_p and o point at the step's first), every (token, head) pair an
// A row of the pass (MmaPass with TOKENS), and walks the cache rows up to the last one's position
// once for all of them. The step's own rows were written by the kernel before: it waits first.
template <int H, int KV, int HD, class P, int TOKENS, class Sinks = NoSinks>
__device__ __forceinline__ void attention_prefill_rows(const float* q, const typename P::Elem* kc, const typename P::Elem* vc,
                                                       const int* pos_p, int window, float scale, float softcap,
                                                       float* o, Sinks sinks = {}) {
    constexpr int G = H / KV;
    grid_wait_then_release();
    const int t0 = blockIdx.y * TOKENS, first = pos_p[t0], last = pos_p[t0 + TOKENS - 1];
    const int lo = window > 0 ? max(0, first - window + 1) : 0;
    P pass;
    pass.set_rows(first, window);
    int base = lo / P::CHUNK * P::CHUNK;
    pass.load(kc, vc, base, lo, min(base + P::CHUNK, last + 1), -1);
    pass.load_queries(q + (size_t)t0 * H * HD, scale);
    typename P::State st;
    pass.softmax(softcap, st);
    walk_on(pass, st, kc, vc, base, last, softcap);
    P::block_merge(st, [&](int row, int d, float m, float l, float a) {
        const int head = blockIdx.x * G + row % G;
        o[(size_t)(t0 + row / G) * H * HD + head * HD + d] = a / (l + sinks(head, m));
    });
}

// Continuous batching: token blockIdx.y of the step belongs to any of several sequences, whose
// rows lie in pages of PAGE rows listed by its page table (TABLE entries a token, pages_p points
// at the step's first). It walks its own positions as attention_single does; a pass's chunk lies
// inside one page (PAGE is a multiple of CHUNK), so each chunk reads through cache pointers moved
// by the page's offset: position p then lands on its pool row. The step's own rows were written
// by the kernel before: it waits first.
template <int H, int KV, int HD, class P, int PAGE, int TABLE, class Sinks = NoSinks>
__device__ __forceinline__ void attention_paged(const float* q, const typename P::Elem* kc, const typename P::Elem* vc, const int* pos_p,
                                                const int* pages_p, int window, float scale, float softcap, float* o,
                                                Sinks sinks = {}) {
    static_assert(PAGE % P::CHUNK == 0, "a pass's chunk must lie inside one page");
    constexpr int G = H / KV;
    grid_wait_then_release();
    const int t = blockIdx.y, pos = pos_p[t];
    const PagedRows<PAGE> rows{pages_p + (size_t)t * TABLE};
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const auto moved = [&](const typename P::Elem* cache, int base) { return rows.template moved<P>(cache, base); };
    int base = lo / P::CHUNK * P::CHUNK;
    P pass;
    pass.load(moved(kc, base), moved(vc, base), base, lo, min(base + P::CHUNK, pos + 1), -1);
    pass.load_queries(q + (size_t)t * H * HD, scale);
    typename P::State st, part;
    pass.softmax(softcap, st);
    for (base += P::CHUNK; base <= pos; base += P::CHUNK) {
        pass.load(moved(kc, base), moved(vc, base), base, base, min(base + P::CHUNK, pos + 1), -1);
        pass.softmax(softcap, part);
        st.merge(part);
    }
    P::block_merge(st, [&](int g, int d, float m, float l, float a) {
        o[(size_t)t * H * HD + (blockIdx.x * G + g) * HD + d] = a / (l + sinks(blockIdx.x * G + g, m));
    });
}

// Merge the chunks c0 .. c1 of query head blockIdx.x (the ones the split kernel filled). At long
// contexts there are dozens of chunks, so each warp takes every WARPS-th chunk, GROUP at a time
// with all their loads issued together (4 dims per lane), keeps a running softmax state, and
// the warps' states meet once in shared memory.
template <int HD, int CHUNK, int NCHUNK, int WARPS, int GROUP, class Sinks = NoSinks>   // blockDim.x == 32 * WARPS
__device__ __forceinline__ void attention_combine(const float* ws, float* o, int pos, int window, Sinks sinks = {}) {
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
    den += sinks(h, mx);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float num = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) num = fmaf(wm[w] == NEG_INF ? 0.0f : __expf(wm[w] - mx), wacc[w][d], num);
        o[h * HD + d] = num / den;
    }
}

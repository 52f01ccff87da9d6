// MmaPass: one pass of a block over cache rows on tensor cores (mma.sync m16n8k16, sm_80 on), for
// head sizes 64 and 128 and up to 8 query heads per KV head. Same interface as LanePass.
//
// Why: a pass on CUDA cores is a long chain of dependent shuffles, exponentials and FMAs per lane
// (each row's score summed over 8 lanes, each head's values summed over the row groups), and at
// 2-3 warps per scheduler that chain, not the cache bytes, sets the kernel's time. On tensor cores
// a warp's positions (32 for head size 64, 16 for 128) take 64 mma instructions and a few shuffles.
//
// Per warp and pass: S = Q K^T over NP positions, then O = P V. The query heads are the rows of the
// 16-row A operand (rows G .. 15 are zero). The dot products over the head dim may take the dims
// in any order, as long as A and B agree, and likewise the positions of P V; so each lane's loads
// are contiguous 16-byte pieces that land in the fragment layouts without any shuffling:
// - lane (r = lane / 4, c = lane % 4) holds K dims [c HD/4, (c+1) HD/4) of position 8t + r for each
//   score tile t: k-step s takes dims c HD/4 + 4s + {0, 1} (B word 0) and + {2, 3} (word 1), and
//   the queries' A fragment takes the same dims of head r;
// - the scores come out as head r, positions 8t + 2c + {0, 1}: for the value step u (16
//   positions, tiles 2u and 2u + 1) they are already P's A fragment;
// - the same lane holds V dims [r HD/8, (r+1) HD/8) of positions 16u + {2c, 2c+1, 2c+8, 2c+9}, so
//   output tile w (dims n HD/8 + w, n = 0..7) takes its B words from those four rows' element w
//   (one byte permute per word), and lane (r, c) ends with head r, dims [c HD/4, (c+1) HD/4).
// Queries and probabilities are float32, the operands bf16: each is split into hi + lo (two mma,
// |error| <= 2^-17 of the value), so the scores keep about float32 accuracy.
#pragma once
#include "attention_pass.cuh"
#include "mma.cuh"

// LATE_V (the split kernels): only the K rows go out before the wait; after it the queries, then
// the V rows. The queries, small and in L2, would otherwise queue behind the block's 64 kB of
// rows, and the scores could start only once every row was in; this way the scores and the
// softmax run while V streams in (docs/perf-notes.md: LATE_V).
// TOKENS > 1 (batched prefill): the A operand's rows 0-7 (the only ones this pass fills: rows 8-15
// of every mma are zero words) are the G query heads of TOKENS consecutive tokens (row r: token
// r / G, head r % G), so each cache row a block loads serves TOKENS tokens;
// row r's scores are masked past its own token's position (and before its window), set_rows.
// C: the cache layout (kv_cache.cuh). fp8 rows: a lane holds the codes of the same dims (half the
// bytes), turned into bf16 words as the mma takes them (e4m3x2_as_bf16x2: exact, times 2^-120);
// the rows' scales multiply the scores and, folded into P, the values. The 2^120 comes back as
// E4M3_SHIFT twice: on the queries and the scales (the scores' sums stay far above float32's
// subnormals), and on the scales and the outputs (P' = P x scale stays within bf16's range).
template <int KV, int HD, int WARPS, int G, bool LATE_V = false, int TOKENS = 1, class C = KvBf16>
struct MmaPass {
    static_assert(HD == 64 || HD == 128, "MmaPass: head size 64 or 128");
    static_assert(G <= 8, "MmaPass: at most 8 query heads per KV head");
    static constexpr int ROWS = G * TOKENS;      // A rows in use: (token, head) pairs
    static_assert(ROWS <= 8, "MmaPass: at most 8 query rows (heads x tokens) per block");
    // mma.sync on bf16 needs sm_80: said at compile time (codegen picks LanePass below it) instead
    // of failing at the first step.
    static_assert(KV > 0 && FUSELM_SM80, "MmaPass needs sm_80 or later (codegen/attention.py: mma_fits)");
    static constexpr int NP = 2048 / HD;         // positions per warp and pass: 16 loads of 16 bytes per lane
    static constexpr int CHUNK = WARPS * NP, W = KV * HD;
    static constexpr int NT = NP / 8, NU = NP / 16, KSTEPS = HD / 16, VDIMS = HD / 8;
    // Head lane / 4; acc[2 w + e]: dim (2 (lane % 4) + e) HD/8 + w (output tile w, column e).
    using State = Softmax<2 * VDIMS>;
    using Cache = C;                             // the KV rows' policy (kv_cache.cuh)
    using Elem = typename C::Elem;
    static constexpr int KW = C::FP8 ? HD / 64 : HD / 32, VW = C::FP8 ? 1 : HD / 64;   // 16-byte pieces
    uint4 k[NT][KW];                             // K slice of position 8t + r: HD/4 dims
    uint4 v[NU][4][VW];                          // V slices of positions 16u + {2c, 2c+1, 2c+8, 2c+9}: HD/8 dims
    float ksc[NT][2], vsc[NT][2];                // fp8: scales of the score positions 8t + 2c + {0, 1}
    unsigned qa[KSTEPS][2][2];                   // queries' A words [k-step][hi, lo][dims +0,1 | +2,3]
    int first, start, end;                       // the warp's first position; the valid range
    int row_pos = 0, window = 0;                 // TOKENS > 1: row r's own position and window (set_rows)
    const Elem* values;                          // LATE_V: the V cache, from after_wait to load_queries

    __device__ __forceinline__ static int r() { return (threadIdx.x & 31) >> 2; }
    __device__ __forceinline__ static int c() { return threadIdx.x & 3; }
    __device__ __forceinline__ static const Elem* at(const Elem* cache, int p) {
        return C::template row<W>(cache, p) + blockIdx.x * HD;
    }
    __device__ __forceinline__ int score_pos(int t, int e) const { return first + 8 * t + 2 * c() + e; }
    // fp8: the scales of the score positions of `cache` into sc, but position `skip` (zero where
    // not loaded); `only`: position `skip` alone.
    __device__ __forceinline__ void load_scales(float (&sc)[NT][2], const Elem* cache, int skip, bool only) {
        if constexpr (C::FP8) {
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int p = score_pos(t, e);
                    if (only ? p == skip : true)
                        sc[t][e] = (only || (p >= start && p < end && p != skip))
                                       ? C::template scale<W>(cache, p, blockIdx.x) * E4M3_SHIFT : 0.0f;
                }
        }
    }
    __device__ __forceinline__ int k_row(int t) const { return first + 8 * t + r(); }
    // TOKENS > 1: the block's first token is at position pos0; a row sees positions up to its
    // token's and, with a window, above its token's position - window.
    __device__ __forceinline__ void set_rows(int pos0, int window_) {
        row_pos = pos0 + r() / G;
        window = window_;
    }
    // Row r's query: head r % G of token r / G (q: the block's first token's row of H = KV G heads).
    __device__ __forceinline__ static const float* query_row(const float* q) {
        return q + (r() / G) * (KV * G * HD) + (blockIdx.x * G + r() % G) * HD;
    }
    __device__ __forceinline__ int v_row(int u, int i) const { return first + 16 * u + 2 * c() + (i & 1) + 8 * (i >> 1); }

    // N 16-byte pieces of a row slice (fp8 V slices of head size 64: 8 bytes, in .x and .y).
    template <int N>
    __device__ __forceinline__ static void load_slice(uint4 (&dst)[N], const Elem* src, bool now) {
#pragma unroll
        for (int i = 0; i < N; i++) dst[i] = now ? *reinterpret_cast<const uint4*>(src + 16 / sizeof(Elem) * i) : make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ static void load_v_slice(uint4 (&dst)[VW], const Elem* src, bool now) {
        if constexpr (C::FP8 && HD / 8 == 8) {
            const uint2 x = now ? *reinterpret_cast<const uint2*>(src) : make_uint2(0u, 0u);
            dst[0] = make_uint4(x.x, x.y, 0u, 0u);
        } else {
            load_slice(dst, src, now);
        }
    }
    // Issue every load of this lane's rows, but row `skip` (the previous kernel may still write it).
    __device__ __forceinline__ void load(const Elem* kc, const Elem* vc, int base, int start_, int end_, int skip) {
        load_keys(kc, base, start_, end_, skip);
        load_values(vc, skip);
    }
    __device__ __forceinline__ void load_keys(const Elem* kc, int base, int start_, int end_, int skip) {
        first = base + (threadIdx.x >> 5) * NP, start = start_, end = end_;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int p = k_row(t);
            load_slice(k[t], at(kc, p) + c() * (HD / 4), p >= start && p < end && p != skip);
        }
        load_scales(ksc, kc, skip, false);
    }
    __device__ __forceinline__ void load_values(const Elem* vc, int skip) {
#pragma unroll
        for (int u = 0; u < NU; u++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int p = v_row(u, i);
                load_v_slice(v[u][i], at(vc, p) + r() * VDIMS, p >= start && p < end && p != skip);
            }
        load_scales(vsc, vc, skip, false);
    }
    // Row p, skipped by load(); its V slices only `with_values`.
    __device__ __forceinline__ void load_row(const Elem* kc, const Elem* vc, int p, bool with_values = true) {
        const bool in = p >= start && p < end;
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (k_row(t) == p) load_slice(k[t], at(kc, p) + c() * (HD / 4), true);
        if (in) load_scales(ksc, kc, p, true);
#pragma unroll
        for (int u = 0; u < NU; u++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (with_values && v_row(u, i) == p) load_v_slice(v[u][i], at(vc, p) + r() * VDIMS, true);
        if (with_values && in) load_scales(vsc, vc, p, true);
    }
    // Slices are 16-byte pieces of 128- or 256-byte rows, so loads of rows before pos may go out
    // before the wait (see LanePass::before_wait).
    __device__ __forceinline__ void before_wait(const Elem* kc, const Elem* vc, int base, int start_, int end_,
                                                int pos) {
        load_keys(kc, base, start_, end_, pos);
        if constexpr (!LATE_V) load_values(vc, pos);
    }
    __device__ __forceinline__ void after_wait(const Elem* kc, const Elem* vc, int, int, int, int pos) {
        load_row(kc, vc, pos, !LATE_V);
        if constexpr (LATE_V) values = vc;
    }
    // Query head r (zero past G), times `scale`, as A words: dims c HD/4 + 4s + {0,1} and {2,3}.
    __device__ __forceinline__ static float4 query(const float* q, int s) {
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r() < ROWS) x = *reinterpret_cast<const float4*>(query_row(q) + c() * (HD / 4) + 4 * s);
        return x;
    }
    __device__ __forceinline__ void set_query(int s, const float4& x, float scale) {
        split_bf16x2(x.x * scale, x.y * scale, qa[s][0][0], qa[s][1][0]);
        split_bf16x2(x.z * scale, x.w * scale, qa[s][0][1], qa[s][1][1]);
    }
    __device__ __forceinline__ void load_queries(const float* q, float scale) {
        if constexpr (C::FP8) scale *= E4M3_SHIFT;
        if constexpr (!LATE_V) {
#pragma unroll
            for (int s = 0; s < KSTEPS; s++) {   // query() and set_query() inline: so written, ptxas
                // schedules the one-launch kernel as measured (through the helpers it does not)
                float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (r() < ROWS) x = *reinterpret_cast<const float4*>(query_row(q) + c() * (HD / 4) + 4 * s);
                split_bf16x2(x.x * scale, x.y * scale, qa[s][0][0], qa[s][1][0]);
                split_bf16x2(x.z * scale, x.w * scale, qa[s][0][1], qa[s][1][1]);
            }
        } else {
            // Every V row (row pos too) goes out behind the queries and ahead of the scores. Left to
            // itself ptxas sinks these loads below the first mma, which waits for the K rows to
            // land. Loads stay on their side of a barrier, so the queries pass through a zero read
            // after one (volatile: the compiler may not fold it), and every mma comes after it.
            float4 x[KSTEPS];
#pragma unroll
            for (int s = 0; s < KSTEPS; s++) x[s] = query(q, s);
            __shared__ unsigned zero;
            if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned*>(&zero) = 0u;
            load_values(values, -1);
            __syncthreads();
            const unsigned z = *reinterpret_cast<volatile unsigned*>(&zero);
            const auto pin = [z](float f) { return __uint_as_float(__float_as_uint(f) ^ z); };
#pragma unroll
            for (int s = 0; s < KSTEPS; s++) set_query(s, make_float4(pin(x[s].x), pin(x[s].y), pin(x[s].z), pin(x[s].w)), scale);
        }
    }
    // Head r's softmax state over this pass's positions (lanes of equal r agree on m and l).
    __device__ __forceinline__ void softmax(float softcap, State& out) const {
        float s[NT][2];                          // head r, positions 8t + 2c + {0, 1}
        out = State{};
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
                unsigned b0, b1;
                if constexpr (C::FP8) {          // dims 4 ks .. 4 ks + 3: one word of codes
                    const unsigned w = word_of(k[t][ks / 4], ks % 4);
                    b0 = e4m3x2_as_bf16x2(w);
                    b1 = e4m3x2_as_bf16x2(w >> 16);
                } else {
                    b0 = word_of(k[t][ks / 2], ks % 2 * 2);
                    b1 = word_of(k[t][ks / 2], ks % 2 * 2 + 1);
                }
                mma_16816(d, qa[ks][0][0], 0u, qa[ks][0][1], 0u, b0, b1);
                mma_16816(d, qa[ks][1][0], 0u, qa[ks][1][1], 0u, b0, b1);
            }
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int p = first + 8 * t + 2 * c() + e;
                const bool own = TOKENS == 1 || (p <= row_pos && (window == 0 || p > row_pos - window));
                const float de = C::FP8 ? d[e] * ksc[t][e] : d[e];
                s[t][e] = p < start || p >= end || !own ? NEG_INF : softcap > 0.0f ? softcap * tanhf(de / softcap) : de;
                out.m = fmaxf(out.m, s[t][e]);
            }
        }
        out.m = fmaxf(out.m, __shfl_xor_sync(0xffffffffu, out.m, 1));
        out.m = fmaxf(out.m, __shfl_xor_sync(0xffffffffu, out.m, 2));
        // No early exit where no position is valid (mma.sync needs every lane): then all p are 0.
        const float mref = out.m == NEG_INF ? 0.0f : out.m;
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                s[t][e] = __expf(s[t][e] - mref);   // exp(-inf) = 0 for masked positions
                out.l += s[t][e];
            }
        out.l += __shfl_xor_sync(0xffffffffu, out.l, 1);
        out.l += __shfl_xor_sync(0xffffffffu, out.l, 2);
        float o[VDIMS][4] = {};
#pragma unroll
        for (int u = 0; u < NU; u++) {
            unsigned ph0, pl0, ph1, pl1;         // P's A words: positions 16u + 2c + {0,1} and + 8
            if constexpr (C::FP8) {              // the rows' value scales, folded into P
                split_bf16x2(s[2 * u][0] * vsc[2 * u][0], s[2 * u][1] * vsc[2 * u][1], ph0, pl0);
                split_bf16x2(s[2 * u + 1][0] * vsc[2 * u + 1][0], s[2 * u + 1][1] * vsc[2 * u + 1][1], ph1, pl1);
            } else {
                split_bf16x2(s[2 * u][0], s[2 * u][1], ph0, pl0);
                split_bf16x2(s[2 * u + 1][0], s[2 * u + 1][1], ph1, pl1);
            }
#pragma unroll
            for (int w = 0; w < VDIMS; w++) {
                unsigned b0, b1;
                if constexpr (C::FP8) {          // byte w of two rows' codes, then to bf16
                    const unsigned sel = (w % 4) | (4 + w % 4) << 4;
                    b0 = e4m3x2_as_bf16x2(__byte_perm(word_of(v[u][0][0], w / 4), word_of(v[u][1][0], w / 4), sel));
                    b1 = e4m3x2_as_bf16x2(__byte_perm(word_of(v[u][2][0], w / 4), word_of(v[u][3][0], w / 4), sel));
                } else {
                    const unsigned sel = w % 2 ? 0x7632u : 0x5410u;      // high or low halves of two words
                    const int q4 = w / 8, word = w % 8 / 2;
                    b0 = __byte_perm(word_of(v[u][0][q4], word), word_of(v[u][1][q4], word), sel);
                    b1 = __byte_perm(word_of(v[u][2][q4], word), word_of(v[u][3][q4], word), sel);
                }
                mma_16816(o[w], ph0, 0u, ph1, 0u, b0, b1);
                mma_16816(o[w], pl0, 0u, pl1, 0u, b0, b1);
            }
        }
#pragma unroll
        for (int w = 0; w < VDIMS; w++) {
            out.acc[2 * w] = C::FP8 ? o[w][0] * E4M3_SHIFT : o[w][0];
            out.acc[2 * w + 1] = C::FP8 ? o[w][1] * E4M3_SHIFT : o[w][1];
        }
    }
    // Lanes of rows r < ROWS hold row r's dims [c HD/4, (c+1) HD/4); emit(row, ...).
    template <class Emit>
    __device__ __forceinline__ static void block_merge(const State& st, Emit emit) {
        __shared__ WarpStates<ROWS, HD, WARPS, HD + 4> ws;  // + 4: the rows start in different banks
        const int warp = threadIdx.x >> 5;
        if (r() < ROWS) {
#pragma unroll
            for (int w = 0; w < VDIMS; w++)
#pragma unroll
                for (int e = 0; e < 2; e++) ws.acc[warp][r()][(2 * c() + e) * VDIMS + w] = st.acc[2 * w + e];
            if (c() == 0) { ws.m[warp][r()] = st.m; ws.l[warp][r()] = st.l; }
        }
        __syncthreads();
        ws.merge(emit);
    }
};

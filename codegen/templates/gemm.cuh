// GEMM building blocks: a gemv kernel's weights streamed once for a step of TT tokens (a prompt's
// batched prefill), the dot products on tensor cores.
//
// A warp computes 16 weight rows (tile slots 16 w .. 16 w + 15) x TT tokens of each member:
// D[row][token] = W[row, :] . x[token, :], as mma.sync m16n8k16 with the weights as A (16 rows x
// 16 k) and the tokens' vectors as B (16 k x 8 tokens). A dot product may take k in any order as
// long as A and B agree, so a lane's 16-byte load of 8 consecutive weights is its A words as they
// are: lane (r = lane / 4, c = lane % 4) loads k [8c, 8c + 8) of each 32-k span of rows r and
// r + 8; words 0, 1 of each load feed the span's first mma, words 2, 3 its second. The tokens'
// vectors (float32, the norm's gain applied when there is a prologue) are staged per chunk of KC
// k in shared memory as bf16 hi + lo words in the same order, and every product takes two mma
// (hi, lo), which keeps float32 accuracy (split_bf16x2, as in attention_mma.cuh).
// Quantized weights (QuantTile) reach the mma as their integer codes, exact in bf16, a lane's
// 8 from each half of a group of 32 (quant.cuh: frag, decode); the vectors are then staged in
// that order (GROUPED) with each group's sum, and every group's float sums are scaled (and its
// minimum added) before they join the accumulators.
#pragma once
#include "cp_async.cuh"
#include "gemv.cuh"            // slot_row, load_f32x8, apply_gain8
#include "mma.cuh"
#include "quant.cuh"           // GroupScale and the formats' frag, decode

#if FUSELM_WEIGHT_F16
#error "gemm.cuh: the mma takes the weights as bf16; f16 weights have no gemm form"
#endif

// x[token][kc .. kc + KC) as hi and lo bf16 words: entry e holds k [8e, 8e + 8), or GROUPED
// (quantized tiles), entry 4s + c holds k 32s + [4c, 4c + 4) and 32s + 16 + [4c, 4c + 4), and
// sum[token][s] is the sum of x over k [32s, 32s + 32). A row of STRIDE entries, STRIDE = 4
// (mod 8): the 8 lanes of a quarter warp (two tokens, four entries) read 16 bytes each from
// distinct banks.
template <int TT, int KC, bool GROUPED = false>
struct StagedChunk {
    static constexpr int ENTRIES = KC / 8, SPANS = KC / 32, STRIDE = ENTRIES + (12 - ENTRIES % 8) % 8;
    uint4 hi[TT][STRIDE], lo[TT][STRIDE];
    float sum[GROUPED ? TT : 1][GROUPED ? SPANS : 1];
};

// Entry e (k 8e .. 8e + 8, rows' order) of a token's chunk row, stored where the tiles read it:
// as it is, or GROUPED, its values 0-3 and 4-7 as one half of entries 2 (e % 2) and 2 (e % 2) + 1
// of its group (the first halves for e % 4 < 2, the second ones after).
template <bool GROUPED>
__device__ __forceinline__ void store_entry(uint4* row, int e, const uint4& v) {
    if constexpr (!GROUPED) {
        row[e] = v;
    } else {
        uint2* first = reinterpret_cast<uint2*>(row + e / 4 * 4 + 2 * (e % 2)) + (e % 4) / 2;
        first[0] = make_uint2(v.x, v.y);
        first[2] = make_uint2(v.z, v.w);   // the next entry's same half
    }
}

// Entries k .. k + 8 of one token's vector (load_f32x8: plain loads, x is the previous kernel's
// output), times the norm gain where NORMED (their squares added to sumsq), as hi and lo bf16 words.
template <bool NORMED>
__device__ __forceinline__ void split_entry(float (&v)[8], const weight_t* gain, float gain_offset, int k,
                                            float& sumsq, uint4& h, uint4& l) {
    if constexpr (NORMED) apply_gain8(v, gain, k, gain_offset, sumsq);
    split_bf16x2(v[0], v[1], h.x, l.x);
    split_bf16x2(v[2], v[3], h.y, l.y);
    split_bf16x2(v[4], v[5], h.z, l.z);
    split_bf16x2(v[6], v[7], h.w, l.w);
}

// The sum of a group of 32 values of x whose entry (8 values, `v` where `on`) the calling lane
// holds, the other three entries in the neighbouring lanes of its quad (every lane calls it).
__device__ __forceinline__ float group_sum(const float (&v)[8], bool on) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) sum += on ? v[k] : 0.0f;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    return sum + __shfl_xor_sync(0xffffffffu, sum, 2);
}

// gemm_tile's chunks of the tokens' vectors, converted by the block itself from rows of x [*, K]
// (the MoE kernels, whose vectors differ per expert): each of the tile's blocks converts them
// again. Vector t is row row_of[t] of x (row t where row_of is null) for t < count, zeros after.
// GROUPED: in the quantized tiles' order, with the group sums (StagedChunk).
template <int K, int TT, int KC, bool IS_NORMED, int THREADS, bool GROUPED = false>
struct VectorsFromX {
    static constexpr bool NORMED = IS_NORMED;
    static constexpr int ENTRIES = StagedChunk<TT, KC>::ENTRIES;
    static constexpr int GROUPS = (TT * ENTRIES + THREADS - 1) / THREADS;   // staged entries per thread
    static_assert(THREADS % ENTRIES == 0 && ENTRIES % 4 == 0, "a thread stages entries of one column e");
    const float* x;
    const weight_t* gain;
    float gain_offset;
    const int* row_of = nullptr;
    int count = TT;
    float sumsq[GROUPS] = {};

    __device__ __forceinline__ void stage(int kc, StagedChunk<TT, KC, GROUPED>& xs) {
#pragma unroll
        for (int i = 0; i < GROUPS; i++) {   // every lane runs every round: group_sum's shuffles
            const int g = threadIdx.x + i * THREADS, t = g / ENTRIES, e = g % ENTRIES;
            const bool on = g < TT * ENTRIES;
            float v[8] = {};
            if (on) {
                uint4 h, l;
                if (t < count) load_f32x8(x + (size_t)(row_of ? row_of[t] : t) * K, kc + 8 * e, v);
                split_entry<NORMED>(v, gain, gain_offset, kc + 8 * e, sumsq[i], h, l);
                store_entry<GROUPED>(xs.hi[t], e, h);
                store_entry<GROUPED>(xs.lo[t], e, l);
            }
            if constexpr (GROUPED) {
                const float sum = group_sum(v, on);
                if (on && e % 4 == 0) xs.sum[t][e / 4] = sum;
            }
        }
    }
    // ss[t] = sum of x[t]^2 over the k this block staged: the ENTRIES lanes that staged a token's row meet
    __device__ __forceinline__ void sums(float* ss) const {
#pragma unroll
        for (int i = 0; i < GROUPS; i++) {
            float v = sumsq[i];
#pragma unroll
            for (int o = ENTRIES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            const int g = threadIdx.x + i * THREADS;
            if (g % ENTRIES == 0 && g < TT * ENTRIES) ss[g / ENTRIES] = v;
        }
    }
};

// Where stage_vectors leaves a step's vectors: `words` holds [K / KC chunks][hi, lo][TT][ENTRIES]
// 16-byte entries (TT x K floats' worth), then TT floats, each token's sum of x^2 over all of K,
// then, GROUPED, [K / KC chunks][TT][SPANS] floats, the sums of x over each group of 32.
template <int K, int TT, int KC>
struct StagedLayout {
    static constexpr int ENTRIES = StagedChunk<TT, KC>::ENTRIES, SPANS = KC / 32, CHUNK = 2 * TT * ENTRIES;
    static __device__ __forceinline__ float* sums(float* words) { return words + (size_t)TT * K; }
    static __device__ __forceinline__ const float* sums(const float* words) { return words + (size_t)TT * K; }
    static __device__ __forceinline__ float* group_sums(float* words, int chunk) {
        return words + (size_t)TT * K + TT + (size_t)chunk * TT * SPANS;
    }
    static __device__ __forceinline__ const float* group_sums(const float* words, int chunk) {
        return words + (size_t)TT * K + TT + (size_t)chunk * TT * SPANS;
    }
};

// The same chunks made once per kernel by stage_vectors (its own launch before the gemm's), which
// every block copies as they are, all at once (cp.async: no registers, one round trip), instead
// of each of a kernel's hundreds of blocks loading and converting them again. A block takes TN of
// the step's TT tokens, t0 .. t0 + TN (column tiles: a tile of every token does not fit).
template <int K, int TT, int KC, bool IS_NORMED, int THREADS, bool GROUPED = false, int TN = TT>
struct StagedVectors {
    using Layout = StagedLayout<K, TT, KC>;
    static constexpr bool NORMED = IS_NORMED;
    static constexpr int ENTRIES = Layout::ENTRIES, CHUNK = Layout::CHUNK, SPANS = Layout::SPANS;
    static constexpr int COPIES = 2 * TN * ENTRIES;   // the block's hi and lo entries of a chunk
    const float* words;
    int t0 = 0;

    __device__ __forceinline__ void stage(int kc, StagedChunk<TN, KC, GROUPED>& xs) const {
        const uint4* chunk = reinterpret_cast<const uint4*>(words) + (size_t)(kc / KC) * CHUNK;
#pragma unroll 1   // unrolled, the copies' addresses take registers that the weights need
        for (int j = 0; j < (COPIES + THREADS - 1) / THREADS; j++) {
            const int i = j * THREADS + threadIdx.x, lo = i >= TN * ENTRIES, t = (i / ENTRIES) % TN, e = i % ENTRIES;
            uint4* to = lo ? &xs.lo[t][e] : &xs.hi[t][e];
            if (COPIES % THREADS == 0 || i < COPIES)     // .cg: the stage kernel's writes
                cp_async_16_cg(to, chunk + (lo * TT + t0 + t) * ENTRIES + e);
        }
        if constexpr (GROUPED) {   // the block's tokens' group sums: TN SPANS floats from token t0's
            static_assert(TN * SPANS % 4 == 0, "group sums copied 16 bytes at a time");
            const uint4* sums = reinterpret_cast<const uint4*>(Layout::group_sums(words, kc / KC) + t0 * SPANS);
            for (int i = threadIdx.x; i < TN * SPANS / 4; i += THREADS)
                cp_async_16_cg(reinterpret_cast<uint4*>(&xs.sum[0][0]) + i, sums + i);
        }
        cp_async_wait_all();
    }
    __device__ __forceinline__ void sums(float* ss) const {   // every token's, over all of K: split-K adds none
        for (int t = threadIdx.x; t < TT; t += THREADS) ss[t] = Layout::sums(words)[t];
    }
};

// A stage block's share of one token's vector x [K]: entries threadIdx.x + THREADS i (k 8 e ..
// 8 e + 8), all loaded before any is used (one round trip, not one each).
template <int K, int THREADS, int PER>
__device__ __forceinline__ void load_entries(const float* x, float (&v)[PER][8]) {
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (i * THREADS + threadIdx.x < K / 8) load_f32x8(x, 8 * (i * THREADS + threadIdx.x), v[i]);
}

// The stage kernel's block t: token t's vector as StagedVectors reads it, and its sum of squares
// (and GROUPED, each group's sum). A thread loads all its entries before converting any (one round
// trip, not one each); the 4 entries of a group are 4 neighbouring threads'.
template <int K, int TT, int KC, bool NORMED, int THREADS, bool GROUPED = false>
__device__ __forceinline__ void stage_vectors(const float* x, const weight_t* gain, float gain_offset, float* words) {
    using Layout = StagedLayout<K, TT, KC>;
    constexpr int ENTRIES = Layout::ENTRIES, PER = (K / 8 + THREADS - 1) / THREADS;
    static_assert(THREADS % 32 == 0 && ENTRIES % 4 == 0, "a group's entries in one warp");
    uint4* staged = reinterpret_cast<uint4*>(words);
    const int t = blockIdx.x;
    float v[PER][8];
    load_entries<K, THREADS>(x + (size_t)t * K, v);
    float sumsq = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {   // every lane runs every round: the group sums' shuffles
        const int g = i * THREADS + threadIdx.x;
        const bool on = g < K / 8;
        uint4 h = {}, l = {};
        if (on) split_entry<NORMED>(v[i], gain, gain_offset, 8 * g, sumsq, h, l);
        uint4* chunk = staged + (size_t)(g / ENTRIES) * Layout::CHUNK;
        if (on) {
            store_entry<GROUPED>(chunk + t * ENTRIES, g % ENTRIES, h);
            store_entry<GROUPED>(chunk + (TT + t) * ENTRIES, g % ENTRIES, l);
        }
        if constexpr (GROUPED) {
            const float sum = group_sum(v[i], on);
            if (on && g % 4 == 0)
                Layout::group_sums(words, g / ENTRIES)[t * Layout::SPANS + (g % ENTRIES) / 4] = sum;
        }
    }
    if constexpr (NORMED) {
        sumsq = block_sum(sumsq);
        if (threadIdx.x == 0) Layout::sums(words)[t] = sumsq;
    }
}

// The weight rows of a lane's two A-fragment rows: slots 16 w + r and 16 w + r + 8 of the tile
// (slots past the end read row 0; the epilogue skips them).
template <int R, int N, int HD, bool INTERLEAVED>
__device__ __forceinline__ int2 fragment_rows(int tile) {
    const int warp = threadIdx.x >> 5, r = (threadIdx.x & 31) >> 2;
    int pair;
    const int a = slot_row<R, N, HD, INTERLEAVED>(tile, 16 * warp + r, pair);
    const int b = slot_row<R, N, HD, INTERLEAVED>(tile, 16 * warp + r + 8, pair);
    return {max(a, 0), max(b, 0)};
}

// acc (one member's, tokens 8 nt ..) += the group sums `part` of rows r and r + 8 times their scales.
__device__ __forceinline__ void add_scaled(float (&acc)[4], const float (&part)[4], float a, float b) {
    acc[0] = fmaf(a, part[0], acc[0]);
    acc[1] = fmaf(a, part[1], acc[1]);
    acc[2] = fmaf(b, part[2], acc[2]);
    acc[3] = fmaf(b, part[3], acc[3]);
}

// A tile of M bf16 members: lane (r, c) loads 8 weights of each 32-k span of its two rows, k
// [8c, 8c + 8) as one 16-byte load, or where the vectors are staged GROUPED (a kernel that also
// has quantized tiles), k [4c, 4c + 4) and [16 + 4c, 20 + 4c) as two 8-byte loads.
template <int K, int M_, int R_, int N, int HD, bool INTERLEAVED, bool GROUPED = false>
struct Bf16Tile {
    static constexpr int M = M_, R = R_;
    template <int SPANS>
    struct Chunk { uint4 a[M][SPANS], b[M][SPANS]; };   // the lane's weights of a chunk, per span
    const weight_t* a[M];
    const weight_t* b[M];
    __device__ __forceinline__ Bf16Tile(const weight_t* const (&W)[M], int tile) {
        const int c = threadIdx.x & 3;
        const int2 rows = fragment_rows<R, N, HD, INTERLEAVED>(tile);
#pragma unroll
        for (int m = 0; m < M; m++) {
            a[m] = W[m] + (size_t)rows.x * K + (GROUPED ? 4 : 8) * c;
            b[m] = W[m] + (size_t)rows.y * K + (GROUPED ? 4 : 8) * c;
        }
    }
    static __device__ __forceinline__ uint4 load8(const weight_t* w) {
        if constexpr (!GROUPED) return __ldcs(reinterpret_cast<const uint4*>(w));
        const uint2 lo = __ldcs(reinterpret_cast<const uint2*>(w)), hi = __ldcs(reinterpret_cast<const uint2*>(w + 16));
        return {lo.x, lo.y, hi.x, hi.y};
    }
    template <int SPANS>
    __device__ __forceinline__ void load(int kc, Chunk<SPANS>& q) const {
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int s = 0; s < SPANS; s++) {
                q.a[m][s] = load8(a[m] + kc + 32 * s);
                q.b[m][s] = load8(b[m] + kc + 32 * s);
            }
    }
    // acc[m][nt] += the chunk's products with tokens 8 nt .. 8 nt + 7 (hi and lo words from xs),
    // for the first `nts` token tiles (the others hold no token)
    template <int SPANS, int NT, int TT, int KC>
    __device__ __forceinline__ void products(const Chunk<SPANS>& q, const StagedChunk<TT, KC, GROUPED>& xs,
                                             float (&acc)[M][NT][4], int nts) const {
        const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
#pragma unroll
        for (int s = 0; s < SPANS; s++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                if (nt >= nts) break;
                const uint4 h = xs.hi[nt * 8 + r][4 * s + c], l = xs.lo[nt * 8 + r][4 * s + c];
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const uint4 &wa = q.a[m][s], &wb = q.b[m][s];
                    mma_16816(acc[m][nt], wa.x, wb.x, wa.y, wb.y, h.x, h.y);
                    mma_16816(acc[m][nt], wa.x, wb.x, wa.y, wb.y, l.x, l.y);
                    mma_16816(acc[m][nt], wa.z, wb.z, wa.w, wb.w, h.z, h.w);
                    mma_16816(acc[m][nt], wa.z, wb.z, wa.w, wb.w, l.z, l.w);
                }
            }
    }
};

// A tile of M members in quantized format F (quant.cuh): lane (r, c) loads its share of each
// group of its two rows (F::frag), and each group's four mma (two k halves, hi and lo) sum into
// `part`, which its scales (F::decode) add to the accumulators, with its minimum times the
// group's sum of x where F has one (XSUM).
template <class F, int K, int M_, int R_, int N, int HD, bool INTERLEAVED>
struct QuantTile {
    static constexpr int M = M_, R = R_;
    template <int SPANS>
    struct Chunk {
        typename F::Frag a[M][SPANS], b[M][SPANS];
        int g0;                            // the chunk's first group
    };
    typename F::Row a[M], b[M];
    __device__ __forceinline__ QuantTile(const unsigned char* const (&W)[M], int tile) {
        const int2 rows = fragment_rows<R, N, HD, INTERLEAVED>(tile);
#pragma unroll
        for (int m = 0; m < M; m++) {
            a[m] = F::row(W[m], N, K, rows.x);
            b[m] = F::row(W[m], N, K, rows.y);
        }
    }
    template <int SPANS>
    __device__ __forceinline__ void load(int kc, Chunk<SPANS>& q) const {
        const int c = threadIdx.x & 3;
        q.g0 = kc / 32;
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int s = 0; s < SPANS; s++) {
                q.a[m][s] = F::frag(a[m], q.g0 + s, c);
                q.b[m][s] = F::frag(b[m], q.g0 + s, c);
            }
    }
    template <int SPANS, int NT, int TT, int KC>
    __device__ __forceinline__ void products(const Chunk<SPANS>& q, const StagedChunk<TT, KC, true>& xs,
                                             float (&acc)[M][NT][4], int nts) const {
        const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
#pragma unroll
        for (int s = 0; s < SPANS; s++) {
            unsigned wa[M][4], wb[M][4];     // rows r and r + 8: the group's codes as A words
            GroupScale sa[M], sb[M];
#pragma unroll
            for (int m = 0; m < M; m++) {
                sa[m] = F::decode(q.a[m][s], c, q.g0 + s, wa[m]);
                sb[m] = F::decode(q.b[m][s], c, q.g0 + s, wb[m]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                if (nt >= nts) break;
                const uint4 h = xs.hi[nt * 8 + r][4 * s + c], l = xs.lo[nt * 8 + r][4 * s + c];
                float x0 = 0.0f, x1 = 0.0f;   // the group's sums of x, tokens 8 nt + 2c + {0, 1}
                if constexpr (F::XSUM) {
                    x0 = xs.sum[nt * 8 + 2 * c][s];
                    x1 = xs.sum[nt * 8 + 2 * c + 1][s];
                }
#pragma unroll
                for (int m = 0; m < M; m++) {
                    float part[4] = {};
                    mma_16816(part, wa[m][0], wb[m][0], wa[m][1], wb[m][1], h.x, h.y);
                    mma_16816(part, wa[m][0], wb[m][0], wa[m][1], wb[m][1], l.x, l.y);
                    if constexpr (F::HALF_SCALES) {   // weights 0-15 and 16-31 scaled apart
                        add_scaled(acc[m][nt], part, sa[m].lo, sb[m].lo);
                        part[0] = part[1] = part[2] = part[3] = 0.0f;
                    }
                    mma_16816(part, wa[m][2], wb[m][2], wa[m][3], wb[m][3], h.z, h.w);
                    mma_16816(part, wa[m][2], wb[m][2], wa[m][3], wb[m][3], l.z, l.w);
                    add_scaled(acc[m][nt], part, sa[m].hi, sb[m].hi);
                    if constexpr (F::XSUM) {
                        const float sums[4] = {x0, x1, x0, x1};
                        add_scaled(acc[m][nt], sums, sa[m].offset, sb[m].offset);
                    }
                }
            }
        }
    }
};

// acc (slots r and r + 8 of the warp, tokens 8 nt + 2c + {0, 1}) into tile_out [M][R][TT].
template <int M, int NT, int R, int TT>
__device__ __forceinline__ void write_tile(const float (&acc)[M][NT][4], float* tile_out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            float* out = tile_out + (m * R + 16 * warp + r) * TT + nt * 8 + 2 * c;
            out[0] = acc[m][nt][0];
            out[1] = acc[m][nt][1];
            out[8 * TT] = acc[m][nt][2];
            out[8 * TT + 1] = acc[m][nt][3];
        }
}

// The block's tile (Tile: Bf16Tile or QuantTile, R slots of each of M members) against the
// step's TT vectors as `vectors` stages them chunk by chunk into xs (VectorsFromX,
// StagedVectors: times the norm gain where NORMED), over k in [k0, k0 + KS):
// tile_out[(m R + s) TT + t] = dot product of slot s of member m with token t, and, where NORMED,
// ss[t] = the sum of x[t]^2 that `vectors` gives (over the block's k, or over all of K where
// staged). KS < K: one slice of a split-K tile (splitk_gather adds the slices). xs and tile_out
// may share memory: xs is not read once tile_out is written. `tokens`: how many of the TT vectors
// hold a token (the MoE kernels' passes; the rest are zeros): token tiles past them are skipped.
// EARLY: the block waits for the previous kernel (grid_wait_then_release) only once its first
// chunk's weights are in flight: they are no kernel's output, and the chunk's round trip then
// overlaps the previous kernel's tail.
template <int K, int KS, int TT, int KC, int THREADS, bool EARLY, class Tile, class Vectors, class Staged>
__device__ __forceinline__ void gemm_tile(const Tile& rows, int k0, Vectors& vectors, Staged& xs, float* tile_out,
                                          float* ss, int tokens = TT) {
    constexpr int M = Tile::M, R = Tile::R, SPANS = KC / 32, NT = TT / 8;
    static_assert(K % KS == 0 && KS % KC == 0 && KC % 32 == 0 && TT % 8 == 0 && R == 16 * (THREADS / 32),
                  "gemm tile shape");
    static_assert(FUSELM_SM80, "gemm needs mma.sync on bf16 (sm_80 on); runtime/prefill.py refuses older GPUs");
    float acc[M][NT][4] = {};
    for (int kc = k0; kc < k0 + KS; kc += KC) {
        typename Tile::template Chunk<SPANS> q;   // the chunk's weights, in flight while x is staged
        rows.load(kc, q);
        if constexpr (EARLY)
            if (kc == k0) grid_wait_then_release();   // x is the previous kernel's output
        __syncthreads();                    // the previous chunk's products are done with xs
        vectors.stage(kc, xs);
        __syncthreads();
        rows.products(q, xs, acc, (tokens + 7) / 8);
    }
    __syncthreads();                        // xs is read no more: tile_out may take its place
    write_tile<M, NT, R, TT>(acc, tile_out);
    if constexpr (Vectors::NORMED) vectors.sums(ss);
    __syncthreads();
}

// Split-K: S blocks share a tile, block `split` having run gemm_tile over the split-th K / S of k.
// Each writes its dot products (and, where NORMED, its partial sums of squares) to its slab of
// the tile's S slabs; the block that arrives last sums the S slabs in slab order (the same sums
// whichever block that is: results do not depend on timing) into tile_out and ss, leaves the
// tile's count at 0 for the next launch, and returns true: it runs the epilogue. The others
// return false. FLOATS = M * R * TT, the tile's dot products; a slab is FLOATS + TT floats.
// NORMED adds the slices' partial sums of squares; staged vectors give every slice the whole
// sums, so their kernels pass false and keep the last block's own.
template <int S, int FLOATS, int TT, bool NORMED, int THREADS>
__device__ __forceinline__ bool splitk_gather(float* tile_out, float* ss, float* slabs, unsigned* count, int split) {
    static_assert(FLOATS % 4 == 0, "slabs are written as float4");
    constexpr int SLAB = FLOATS + TT;
    __shared__ bool last;
    float* mine = slabs + (size_t)split * SLAB;
    for (int i = 4 * threadIdx.x; i < FLOATS; i += 4 * THREADS)
        *reinterpret_cast<float4*>(mine + i) = *reinterpret_cast<const float4*>(tile_out + i);
    if constexpr (NORMED)
        for (int t = threadIdx.x; t < TT; t += THREADS) mine[FLOATS + t] = ss[t];
    __threadfence();                          // the slab visible before the count says so
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(count, 1u) == S - 1;
        if (last) *count = 0;                 // every block of the tile has counted
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
#pragma unroll 4   // each pass's S loads do not wait for the pass before (its writes are shared memory)
    for (int i = 4 * threadIdx.x; i < FLOATS; i += 4 * THREADS) {
        float4 sum = __ldcg(reinterpret_cast<const float4*>(slabs + i));   // L2: the others' writes
#pragma unroll
        for (int s = 1; s < S; s++) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(slabs + (size_t)s * SLAB + i));
            sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
        }
        *reinterpret_cast<float4*>(tile_out + i) = sum;
    }
    if constexpr (NORMED)
        for (int t = threadIdx.x; t < TT; t += THREADS) {
            float sum = 0.0f;
#pragma unroll
            for (int s = 0; s < S; s++) sum += __ldcg(slabs + (size_t)s * SLAB + FLOATS + t);
            ss[t] = sum;
        }
    __syncthreads();
    return true;
}

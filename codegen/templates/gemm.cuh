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
#pragma once
#include "cp_async.cuh"
#include "gemv.cuh"            // slot_row, load_f32x8, apply_gain8
#include "mma.cuh"

#if FUSELM_WEIGHT_F16
#error "gemm.cuh: the mma takes the weights as bf16; f16 weights have no gemm form"
#endif

// x[token][kc .. kc + KC) as hi and lo bf16 words: entry e holds k [8e, 8e + 8). A row of STRIDE
// entries, STRIDE = 4 (mod 8): the 8 lanes of a quarter warp (two tokens, four entries) read 16
// bytes each from distinct banks.
template <int TT, int KC>
struct StagedX {
    static constexpr int ENTRIES = KC / 8, STRIDE = ENTRIES + (12 - ENTRIES % 8) % 8;
    uint4 hi[TT][STRIDE], lo[TT][STRIDE];
};

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

// gemm_tile's chunks of the tokens' vectors, converted by the block itself from x [TT, K] (the
// MoE kernels, whose vectors differ per expert): each of the tile's blocks converts them again.
template <int K, int TT, int KC, bool IS_NORMED, int THREADS>
struct VectorsFromX {
    static constexpr bool NORMED = IS_NORMED;
    static constexpr int ENTRIES = StagedX<TT, KC>::ENTRIES;
    static constexpr int GROUPS = (TT * ENTRIES + THREADS - 1) / THREADS;   // staged entries per thread
    static_assert(THREADS % ENTRIES == 0, "a thread stages entries of one column e");
    const float* x;
    const weight_t* gain;
    float gain_offset;
    float sumsq[GROUPS] = {};

    __device__ __forceinline__ void stage(int kc, StagedX<TT, KC>& xs) {
#pragma unroll
        for (int i = 0; i < GROUPS; i++) {
            const int g = threadIdx.x + i * THREADS, t = g / ENTRIES, e = g % ENTRIES;
            if (g < TT * ENTRIES) {
                float v[8];
                load_f32x8(x + (size_t)t * K, kc + 8 * e, v);
                split_entry<NORMED>(v, gain, gain_offset, kc + 8 * e, sumsq[i], xs.hi[t][e], xs.lo[t][e]);
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
// 16-byte entries (TT x K floats' worth), then TT floats, each token's sum of x^2 over all of K.
template <int K, int TT, int KC>
struct StagedLayout {
    static constexpr int ENTRIES = StagedX<TT, KC>::ENTRIES, CHUNK = 2 * TT * ENTRIES;
    static __device__ __forceinline__ float* sums(float* words) { return words + (size_t)TT * K; }
    static __device__ __forceinline__ const float* sums(const float* words) { return words + (size_t)TT * K; }
};

// The same chunks made once per kernel by stage_vectors (its own launch before the gemm's), which
// every block copies as they are, all at once (cp.async: no registers, one round trip), instead
// of each of a kernel's hundreds of blocks loading and converting them again.
template <int K, int TT, int KC, bool IS_NORMED, int THREADS>
struct StagedVectors {
    using Layout = StagedLayout<K, TT, KC>;
    static constexpr bool NORMED = IS_NORMED;
    static constexpr int ENTRIES = Layout::ENTRIES, CHUNK = Layout::CHUNK;
    const float* words;

    __device__ __forceinline__ void stage(int kc, StagedX<TT, KC>& xs) const {
        const uint4* chunk = reinterpret_cast<const uint4*>(words) + (size_t)(kc / KC) * CHUNK;
#pragma unroll 1   // unrolled, the copies' addresses take registers that the weights need
        for (int j = 0; j < (CHUNK + THREADS - 1) / THREADS; j++) {
            const int i = j * THREADS + threadIdx.x, t = (i / ENTRIES) % TT, e = i % ENTRIES;
            uint4* to = i < TT * ENTRIES ? &xs.hi[t][e] : &xs.lo[t][e];
            if (CHUNK % THREADS == 0 || i < CHUNK) cp_async_16_cg(to, chunk + i);   // .cg: the stage kernel's writes
        }
        cp_async_wait_all();
    }
    __device__ __forceinline__ void sums(float* ss) const {   // over all of K: split-K adds none
        for (int t = threadIdx.x; t < TT; t += THREADS) ss[t] = Layout::sums(words)[t];
    }
};

// The stage kernel's block t: token t's vector as StagedVectors reads it, and its sum of squares.
// A thread loads all its entries before converting any (one round trip, not one each).
template <int K, int TT, int KC, bool NORMED, int THREADS>
__device__ __forceinline__ void stage_vectors(const float* x, const weight_t* gain, float gain_offset, float* words) {
    using Layout = StagedLayout<K, TT, KC>;
    constexpr int ENTRIES = Layout::ENTRIES, PER = (K / 8 + THREADS - 1) / THREADS;
    uint4* staged = reinterpret_cast<uint4*>(words);
    const int t = blockIdx.x;
    float v[PER][8];
#pragma unroll
    for (int i = 0; i < PER; i++)
        if (i * THREADS + threadIdx.x < K / 8) load_f32x8(x + (size_t)t * K, 8 * (i * THREADS + threadIdx.x), v[i]);
    float sumsq = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int g = i * THREADS + threadIdx.x;
        if (g >= K / 8) break;
        uint4* chunk = staged + (size_t)(g / ENTRIES) * Layout::CHUNK;
        split_entry<NORMED>(v[i], gain, gain_offset, 8 * g, sumsq, chunk[t * ENTRIES + g % ENTRIES],
                            chunk[(TT + t) * ENTRIES + g % ENTRIES]);
    }
    if constexpr (NORMED) {
        sumsq = block_sum(sumsq);
        if (threadIdx.x == 0) Layout::sums(words)[t] = sumsq;
    }
}

// The weight rows of a lane's two A-fragment rows in each member: slots 16 w + r and 16 w + r + 8
// of the tile, from k column 8 c (slots past the end read row 0; the epilogue skips them).
template <int K, int M, int R, int N, int HD, bool INTERLEAVED>
struct TileRows {
    const weight_t* a[M];
    const weight_t* b[M];
    __device__ __forceinline__ TileRows(const weight_t* const (&W)[M], int tile) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
        int pair;
        const int row_a = slot_row<R, N, HD, INTERLEAVED>(tile, 16 * warp + r, pair);
        const int row_b = slot_row<R, N, HD, INTERLEAVED>(tile, 16 * warp + r + 8, pair);
#pragma unroll
        for (int m = 0; m < M; m++) {
            a[m] = W[m] + (size_t)max(row_a, 0) * K + 8 * c;
            b[m] = W[m] + (size_t)max(row_b, 0) * K + 8 * c;
        }
    }
    // the lane's weights of the chunk at kc: its A words for each 32-k span
    template <int SPANS>
    __device__ __forceinline__ void load(int kc, uint4 (&qa)[M][SPANS], uint4 (&qb)[M][SPANS]) const {
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int s = 0; s < SPANS; s++) {
                qa[m][s] = __ldcs(reinterpret_cast<const uint4*>(a[m] + kc + 32 * s));
                qb[m][s] = __ldcs(reinterpret_cast<const uint4*>(b[m] + kc + 32 * s));
            }
    }
};

// One chunk's products: acc[m][nt] += the lane's weights (qa, qb) x tokens 8 nt .. 8 nt + 7, whose
// hi and lo words for entry e of token t `vec(t, e, h, l)` reads from shared memory.
template <int M, int SPANS, int NT, class Vec>
__device__ __forceinline__ void chunk_products(const uint4 (&qa)[M][SPANS], const uint4 (&qb)[M][SPANS], Vec vec,
                                               float (&acc)[M][NT][4]) {
    const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
#pragma unroll
    for (int s = 0; s < SPANS; s++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            uint4 h, l;
            vec(nt * 8 + r, 4 * s + c, h, l);
#pragma unroll
            for (int m = 0; m < M; m++) {
                const uint4 &a = qa[m][s], &b = qb[m][s];
                mma_16816(acc[m][nt], a.x, b.x, a.y, b.y, h.x, h.y);
                mma_16816(acc[m][nt], a.x, b.x, a.y, b.y, l.x, l.y);
                mma_16816(acc[m][nt], a.z, b.z, a.w, b.w, h.z, h.w);
                mma_16816(acc[m][nt], a.z, b.z, a.w, b.w, l.z, l.w);
            }
        }
}

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

// The block's tile (R slots of each of M members, slot s of member m in rows slot_row(tile, s))
// against the step's TT vectors as `vectors` stages them chunk by chunk into xs (VectorsFromX,
// StagedVectors: times the norm gain where NORMED), over k in [k0, k0 + KS):
// tile_out[(m R + s) TT + t] = dot product of slot s of member m with token t, and, where NORMED,
// ss[t] = the sum of x[t]^2 that `vectors` gives (over the block's k, or over all of K where
// staged). KS < K: one slice of a split-K tile (splitk_gather adds the slices). xs and tile_out
// may share memory: xs is not read once tile_out is written.
// EARLY: the block waits for the previous kernel (grid_wait_then_release) only once its first
// chunk's weights are in flight: they are no kernel's output, and the chunk's round trip then
// overlaps the previous kernel's tail.
template <int K, int KS, int TT, int KC, int M, int R, int N, int HD, bool INTERLEAVED, int THREADS, bool EARLY,
          class Vectors>
__device__ __forceinline__ void gemm_tile(const weight_t* const (&W)[M], int tile, int k0, Vectors& vectors,
                                          StagedX<TT, KC>& xs, float* tile_out, float* ss) {
    static_assert(K % KS == 0 && KS % KC == 0 && KC % 32 == 0 && TT % 8 == 0 && R == 16 * (THREADS / 32),
                  "gemm tile shape");
    static_assert(FUSELM_SM80, "gemm needs mma.sync on bf16 (sm_80 on); runtime/prefill.py refuses older GPUs");
    constexpr int SPANS = KC / 32, NT = TT / 8;
    const TileRows<K, M, R, N, HD, INTERLEAVED> rows(W, tile);
    float acc[M][NT][4] = {};
    for (int kc = k0; kc < k0 + KS; kc += KC) {
        uint4 qa[M][SPANS], qb[M][SPANS];   // the chunk's weights, in flight while x is staged
        rows.load(kc, qa, qb);
        if constexpr (EARLY)
            if (kc == k0) grid_wait_then_release();   // x is the previous kernel's output
        __syncthreads();                    // the previous chunk's products are done with xs
        vectors.stage(kc, xs);
        __syncthreads();
        chunk_products(qa, qb, [&](int t, int e, uint4& h, uint4& l) { h = xs.hi[t][e]; l = xs.lo[t][e]; }, acc);
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

// Prefill GEMM tiles on Hopper's warpgroup tensor cores (wgmma, sm_90a): the gemm family's
// products where the weights are bf16, for steps of TT tokens (a multiple of 32), at most 256 a block.
//
// A block is three warpgroups over a tile of 128 weight rows (R slots of each of M members, M R =
// 128, member-major: A row i is slot i % R of member i / R) and TN of the step's tokens (all of
// them, or a column tile where a kernel has too few row tiles to fill the GPU: gemm.wgmma_plan).
// Consumer warpgroup g computes rows 64 g .. 64 g + 63 against the block's tokens as one
// m64nTNk16 wgmma per 16 k; the producer warpgroup copies both operands, K-major, into shared
// memory, in slots of 64 k (128-byte swizzled rows, wgmma.cuh), STAGES slots, all in flight at
// once, handed back and forth on mbarriers (barrier.cuh). It copies the weights 16 bytes a thread
// (cp.async) and the tokens' vectors so too (COPY 0), or, where the stage launch leaves them in
// slot order (StagedBf16, SLOTTED), as one bulk copy a slot (COPY 1), or a 1 / COPY part of it
// multicast to the COPY blocks of its cluster, the row tiles beside it, which need the same
// vectors (COPY 2, 4): each slot's vectors then leave L2 once for all of them.
// The tokens' vectors come as bf16 from the stage launch (stage_bf16), so a product is one
// multiply of bf16 values with float accumulation, as in a bf16 transformers run.
#pragma once
#include "cp_async.cuh"
#include "bulk_copy.cuh"
#include "barrier.cuh"
#include "gemm.cuh"            // splitk_gather
#include "gemv.cuh"            // slot_row, load_f32x8, apply_gain8
#include "wgmma.cuh"
#include "quant.cuh"           // dequantize_words and the formats' frag, decode

// d += A B for this warpgroup (m64nNk16, wgmma.cuh): emitted per N by the kernel (wgmma.j2).
template <int N>
__device__ void wgmma_m64k16(float (&d)[N / 2], unsigned long long a, unsigned long long b);
// The same with A from this thread's registers (its share of the 64 x 16 tile, WgmmaQuantRows).
template <int N>
__device__ void wgmma_m64k16_ra(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b);

// Where stage_bf16 leaves a step's vectors: [TT][K] bf16, each token's vector in order; or
// SLOTTED, for each slot of 64 k (SLOTS of them, the last padded with zeros) the TT tokens' rows
// of 128 bytes as a pipeline slot holds them (chunk c of token t at c ^ t % 8: the 128-byte
// swizzle), so that a block's tokens of a slot are one run of bytes. Then TT floats, each token's
// sum of x^2 over all of K (the norm prologue's).
template <int K, int TT, bool SLOTTED = false>
struct StagedBf16 {
    static constexpr int SLOTS = (K + 63) / 64;
    static constexpr size_t VALUES = SLOTTED ? (size_t)SLOTS * 64 * TT : (size_t)K * TT;   // bf16, before the sums
    static __device__ __forceinline__ float* sums(float* words) { return words + VALUES / 2; }
    static __device__ __forceinline__ const float* sums(const float* words) { return words + VALUES / 2; }
    // The byte offset of 16-byte chunk g (k 8 g .. 8 g + 7) of token t.
    static __device__ __forceinline__ size_t chunk(int t, int g) {
        return SLOTTED ? ((size_t)(g / 8) * TT + t) * 128 + ((g % 8 ^ t % 8) << 4) : ((size_t)t * K + 8 * g) * 2;
    }
    // SLOTTED: the byte offset of slot s's row of token t0, where its tokens' rows begin: the swizzle
    // of a row counts from there where t0 is a multiple of 8 (a block's first token: TN % 16 == 0).
    static __device__ __forceinline__ size_t slot_rows(int s, int t0) { return ((size_t)s * TT + t0) * 128; }
};

// 16-byte chunk g of a token's bf16 vector in the order of the quantized weights' codes within
// each 16 values (WgmmaQuantRows): value pairs 0, 2, 4, 6 of the 16 in its even chunk, 1, 3, 5, 7
// in the odd one. The chunk's partner is the neighbouring lane's: every lane calls it.
__device__ __forceinline__ uint4 in_codes_order(const uint4& w, int g) {
    const uint4 o = make_uint4(__shfl_xor_sync(0xffffffffu, w.x, 1), __shfl_xor_sync(0xffffffffu, w.y, 1),
                               __shfl_xor_sync(0xffffffffu, w.z, 1), __shfl_xor_sync(0xffffffffu, w.w, 1));
    return g & 1 ? make_uint4(o.y, o.w, w.y, w.w) : make_uint4(w.x, w.z, o.x, o.z);
}

// The stage kernel's block t: token t's vector times the norm gain (where NORMED) in bf16,
// rounded to nearest (in the codes' order where PERMUTED: in_codes_order), and its sum of squares,
// where StagedBf16<K, TT, SLOTTED> says.
template <int K, int TT, bool NORMED, int THREADS, bool PERMUTED = false, bool SLOTTED = false>
__device__ __forceinline__ void stage_bf16(const float* x, const weight_t* gain, float gain_offset, float* words) {
    using Staged = StagedBf16<K, TT, SLOTTED>;
    constexpr int PER = (K / 8 + THREADS - 1) / THREADS;
    static_assert(!PERMUTED || (K % 16 == 0 && THREADS % 32 == 0), "whole 16-value runs, whole warps");
    const int t = blockIdx.x;
    unsigned char* out = reinterpret_cast<unsigned char*>(words);
    if constexpr (SLOTTED && K % 64 != 0)   // the last slot's chunks past K: zeros (bulk copies take whole slots)
        for (int g = K / 8 + threadIdx.x; g < Staged::SLOTS * 8; g += THREADS)
            *reinterpret_cast<uint4*>(out + Staged::chunk(t, g)) = make_uint4(0, 0, 0, 0);
    float v[PER][8];
    load_entries<K, THREADS>(x + (size_t)t * K, v);
    float sumsq = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int g = i * THREADS + threadIdx.x;
        const bool on = g < K / 8;     // the same for both chunks of a 16-value run
        if (NORMED && on) apply_gain8(v[i], gain, 8 * g, gain_offset, sumsq);
        uint4 w = make_uint4(pack_bf16x2(v[i][0], v[i][1]), pack_bf16x2(v[i][2], v[i][3]),
                             pack_bf16x2(v[i][4], v[i][5]), pack_bf16x2(v[i][6], v[i][7]));
        if constexpr (PERMUTED) w = in_codes_order(w, g);
        if (on) *reinterpret_cast<uint4*>(out + Staged::chunk(t, g)) = w;
    }
    if constexpr (NORMED) {
        sumsq = block_sum(sumsq);
        if (threadIdx.x == 0) Staged::sums(words)[t] = sumsq;
    }
}

// Threads of a wgmma block: two consumer warpgroups (threads 0 .. 255: the products, then the
// epilogue), then the producer warpgroup, which only copies.
constexpr int WGMMA_CONSUMERS = 256, WGMMA_PRODUCERS = 128;

// The tile's weight rows as producer thread p copies them: 16-byte chunk c = p % 8 (k 8c .. 8c + 8
// of each 64) of A rows p / 8 + 16 j. Slots past the end read row 0 (the epilogue skips them).
template <int K, int M, int R, int N, int HD, bool INTERLEAVED>
struct WgmmaRows {
    static constexpr int BM = M * R, PER = BM * 8 / WGMMA_PRODUCERS;
    static constexpr bool QUANT = false;   // A from shared memory (the slots' first BM rows)
    static_assert(BM == 128, "two consumer warpgroups over 128 rows");
    const weight_t* row[PER];
    __device__ __forceinline__ WgmmaRows(const weight_t* const (&W)[M], int tile, int p) {
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int i = p / 8 + (WGMMA_PRODUCERS / 8) * j;
            int pair;
            const int r = slot_row<R, N, HD, INTERLEAVED>(tile, i % R, pair);
            row[j] = W[i / R] + (size_t)max(r, 0) * K + 8 * (p % 8);
        }
    }
    // Producer thread p's copies of the rows' k [k, k + 64) into `slot` (zeros where not `whole`).
    __device__ __forceinline__ void copy(unsigned char* slot, int k, bool whole, int p) const {
#pragma unroll
        for (int j = 0; j < PER; j++) cp_async_16_cg_or_zero(slot + sw128_offset(p / 8 + 16 * j, p % 8), row[j] + k, whole);
    }
};

// The tile's weight rows where they are quantized in format F, as a consumer thread reads them:
// its A rows i = 64 g + 16 w + lane / 4 and i + 8 (wgmma's A registers: in each warp's 16 rows,
// mma.m16n8k16's layout), loaded straight from global memory (a weight byte is one thread's:
// nothing gains from shared memory), dequantized to bf16 and given to wgmma as registers. A
// group's codes cover lane c's k (quant.cuh, decode: weights 4c .. 4c + 3 and 16 + 4c .. of a
// group), so the tokens' vectors are staged in that order (stage_bf16, PERMUTED). The producer
// copies only the vectors.
template <class F, int K, int M, int R, int N, int HD, bool INTERLEAVED>
struct WgmmaQuantRows {
    static constexpr int BM = M * R;
    static constexpr bool QUANT = true;
    static_assert(BM == 128 && R % 16 == 0, "two consumer warpgroups over 128 rows, a warp's 16 in one member");
    struct Frags { typename F::Frag a[2], b[2]; };   // a slot's two groups of rows i and i + 8, raw
    typename F::Row a, b;
    __device__ __forceinline__ WgmmaQuantRows(const unsigned char* const (&)[M], int, int) {}   // the producer's
    __device__ __forceinline__ void copy(unsigned char*, int, bool, int) const {}
    __device__ __forceinline__ WgmmaQuantRows(const unsigned char* const (&W)[M], int tile) {   // a consumer's
        const int i = threadIdx.x / 128 * 64 + (threadIdx.x / 32) % 4 * 16 + (threadIdx.x % 32) / 4;
        int pair;
        const int ra = slot_row<R, N, HD, INTERLEAVED>(tile, i % R, pair);
        const int rb = slot_row<R, N, HD, INTERLEAVED>(tile, (i + 8) % R, pair);
        a = F::row(W[i / R], N, K, max(ra, 0));     // (rows past the end read row 0: the epilogue skips them)
        b = F::row(W[i / R], N, K, max(rb, 0));
    }
    // The raw codes and scales of groups g and g + 1 (a slot's 64 k).
    __device__ __forceinline__ void load(int g, Frags& f) const {
        const int c = threadIdx.x & 3;
#pragma unroll
        for (int s = 0; s < 2; s++) {
            f.a[s] = F::frag(a, g + s, c);
            f.b[s] = F::frag(b, g + s, c);
        }
    }
    // The slot's A registers, w[kk] for its k16 step kk: group s's weights 0-15 in step 2 s, 16-31 in 2 s + 1.
    __device__ __forceinline__ void weights(const Frags& f, int g, unsigned (&w)[4][4]) const {
        const int c = threadIdx.x & 3;
#pragma unroll
        for (int s = 0; s < 2; s++) {
            unsigned wa[4], wb[4];
            dequantize_words(wa, F::decode(f.a[s], c, g + s, wa));
            dequantize_words(wb, F::decode(f.b[s], c, g + s, wb));
#pragma unroll
            for (int h = 0; h < 2; h++) {
                w[2 * s + h][0] = wa[2 * h];
                w[2 * s + h][1] = wb[2 * h];
                w[2 * s + h][2] = wa[2 * h + 1];
                w[2 * s + h][3] = wb[2 * h + 1];
            }
        }
    }
};

// Bytes of one pipeline slot: the A rows, then the TT tokens' rows, 64 k each.
template <int BM, int TT>
struct WgmmaSlot {
    static constexpr int A = BM * 128, BYTES = (BM + TT) * 128;
};

// tile_out[i (TN + 1) + t - t0] = A row i . token t over k in [k0, k0 + KS) (KS a multiple of 8: the
// last slot's chunks past k0 + KS are zeros) for the consumers and the block's TN tokens t0 .. t0 +
// TN, from the tile's weights (Rows of W, tile) and the step's TT staged bf16 vectors `staged`
// (StagedBf16, SLOTTED where COPY > 0), through `smem` (STAGES slots, 1024-byte aligned, which
// tile_out may share: the slots are read no more once it is written), with the pipeline's
// barriers `full` and `empty` (STAGES each, at the same place in every block of a cluster).
// Warp-specialized: the producer warpgroup fills slot kt % STAGES and says so on its `full`
// barrier as the copies land (cp_async_arrive_on; a bulk copy's bytes count there too); the
// consumers wait there, multiply, and free the slot on its `empty` barrier once their products of
// it are done (where the vectors are multicast, on the barrier of every block of the cluster:
// each block's producer writes its part of the slot into all of them). So every slot is in flight
// at once, and no barrier of the whole block stands in the k loop. The producer waits for the
// previous kernel (grid_wait_then_release) once its first slots' weights are in flight: they are
// no kernel's output, and their round trip then overlaps the previous kernel's tail. The
// producer returns from here; the consumers come back with tile_out written, after (COPY > 1)
// every block of the cluster is done with the slots of the others.
template <int K, int KS, int TT, int TN, int STAGES, int COPY, class Rows, class Weights>
__device__ __forceinline__ void wgmma_tile(const Weights& W, int tile, int k0, int t0, const float* staged,
                                           unsigned char* smem, float* tile_out, unsigned long long* full,
                                           unsigned long long* empty) {
    constexpr int KT = (KS + 63) / 64, X_PER = TN * 8 / WGMMA_PRODUCERS;
    constexpr int FIRST = STAGES < KT ? STAGES : KT;
    constexpr bool BULK = COPY > 0;
    constexpr int CLUSTER = COPY > 1 ? COPY : 1;
    constexpr unsigned B_BYTES = TN * 128, PART = B_BYTES / CLUSTER;   // a slot's vectors; each block's part
    using Slot = WgmmaSlot<Rows::QUANT ? 0 : Rows::BM, TN>;   // quantized A rows skip shared memory
    using Staged = StagedBf16<K, TT, BULK>;
    static_assert(FUSELM_SM90A || !FUSELM_SM90, "wgmma needs sm_90a (nvrtc.options compiles sm_90 as sm_90a)");
    static_assert(KS % 8 == 0 && K % KS == 0 && TT % TN == 0 && TN % 16 == 0 && TN <= 256 && STAGES >= 2,
                  "wgmma tile shape");
    static_assert(!Rows::QUANT || KS % 64 == 0, "quantized rows in whole slots of two groups");
    static_assert(!BULK || KS == K || KS % 64 == 0, "a split's slots are whole slots of the staged vectors");
    static_assert(COPY == 0 || COPY == 1 || COPY == 2 || COPY == 4, "1, 2 or 4 blocks share a slot's copy");
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], WGMMA_PRODUCERS + BULK);   // every producer thread's copies (+ the bulk copy's)
            mbar_init(&empty[s], 2 * CLUSTER);             // both consumer warpgroups of each block
        }
        mbar_init_fence();
    }
    if constexpr (CLUSTER > 1)
        cluster_sync();    // every block's barriers set up before any copy counts on them
    else
        __syncthreads();
    if (threadIdx.x >= WGMMA_CONSUMERS) {
        const int p = threadIdx.x - WGMMA_CONSUMERS, c = p % 8, r0 = p / 8;
        const Rows rows(W, tile, p);
        const bf16_t* x = reinterpret_cast<const bf16_t*>(staged) + (size_t)(t0 + r0) * K + 8 * c;
        const unsigned char* vectors = reinterpret_cast<const unsigned char*>(staged);
        const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0;
        auto copy_rows = [&](int kt) {
            rows.copy(smem + (kt % STAGES) * Slot::BYTES, k0 + 64 * kt, KS % 64 == 0 || 64 * kt + 8 * c < KS, p);
        };
        auto copy_vectors = [&](int kt) {   // .cg / bulk: the stage launch's writes, through L2
            unsigned char* slot = smem + (kt % STAGES) * Slot::BYTES + Slot::A;
            if constexpr (BULK) {
                if (p == 0) {
                    unsigned long long* bar = &full[kt % STAGES];
                    mbar_expect_tx(bar, B_BYTES);    // the slot's vectors, from every block of the cluster
                    const unsigned char* src = vectors + Staged::slot_rows(k0 / 64 + kt, t0) + rank * PART;
                    if constexpr (CLUSTER > 1)
                        bulk_copy_multicast(slot + rank * PART, src, PART, bar, (1u << CLUSTER) - 1);
                    else
                        bulk_copy(slot, src, B_BYTES, bar);
                }
            } else {
                const bool whole = KS % 64 == 0 || 64 * kt + 8 * c < KS;
#pragma unroll
                for (int j = 0; j < X_PER; j++)
                    cp_async_16_cg_or_zero(slot + sw128_offset(r0 + 16 * j, c), x + (size_t)16 * j * K + k0 + 64 * kt,
                                           whole);
            }
        };
#pragma unroll
        for (int s = 0; s < FIRST; s++) copy_rows(s);
        grid_wait_then_release();
#pragma unroll
        for (int s = 0; s < FIRST; s++) {
            copy_vectors(s);
            cp_async_arrive_on(&full[s]);
        }
        for (int kt = FIRST; kt < KT; kt++) {
            mbar_wait<(CLUSTER > 1)>(&empty[kt % STAGES], (kt / STAGES - 1) & 1);   // its last filling consumed, in every block
            copy_rows(kt);
            copy_vectors(kt);
            cp_async_arrive_on(&full[kt % STAGES]);
        }
        cp_async_wait_all();   // leave no copy behind
        return;
    }
    // This warpgroup is done with slot s: one arrival on its `empty` barrier in each block of the cluster.
    auto free_slot = [&](int s) {
        const unsigned lane = threadIdx.x % 128;
        if (lane < CLUSTER) {
            if constexpr (CLUSTER > 1)
                mbar_arrive_in(&empty[s], lane);
            else
                mbar_arrive(&empty[s]);
        }
    };
    float acc[TN / 2] = {};    // warpgroup g's rows 64 g .. 64 g + 63 x the TN tokens (wgmma's layout)
    const int wg = threadIdx.x / 128;
    if constexpr (Rows::QUANT) {
        // Each slot: its A registers from the codes loaded two slots ahead (in flight through the
        // products before), then the products; each waits for its products (A registers are not
        // to change under a running wgmma), while the other warpgroup's keep the tensor cores busy.
        const Rows rows(W, tile);
        const int g0 = k0 / 32;
        typename Rows::Frags f0, f1;
        rows.load(g0, f0);                 // weights are no kernel's output: loaded before the wait
        if (KT > 1) rows.load(g0 + 2, f1);
        grid_wait_then_release();          // the epilogue reads and writes other kernels' values
        auto slot_products = [&](int kt, typename Rows::Frags& f) {
            unsigned w[4][4];
            rows.weights(f, g0 + 2 * kt, w);
            if (kt + 2 < KT) rows.load(g0 + 2 * (kt + 2), f);
            mbar_wait(&full[kt % STAGES], (kt / STAGES) & 1);
            fence_proxy_async();
            const unsigned long long b = wgmma_desc_sw128(smem + (kt % STAGES) * Slot::BYTES);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wgmma_m64k16_ra<TN>(acc, w[kk], b + 2 * kk);
            wgmma_commit();
            wgmma_wait<0>();
            free_slot(kt % STAGES);
        };
        for (int kt = 0; kt < KT; kt += 2) {   // two at a time: f0 and f1 stay registers
            slot_products(kt, f0);
            if (kt + 1 < KT) slot_products(kt + 1, f1);
        }
    } else {
        grid_wait_then_release();  // the epilogue reads and writes other kernels' values
        for (int kt = 0; kt < KT; kt++) {
            mbar_wait(&full[kt % STAGES], (kt / STAGES) & 1);
            fence_proxy_async();   // the copies (generic proxy) before wgmma's reads (async proxy)
            const unsigned char* slot = smem + (kt % STAGES) * Slot::BYTES;
            const unsigned long long a = wgmma_desc_sw128(slot + wg * 64 * 128), b = wgmma_desc_sw128(slot + Slot::A);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wgmma_m64k16<TN>(acc, a + 2 * kk, b + 2 * kk);
            wgmma_commit();
            wgmma_wait<1>();       // the products of kt - 1 are done: its slot is free
            if (kt > 0) free_slot((kt - 1) % STAGES);
        }
    }
    if constexpr (CLUSTER > 1) {
        wgmma_wait<0>();
        cluster_sync();            // no block writes into another's slots or barriers after this
    }
    wgmma_wait<0>();
    named_sync<WGMMA_CONSUMERS>();   // both warpgroups are done with the slots
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    constexpr int TS = TN + 1;       // rows one float apart: the epilogue reads down a token's column
    float* out = tile_out + (wg * 64 + 16 * warp + lane / 4) * TS + 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < TN / 8; nt++) {
        out[8 * nt] = acc[4 * nt];
        out[8 * nt + 1] = acc[4 * nt + 1];
        out[8 * TS + 8 * nt] = acc[4 * nt + 2];
        out[8 * TS + 8 * nt + 1] = acc[4 * nt + 3];
    }
    named_sync<WGMMA_CONSUMERS>();
}

// The dynamic shared memory of a kernel, from its first 1024-byte boundary (the swizzle's
// alignment; the launch asks for 1024 bytes more than the slots need).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* smem) {
    const unsigned offset = (unsigned)__cvta_generic_to_shared(smem);
    return smem + ((1024 - (offset & 1023)) & 1023);
}

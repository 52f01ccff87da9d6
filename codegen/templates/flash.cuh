// Causal flash attention for a prefill step on tensor cores (mma.sync m16n8k16, sm_80 on): a
// block of WARPS warps takes one KV head and TOK consecutive tokens of the step, whose TOK x G
// query heads are its 16 WARPS query rows (row i: token i / G, head i % G; rows past TOK G are
// idle), and walks the cache rows up to its last token's position in tiles of FLASH_BN rows.
// Each tile's K and V rows are copied once into shared memory (cp.async, two tiles in flight)
// and serve every query row of the block, where a decode-style pass re-reads the cache for
// every few tokens (so the more warps a block, the fewer times a step reads the cache).
//
// Per warp and tile: S = Q K^T (16 rows x FLASH_BN positions), masked causally (and by the
// window) per row, soft-capped; the running max and sum per row rescale the output, as in
// flash attention; then O += P V. Q and P go to the tensor cores in bf16 with float32 sums (as
// a bf16 transformers run has them), K and V through ldmatrix from XOR-swizzled rows.
//
// fp8 caches (C = KvFp8): the tiles' codes are copied into a staging pair of their own, and each
// tile is made a bf16 tile of the codes' values times 2^-120 once (fp8_tile_as_bf16: integer ops,
// exact) for all the block's rows, so the tensor-core part is the bf16 one's. The rows' scales
// (E4M3_SHIFT each way, bf16.cuh) multiply the scores and, folded into P, the values, as the
// decode pass does (attention_mma.cuh): the conversion costs no float op and no scale load a code.
#pragma once
#include "common.cuh"
#include "cp_async.cuh"
#include "attention_sinks.cuh"
#include "kv_cache.cuh"
#include "mma.cuh"

constexpr int FLASH_BN = 64;

// Byte offset of 16-byte chunk c of row r of a [rows][HD] bf16 tile (HD a multiple of 64: rows of
// whole groups of 8 chunks): the chunks of 8 consecutive rows XOR-swizzled inside their groups,
// so that ldmatrix's eight rows of one chunk column hit different banks.
template <int HD>
__device__ __forceinline__ int flash_offset(int r, int c) { return r * HD * 2 + ((c ^ (r & 7)) << 4); }

// fp8 caches: the FLASH_BN rows of codes at `codes` ([rows][HD] bytes) as bf16 words of their
// values times 2^-120 (e4m3x2_as_bf16x2), laid out as flash_offset lays a bf16 tile.
template <int HD, int WARPS>
__device__ __forceinline__ void fp8_tile_as_bf16(const unsigned char* codes, unsigned char* tile) {
    constexpr int CHUNKS = HD / 16;                  // 16 codes a chunk: two bf16 chunks of the tile
    for (int e = threadIdx.x; e < FLASH_BN * CHUNKS; e += 32 * WARPS) {
        const int r = e / CHUNKS, c = e % CHUNKS;
        const uint4 q = *reinterpret_cast<const uint4*>(codes + r * HD + 16 * c);
        const unsigned words[4] = {q.x, q.y, q.z, q.w};
        unsigned out[8];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            out[2 * w] = e4m3x2_as_bf16x2(words[w]);
            out[2 * w + 1] = e4m3x2_as_bf16x2(words[w] >> 16);
        }
        *reinterpret_cast<uint4*>(tile + flash_offset<HD>(r, 2 * c)) = make_uint4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<uint4*>(tile + flash_offset<HD>(r, 2 * c + 1)) = make_uint4(out[4], out[5], out[6], out[7]);
    }
}

// The attention of tokens TOK blockIdx.y .. (those below TT) for KV head blockIdx.x: q [TT][H HD]
// float, caches [rows][KV HD] in layout C (this step's rows written by the previous kernel),
// pos_p [TT], o [TT][H HD] float; smem (16-byte aligned): two tiles of K and V rows (4 FLASH_BN
// HD bf16), or for fp8 one bf16 tile of each and two of their codes (the same bytes).
template <int H, int KV, int HD, int TOK, int TT, int WARPS, class C = KvBf16, class Sinks = NoSinks>
__device__ __forceinline__ void flash_prefill(const float* q, const typename C::Elem* kc, const typename C::Elem* vc,
                                              const int* pos_p, int window, float scale, float softcap, float* o,
                                              unsigned char* smem, Sinks sinks = {}) {
    constexpr int G = H / KV, W = KV * HD, CHUNKS = HD / 8, KSTEPS = HD / 16, NT = FLASH_BN / 8, DT = HD / 8;
    constexpr int TILE = FLASH_BN * HD * 2, THREADS = 32 * WARPS;
    static_assert((HD == 64 || HD == 128) && TOK * G <= 16 * WARPS && TOK >= 1, "flash prefill shape");
    static_assert(FUSELM_SM80, "flash prefill needs mma.sync and cp.async (sm_80 on)");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane % 4;
    const int t0 = blockIdx.y * TOK, tokens = min(TOK, TT - t0);
    grid_wait_then_release();   // the step's own cache rows and queries are the previous kernel's
    const int first = pos_p[t0], last = pos_p[t0 + tokens - 1];

    // This lane's query rows warp * 16 + lane / 4 + 8 i (i = 0, 1): A words of each k-step, scaled.
    if constexpr (C::FP8) scale *= E4M3_SHIFT;
    int qpos[2], qtok[2], qhead[2];
    unsigned qa[KSTEPS][4];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int row = warp * 16 + lane / 4 + 8 * i;
        qtok[i] = row / G, qhead[i] = row % G;
        const bool used = qtok[i] < tokens;
        qpos[i] = used ? pos_p[t0 + qtok[i]] : -1;   // -1: sees no position
        const float* qr = q + (size_t)(t0 + (used ? qtok[i] : 0)) * H * HD + (blockIdx.x * G + qhead[i]) * HD;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            const float2 a = used ? *reinterpret_cast<const float2*>(qr + 16 * ks + 2 * quad) : make_float2(0.0f, 0.0f);
            const float2 b = used ? *reinterpret_cast<const float2*>(qr + 16 * ks + 8 + 2 * quad) : make_float2(0.0f, 0.0f);
            qa[ks][i] = pack_bf16x2(a.x * scale, a.y * scale);
            qa[ks][2 + i] = pack_bf16x2(b.x * scale, b.y * scale);
        }
    }

    const int lo = window > 0 ? max(0, first - window + 1) : 0, begin = lo / FLASH_BN * FLASH_BN;
    const int tiles = (last - begin) / FLASH_BN + 1;
    constexpr int CODES = FLASH_BN * HD;                    // fp8: bytes of a tile's codes
    auto copy_tile = [&](int i) {   // rows past `last` are zeros (never read: the cache may end there)
        const int p0 = begin + i * FLASH_BN;
        if constexpr (C::FP8) {
            unsigned char* k_codes = smem + 2 * TILE + (i % 2) * 2 * CODES;
#pragma unroll
            for (int e = threadIdx.x; e < FLASH_BN * HD / 16; e += THREADS) {
                const int r = e / (HD / 16), c = e % (HD / 16), p = p0 + r;
                const size_t at = (size_t)(p <= last ? p : 0) * C::template STEP<W> + blockIdx.x * HD + 16 * c;
                cp_async_16_cg_or_zero(k_codes + r * HD + 16 * c, kc + at, p <= last);
                cp_async_16_cg_or_zero(k_codes + CODES + r * HD + 16 * c, vc + at, p <= last);
            }
        } else {
            unsigned char* k_tile = smem + (i % 2) * 2 * TILE;
#pragma unroll
            for (int e = threadIdx.x; e < FLASH_BN * CHUNKS; e += THREADS) {
                const int r = e / CHUNKS, c = e % CHUNKS, p = p0 + r;
                const size_t at = (size_t)(p <= last ? p : 0) * W + blockIdx.x * HD + 8 * c;
                cp_async_16_cg_or_zero(k_tile + flash_offset<HD>(r, c), kc + at, p <= last);
                cp_async_16_cg_or_zero(k_tile + TILE + flash_offset<HD>(r, c), vc + at, p <= last);
            }
        }
    };

    // fp8: the K and V scales (times E4M3_SHIFT; 0 past `last`) of tile i's rows, thread r
    // holding row r's from when the tile is copied (its loads in flight meanwhile) until it is made
    // bf16, when they go to row_scale for the scores and P
    __shared__ float row_scale[C::FP8 ? 2 : 1][FLASH_BN];
    float2 scales = {}, next_scales = {};
    auto load_scales = [&](int i) {
        float2 sc = {0.0f, 0.0f};
        if constexpr (C::FP8) {
            const int p = begin + i * FLASH_BN + threadIdx.x;
            if (threadIdx.x < FLASH_BN && p <= last)
                sc = make_float2(C::template scale<W>(kc, p, blockIdx.x) * E4M3_SHIFT,
                                 C::template scale<W>(vc, p, blockIdx.x) * E4M3_SHIFT);
        }
        return sc;
    };

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};   // per row: running max, this lane's part of the sum
    float acc[DT][4] = {};                                   // rows r, r + 8 x dims 8 d + 2 quad + {0, 1}
    copy_tile(0);
    cp_async_commit();
    if constexpr (C::FP8) scales = load_scales(0);
    for (int i = 0; i < tiles; i++) {
        if (i + 1 < tiles) {
            copy_tile(i + 1);
            if constexpr (C::FP8) next_scales = load_scales(i + 1);
        }
        cp_async_commit();
        cp_async_wait_group<1>();   // tile i has landed (this thread's part) ...
        __syncthreads();            // ... and everyone's
        const int p0 = begin + i * FLASH_BN;
        if constexpr (C::FP8) {     // its codes into the one bf16 tile pair (free since the loop's end)
            const unsigned char* k_codes = smem + 2 * TILE + (i % 2) * 2 * CODES;
            fp8_tile_as_bf16<HD, WARPS>(k_codes, smem);
            fp8_tile_as_bf16<HD, WARPS>(k_codes + CODES, smem + TILE);
            if (threadIdx.x < FLASH_BN) {
                row_scale[0][threadIdx.x] = scales.x;
                row_scale[1][threadIdx.x] = scales.y;
            }
            scales = next_scales;
            __syncthreads();
        }
        const unsigned char* k_tile = C::FP8 ? smem : smem + (i % 2) * 2 * TILE;
        const unsigned char* v_tile = k_tile + TILE;

        float s[NT][4] = {};        // scores: rows r, r + 8 x positions p0 + 8 j + 2 quad + {0, 1}
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks += 2) {
                unsigned b[4];      // B words of k-steps ks, ks + 1: matrix lane / 8 is chunk 2 ks + lane / 8
                ldmatrix_x4(b, k_tile + flash_offset<HD>(8 * j + lane % 8, 2 * ks + lane / 8));
                mma_16816(s[j], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b[0], b[1]);
                mma_16816(s[j], qa[ks + 1][0], qa[ks + 1][1], qa[ks + 1][2], qa[ks + 1][3], b[2], b[3]);
            }
        if constexpr (C::FP8)       // each position's K scale
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] *= row_scale[0][8 * j + 2 * quad + e % 2];
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e / 2, p = p0 + 8 * j + 2 * quad + e % 2;
                const bool seen = p <= qpos[r] && (window == 0 || p > qpos[r] - window);
                const float v = softcap > 0.0f ? softcap * tanhf(s[j][e] / softcap) : s[j][e];
                s[j][e] = seen ? v : NEG_INF;
                mx[r] = fmaxf(mx[r], s[j][e]);
            }
        float ref[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            ref[r] = mx[r] == NEG_INF ? 0.0f : mx[r];         // a row that has seen nothing keeps zeros
            const float rescale = __expf(m[r] - ref[r]);     // exp(-inf) = 0 before its first position
            l[r] *= rescale;
#pragma unroll
            for (int d = 0; d < DT; d++) { acc[d][2 * r] *= rescale; acc[d][2 * r + 1] *= rescale; }
            m[r] = mx[r];
        }
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[j][e] = __expf(s[j][e] - ref[e / 2]);
                l[e / 2] += s[j][e];
                if constexpr (C::FP8) s[j][e] *= row_scale[1][8 * j + 2 * quad + e % 2];   // V's
            }
#pragma unroll
        for (int kk = 0; kk < FLASH_BN / 16; kk++) {   // positions 16 kk ..: P's A words from score tiles 2 kk, 2 kk + 1
            const unsigned a0 = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), a1 = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int d = 0; d < DT; d += 2) {
                unsigned b[4];      // matrix lane / 8: positions 16 kk + 8 (lane / 8 % 2) .., dims chunk d + lane / 16
                ldmatrix_x4_trans(b, v_tile + flash_offset<HD>(16 * kk + 8 * (lane / 8 % 2) + lane % 8, d + lane / 16));
                mma_16816(acc[d], a0, a1, a2, a3, b[0], b[1]);
                mma_16816(acc[d + 1], a0, a1, a2, a3, b[2], b[3]);
            }
        }
        __syncthreads();            // every warp is done with tile i's buffer before it is refilled
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (qtok[r] >= tokens) continue;
        const int head = blockIdx.x * G + qhead[r];
        float* out = o + (size_t)(t0 + qtok[r]) * H * HD + head * HD + 2 * quad;
        const float den = (l[r] + sinks(head, m[r])) * (C::FP8 ? E4M3_IN_BF16 * E4M3_SHIFT : 1.0f);   // fp8: P V carries 2^-60
#pragma unroll
        for (int d = 0; d < DT; d++)
            *reinterpret_cast<float2*>(out + 8 * d) = make_float2(acc[d][2 * r] / den, acc[d][2 * r + 1] / den);
    }
}

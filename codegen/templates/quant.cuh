// Quantized weights, read in the layout of quant/formats.py: one struct per format, each with
//   Row        where one weight row's sections start,
//   Group      what one lane loads for one group of 32 weights (codes and scales, raw),
//   load()     that load (streamed past L1 with __ldcs, like bf16 weights),
//   idot()     the group's dot product with the staged vector (integer formats, below),
//   dot()      one half of the group's dot product (16 weights) with 16 float input values,
//   at()       one weight, for the embedding's row gather,
//   frag(), decode()  a lane's share of a group for the gemm family's tensor cores (below).
// The integer formats' codes are bytes, so dp2a (idp.cuh) multiplies two of them by two int16
// values of the vector, staged once per block in shared memory (StagedX), in one instruction.
// The float path (dot) is the fallback where the staged vector would not fit shared memory.
// The codes become floats without a conversion instruction: PRMT puts a code byte under the
// exponent byte 0x4B, making the float 2^23 + code, and one subtraction, exact, removes 2^23 and
// the format's zero point (code_minus). 4-bit codes reach byte lanes with one AND per 4 codes.
#pragma once
#include "common.cuh"
#include "idp.cuh"

// One group of the staged vector (StagedX) in registers.
struct XGroup {
    int v[16];      // the group's 32 values as int16 pairs: value 2i in the low half of v[i]
    float d;        // a value is d * its int16
    int sum[2];     // the sums of the int16 of values 0-15 and of 16-31 (zero points, minimums)
};

// acc + the dot product of the 4 signed bytes of `codes` with 4 int16 values (pairs x[0], x[1]).
__device__ __forceinline__ int dot4_i16(const int* x, unsigned codes, int acc) {
    return dp2a_hi(x[1], codes, dp2a_lo(x[0], codes, acc));
}

// The integer dot products of a group of nibbles (plus the high bits `high_bits` puts above
// them) with the staged group, {weights 0-15 (low nibbles), weights 16-31 (high nibbles)}.
template <class HighBits>
__device__ __forceinline__ int2 idot_nibbles(const uint4& q, const XGroup& x, HighBits high_bits) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        const unsigned word = word_of(q, w);
        const uint2 extra = high_bits(w);
        lo = dot4_i16(&x.v[2 * w], (word & 0x0F0F0F0Fu) | extra.x, lo);
        hi = dot4_i16(&x.v[8 + 2 * w], ((word >> 4) & 0x0F0F0F0Fu) | extra.y, hi);
    }
    return {lo, hi};
}

// A group's value from its integer dot products s (idot_nibbles): d * dot(code, x) + m * sum(x) ...
__device__ __forceinline__ float affine_idot(const int2& s, const XGroup& x, float d, float m) {
    return x.d * fmaf(d, (float)(s.x + s.y), m * (float)(x.sum[0] + x.sum[1]));
}

// ... or d * dot(code - ZERO, x).
template <int ZERO>
__device__ __forceinline__ float centred_idot(const int2& s, const XGroup& x, float d) {
    return d * x.d * (float)(s.x + s.y - ZERO * (x.sum[0] + x.sum[1]));
}

// Byte k (0..3, a constant once unrolled) of `codes`, as a float, minus ZERO.
template <int ZERO>
__device__ __forceinline__ float code_minus(unsigned codes, int k) {
    return __uint_as_float(__byte_perm(codes, 0x4Bu, 0x4550u | k)) - (8388608.0f + ZERO);
}

// acc + dot((each byte of `codes`) - ZERO, x[0 .. 4)).
template <int ZERO>
__device__ __forceinline__ float dot4(unsigned codes, const float* x, float acc) {
#pragma unroll
    for (int k = 0; k < 4; k++) acc = fmaf(code_minus<ZERO>(codes, k), x[k], acc);
    return acc;
}

// One half of a group (half 0: weights 0-15, the low nibbles; half 1: 16-31, the high ones)
// against its 16 input values x[0 .. 16): the sum of (code - ZERO) * x.
template <int ZERO, class HighBits>
__device__ __forceinline__ float dot_nibbles_half(const uint4& q, const float (&x)[16], int half, HighBits high_bits) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        const unsigned word = word_of(q, w);
        const uint2 extra = high_bits(w);
        const unsigned codes = half ? ((word >> 4) & 0x0F0F0F0Fu) | extra.y : (word & 0x0F0F0F0Fu) | extra.x;
        s = dot4<ZERO>(codes, &x[4 * w], s);
    }
    return s;
}
struct NoHighBits {
    __device__ __forceinline__ uint2 operator()(int) const { return {0u, 0u}; }
};

__device__ __forceinline__ float sum16(const float (&x)[16]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

// The gemm family (gemm.cuh, QuantTile) feeds a group of 32 to mma as bf16 A words: lane c of a
// quad takes weights 4c .. 4c + 3 (the first mma's k: weights 0-15) and 16 + 4c .. 19 + 4c (the
// second's: 16-31), nibble word c's low and high nibbles. frag(row, group, c) loads them raw (in
// flight while the tokens' vectors are staged), decode(frag, c, group) makes them 4 bf16 pairs of
// codes with the zero point taken off (small integers: exact in bf16) and the group's GroupScale,
// applied to the mma's float sums of each group: the products keep float32 accuracy, as the bf16
// tiles' do.
struct GroupScale {
    float lo, hi;      // a weight = scale * code + offset: lo for weights 0-15, hi for 16-31
    float offset;      // (the minimum of the formats with XSUM; 0 otherwise)
};

// A group's A words (decode(): bf16 pairs of codes, weights 4c .. 4c + 3, then 16 + 4c ..) made
// the weights themselves, scale * code + offset in float32 rounded once to bf16, as dequantizing
// to bf16 would: the A operand of the wgmma form (gemm_wgmma.cuh, WgmmaQuantRows).
__device__ __forceinline__ void dequantize_words(unsigned (&a)[4], const GroupScale& s) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float scale = i < 2 ? s.lo : s.hi;
        a[i] = pack_bf16x2(fmaf(scale, __uint_as_float(a[i] << 16), s.offset),
                           fmaf(scale, __uint_as_float(a[i] & 0xffff0000u), s.offset));
    }
}

// 4 codes (bytes below 128) minus ZERO as bf16 pairs {bytes 0, 1; bytes 2, 3}, exactly: PRMT puts
// each byte under 0x43 (the bf16 128 + code), one bf16x2 FMA adds 0xC300 | ZERO, -(128 + ZERO).
template <int ZERO>
__device__ __forceinline__ uint2 codes_bf16(unsigned codes) {
    static_assert(ZERO >= 0 && ZERO < 128, "the zero point of codes below 128");
    constexpr unsigned ONE = 0x3F803F80u, BIAS = (0xC300u | ZERO) * 0x10001u;
    return {fma_bf16x2(__byte_perm(codes, 0x43u, 0x4140u), ONE, BIAS),
            fma_bf16x2(__byte_perm(codes, 0x43u, 0x4342u), ONE, BIAS)};
}

// Nibble word `word` of a group, with the high bits `extra` above its low and high nibbles, as
// the lane's A words (decode()).
template <int ZERO>
__device__ __forceinline__ void nibble_codes_bf16(unsigned word, uint2 extra, unsigned (&a)[4]) {
    const uint2 lo = codes_bf16<ZERO>((word & 0x0F0F0F0Fu) | extra.x);
    const uint2 hi = codes_bf16<ZERO>(((word >> 4) & 0x0F0F0F0Fu) | extra.y);
    a[0] = lo.x; a[1] = lo.y; a[2] = hi.x; a[3] = hi.y;
}

// Byte codes, 4 of weights 4c.. in `lo` and 4 of 16 + 4c.. in `hi`, as the lane's A words,
// through float32 (`to_floats`: a word's 4 codes as floats; signed bytes and e4m3 are exact in bf16).
template <class ToFloats>
__device__ __forceinline__ void byte_codes_bf16(unsigned lo, unsigned hi, unsigned (&a)[4], ToFloats to_floats) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float v[4];
        to_floats(i ? hi : lo, v);
        a[2 * i] = pack_bf16x2(v[0], v[1]);
        a[2 * i + 1] = pack_bf16x2(v[2], v[3]);
    }
}
// Q8_0's signed codes: + 128 they are unsigned bytes (each sign bit flipped).
__device__ __forceinline__ void signed_bytes_to_f32(unsigned w, float (&v)[4]) {
#pragma unroll
    for (int k = 0; k < 4; k++) v[k] = code_minus<128>(w ^ 0x80808080u, k);
}

// Word c of each 16 bytes of a group of 32 byte codes (Q8_0, FP8), streamed.
__device__ __forceinline__ uint2 byte_words(const unsigned char* q, int g, int c) {
    const unsigned* w = reinterpret_cast<const unsigned*>(q) + 8 * g + c;
    return {__ldcs(w), __ldcs(w + 4)};
}
// The 16 bytes of which lane c of each quad holds word c, in every lane of the quad (the K-quants'
// super-block header: a word a lane instead of four, while the loads are in flight).
__device__ __forceinline__ uint4 quad_words(unsigned word) {
    const int base = threadIdx.x & 28;
    return {__shfl_sync(0xffffffffu, word, base), __shfl_sync(0xffffffffu, word, base + 1),
            __shfl_sync(0xffffffffu, word, base + 2), __shfl_sync(0xffffffffu, word, base + 3)};
}
// Word c of a group's 16 bytes of nibbles, streamed.
__device__ __forceinline__ unsigned nibble_word(const unsigned char* q, int g, int c) {
    return __ldcs(reinterpret_cast<const unsigned*>(q) + 4 * g + c);
}

// The nibble of weight k in a row of 4-bit groups.
__device__ __forceinline__ int nibble_at(const unsigned char* q, int k) {
    const unsigned char b = q[(k >> 5) * 16 + (k & 15)];
    return (k & 16) ? b >> 4 : b & 15;
}

struct Q8_0 {          // codes int8 [N][K], d f16 [N][K/32]
    static constexpr bool XSUM = false;
    struct Row { const unsigned char* q; const f16_t* d; };
    struct Group { uint4 a, b; f16_t d; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        return {w + (size_t)r * K, reinterpret_cast<const f16_t*>(w + (size_t)N * K) + (size_t)r * (K / 32)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        const uint4* q = reinterpret_cast<const uint4*>(r.q) + 2 * g;
        return {__ldcs(q), __ldcs(q + 1), __ldcs(r.d + g)};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        int s = 0;
#pragma unroll
        for (int w = 0; w < 4; w++) s = dot4_i16(&x.v[8 + 2 * w], word_of(g.b, w), dot4_i16(&x.v[2 * w], word_of(g.a, w), s));
        return f16_to_f32(g.d) * x.d * (float)s;
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; w++)   // signed codes + 128 are unsigned bytes: flip each sign bit
            s = dot4<128>(word_of(half ? g.b : g.a, w) ^ 0x80808080u, &x[4 * w], s);
        return f16_to_f32(g.d) * s;
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        return f16_to_f32(row_.d[k / 32]) * (float)(signed char)row_.q[k];
    }
    struct Frag { uint2 q; f16_t d; };
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) { return {byte_words(r.q, g, c), __ldcs(r.d + g)}; }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int, int, unsigned (&a)[4]) {
        byte_codes_bf16(f.q.x, f.q.y, a, signed_bytes_to_f32);
        const float d = f16_to_f32(f.d);
        return {d, d, 0.0f};
    }
};

struct Q4_0 {          // nibbles [N][K/2], d f16 [N][K/32]
    static constexpr bool XSUM = false;
    struct Row { const unsigned char* q; const f16_t* d; };
    struct Group { uint4 q; f16_t d; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        return {w + (size_t)r * (K / 2), reinterpret_cast<const f16_t*>(w + (size_t)N * (K / 2)) + (size_t)r * (K / 32)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.d + g)};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        return centred_idot<8>(idot_nibbles(g.q, x, NoHighBits{}), x, f16_to_f32(g.d));
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float) {
        return f16_to_f32(g.d) * dot_nibbles_half<8>(g.q, x, half, NoHighBits{});
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        return f16_to_f32(row_.d[k / 32]) * (float)(nibble_at(row_.q, k) - 8);
    }
    struct Frag { unsigned q; f16_t d; };
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) { return {nibble_word(r.q, g, c), __ldcs(r.d + g)}; }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int, int, unsigned (&a)[4]) {
        nibble_codes_bf16<8>(f.q, {0u, 0u}, a);
        const float d = f16_to_f32(f.d);
        return {d, d, 0.0f};
    }
};

struct Q4_1 {          // nibbles [N][K/2], (d, m) f16 pairs [N][K/32]
    static constexpr bool XSUM = true;
    struct Row { const unsigned char* q; const unsigned* dm; };
    struct Group { uint4 q; unsigned dm; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        return {w + (size_t)r * (K / 2), reinterpret_cast<const unsigned*>(w + (size_t)N * (K / 2)) + (size_t)r * (K / 32)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.dm + g)};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        return affine_idot(idot_nibbles(g.q, x, NoHighBits{}), x, f16_to_f32(g.dm & 0xffff), f16_to_f32(g.dm >> 16));
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float xsum) {
        const float s = dot_nibbles_half<0>(g.q, x, half, NoHighBits{});
        return fmaf(f16_to_f32(g.dm & 0xffff), s, f16_to_f32(g.dm >> 16) * xsum);
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        const unsigned dm = row_.dm[k / 32];
        return fmaf(f16_to_f32(dm & 0xffff), (float)nibble_at(row_.q, k), f16_to_f32(dm >> 16));
    }
    struct Frag { unsigned q, dm; };
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) { return {nibble_word(r.q, g, c), __ldcs(r.dm + g)}; }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int, int, unsigned (&a)[4]) {
        nibble_codes_bf16<0>(f.q, {0u, 0u}, a);
        const float d = f16_to_f32(f.dm & 0xffff);
        return {d, d, f16_to_f32(f.dm >> 16)};
    }
};

// Q4_K's scale and min of group j (0..7) from its super-block header: d and dmin (f16) in word
// 0, then 12 bytes: groups 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins), groups
// 4-7 in the nibbles of bytes 8-11 with their top 2 bits in the top of bytes 0-3 and 4-7.
// Shifts and selects on j, which is a run-time value: an indexed byte array would live in
// local memory.
__device__ __forceinline__ void q4_k_scale_min(const uint4& h, int j, float& scale, float& min) {
    const int shift = 8 * (j & 3);   // byte j % 4 of each scales word to the bottom
    const unsigned y = h.y >> shift, z = h.z >> shift, w = h.w >> shift;
    const unsigned sc = j < 4 ? y & 63 : (w & 15) | ((y >> 2) & 48);
    const unsigned mn = j < 4 ? z & 63 : ((w >> 4) & 15) | ((z >> 2) & 48);
    scale = f16_to_f32(h.x & 0xffff) * (float)sc;
    min = f16_to_f32(h.x >> 16) * (float)mn;
}

struct Q4_K {          // nibbles [N][K/2], 16-byte headers [N][K/256]
    static constexpr bool XSUM = true;
    struct Row { const unsigned char* q; const uint4* h; };
    struct Group { uint4 q, h; int j; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        return {w + (size_t)r * (K / 2), reinterpret_cast<const uint4*>(w + (size_t)N * (K / 2)) + (size_t)r * (K / 256)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.h + g / 8), g % 8};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        float scale, min;
        q4_k_scale_min(g.h, g.j, scale, min);
        return affine_idot(idot_nibbles(g.q, x, NoHighBits{}), x, scale, -min);
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float xsum) {
        float scale, min;
        const float s = dot_nibbles_half<0>(g.q, x, half, NoHighBits{});
        q4_k_scale_min(g.h, g.j, scale, min);
        return fmaf(scale, s, -min * xsum);
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        float scale, min;
        q4_k_scale_min(row_.h[k / 256], (k / 32) % 8, scale, min);
        return fmaf(scale, (float)nibble_at(row_.q, k), -min);
    }
    struct Frag { unsigned q, h; };   // h: word c of the header (quad_words)
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) {
        return {nibble_word(r.q, g, c), __ldcs(reinterpret_cast<const unsigned*>(r.h + g / 8) + c)};
    }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int, int g, unsigned (&a)[4]) {
        nibble_codes_bf16<0>(f.q, {0u, 0u}, a);
        float scale, min;
        q4_k_scale_min(quad_words(f.h), g % 8, scale, min);
        return {scale, scale, -min};
    }
};

// A fifth bit per code: word h of a group holds, per byte b, the bits of nibble word w's low-half
// weight at bit 2w and high-half weight at bit 2w + 1 (quant/layout.pack_bits).
struct FifthBits {
    unsigned h;
    __device__ __forceinline__ uint2 operator()(int w) const {
        return {((h >> (2 * w)) & 0x01010101u) << 4, ((h >> (2 * w + 1)) & 0x01010101u) << 4};
    }
};
// The fifth bit of weight k of a row whose bit words are `bits`.
__device__ __forceinline__ int fifth_bit_at(const unsigned* bits, int k) {
    const int i = k & 31;
    return (bits[k / 32] >> (8 * (i & 3) + 2 * ((i & 15) >> 2) + ((i & 16) ? 1 : 0))) & 1;
}

struct Q5_0 {          // nibbles [N][K/2], fifth bits [N][K/32] words, d f16 [N][K/32]
    static constexpr bool XSUM = false;
    struct Row { const unsigned char* q; const unsigned* h; const f16_t* d; };
    struct Group { uint4 q; unsigned h; f16_t d; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        const unsigned char* h = w + (size_t)N * (K / 2);
        return {w + (size_t)r * (K / 2), reinterpret_cast<const unsigned*>(h) + (size_t)r * (K / 32),
                reinterpret_cast<const f16_t*>(h + (size_t)N * (K / 8)) + (size_t)r * (K / 32)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.h + g), __ldcs(r.d + g)};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        return centred_idot<16>(idot_nibbles(g.q, x, FifthBits{g.h}), x, f16_to_f32(g.d));
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float) {
        return f16_to_f32(g.d) * dot_nibbles_half<16>(g.q, x, half, FifthBits{g.h});
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        return f16_to_f32(row_.d[k / 32]) * (float)((nibble_at(row_.q, k) | (fifth_bit_at(row_.h, k) << 4)) - 16);
    }
    struct Frag { unsigned q, h; f16_t d; };
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) {
        return {nibble_word(r.q, g, c), __ldcs(r.h + g), __ldcs(r.d + g)};
    }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int c, int, unsigned (&a)[4]) {
        nibble_codes_bf16<16>(f.q, FifthBits{f.h}(c), a);
        const float d = f16_to_f32(f.d);
        return {d, d, 0.0f};
    }
};

struct Q5_1 {          // nibbles [N][K/2], fifth bits [N][K/32] words, (d, m) f16 pairs [N][K/32]
    static constexpr bool XSUM = true;
    struct Row { const unsigned char* q; const unsigned* h; const unsigned* dm; };
    struct Group { uint4 q; unsigned h, dm; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        const unsigned char* h = w + (size_t)N * (K / 2);
        return {w + (size_t)r * (K / 2), reinterpret_cast<const unsigned*>(h) + (size_t)r * (K / 32),
                reinterpret_cast<const unsigned*>(h + (size_t)N * (K / 8)) + (size_t)r * (K / 32)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.h + g), __ldcs(r.dm + g)};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        return affine_idot(idot_nibbles(g.q, x, FifthBits{g.h}), x, f16_to_f32(g.dm & 0xffff), f16_to_f32(g.dm >> 16));
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float xsum) {
        const float s = dot_nibbles_half<0>(g.q, x, half, FifthBits{g.h});
        return fmaf(f16_to_f32(g.dm & 0xffff), s, f16_to_f32(g.dm >> 16) * xsum);
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        const unsigned dm = row_.dm[k / 32];
        const int code = nibble_at(row_.q, k) | (fifth_bit_at(row_.h, k) << 4);
        return fmaf(f16_to_f32(dm & 0xffff), (float)code, f16_to_f32(dm >> 16));
    }
    struct Frag { unsigned q, h, dm; };
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) {
        return {nibble_word(r.q, g, c), __ldcs(r.h + g), __ldcs(r.dm + g)};
    }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int c, int, unsigned (&a)[4]) {
        nibble_codes_bf16<0>(f.q, FifthBits{f.h}(c), a);
        const float d = f16_to_f32(f.dm & 0xffff);
        return {d, d, f16_to_f32(f.dm >> 16)};
    }
};

struct Q5_K {          // nibbles [N][K/2], fifth bits [N][K/32] words, Q4_K's headers [N][K/256]
    static constexpr bool XSUM = true;
    struct Row { const unsigned char* q; const unsigned* h; const uint4* hdr; };
    struct Group { uint4 q, hdr; unsigned h; int j; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        const unsigned char* h = w + (size_t)N * (K / 2);
        return {w + (size_t)r * (K / 2), reinterpret_cast<const unsigned*>(h) + (size_t)r * (K / 32),
                reinterpret_cast<const uint4*>(h + (size_t)N * (K / 8)) + (size_t)r * (K / 256)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.hdr + g / 8), __ldcs(r.h + g), g % 8};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        float scale, min;
        q4_k_scale_min(g.hdr, g.j, scale, min);
        return affine_idot(idot_nibbles(g.q, x, FifthBits{g.h}), x, scale, -min);
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float xsum) {
        float scale, min;
        const float s = dot_nibbles_half<0>(g.q, x, half, FifthBits{g.h});
        q4_k_scale_min(g.hdr, g.j, scale, min);
        return fmaf(scale, s, -min * xsum);
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        float scale, min;
        q4_k_scale_min(row_.hdr[k / 256], (k / 32) % 8, scale, min);
        return fmaf(scale, (float)(nibble_at(row_.q, k) | (fifth_bit_at(row_.h, k) << 4)), -min);
    }
    struct Frag { unsigned q, h, hdr; };   // hdr: word c of the header (quad_words)
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) {
        return {nibble_word(r.q, g, c), __ldcs(r.h + g), __ldcs(reinterpret_cast<const unsigned*>(r.hdr + g / 8) + c)};
    }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int c, int g, unsigned (&a)[4]) {
        nibble_codes_bf16<0>(f.q, FifthBits{f.h}(c), a);
        float scale, min;
        q4_k_scale_min(quad_words(f.hdr), g % 8, scale, min);
        return {scale, scale, -min};
    }
};

struct Q6_K {          // low nibbles [N][K/2], high pairs [N][K/4], int8 scales [N][K/16], d f16 [N][K/256]
    static constexpr bool XSUM = false;
    struct Row { const unsigned char* q; const uint2* h; const unsigned short* s; const f16_t* d; };
    struct Group { uint4 q; uint2 h; unsigned short s; f16_t d; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        const unsigned char* h = w + (size_t)N * (K / 2);
        const unsigned char* s = h + (size_t)N * (K / 4);
        const unsigned char* d = s + (size_t)N * (K / 16);
        return {w + (size_t)r * (K / 2), reinterpret_cast<const uint2*>(h) + (size_t)r * (K / 32),
                reinterpret_cast<const unsigned short*>(s) + (size_t)r * (K / 32),
                reinterpret_cast<const f16_t*>(d) + (size_t)r * (K / 256)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.h + g), __ldcs(r.s + g), __ldcs(r.d + g / 8)};
    }
    // Word h of the pairs serves nibble words 2h and 2h + 1: per byte, from bit 0, the pairs of
    // the low half's weight, the high half's, then the next word's two (quant/layout.pack_pairs).
    // (The pairs of nibble word w from its pairs word shifted down by 4 (w % 2).)
    static __device__ __forceinline__ uint2 pair_bits(unsigned word) {
        return {(word & 0x03030303u) << 4, ((word >> 2) & 0x03030303u) << 4};
    }
    struct HighBits {
        uint2 h;
        __device__ __forceinline__ uint2 operator()(int w) const {
            return pair_bits((w < 2 ? h.x : h.y) >> (4 * (w & 1)));
        }
    };
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        const int2 s = idot_nibbles(g.q, x, HighBits{g.h});
        const float lo = (float)(signed char)(g.s & 0xff) * (float)(s.x - 32 * x.sum[0]);
        const float hi = (float)(signed char)(g.s >> 8) * (float)(s.y - 32 * x.sum[1]);
        return f16_to_f32(g.d) * x.d * (lo + hi);
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float) {
        const float sc = (float)(signed char)(half ? g.s >> 8 : g.s & 0xff);
        return f16_to_f32(g.d) * sc * dot_nibbles_half<32>(g.q, x, half, HighBits{g.h});
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        const unsigned char* h = reinterpret_cast<const unsigned char*>(row_.h + k / 32);
        const int wi = (k & 15) >> 2, b = k & 3;                  // nibble word wi, byte b
        const int pair = (h[4 * (wi >> 1) + b] >> (4 * (wi & 1) + ((k & 16) ? 2 : 0))) & 3;
        const int code = nibble_at(row_.q, k) | (pair << 4);
        const float sc = (float)reinterpret_cast<const signed char*>(row_.s)[k / 16];
        return f16_to_f32(row_.d[k / 256]) * sc * (float)(code - 32);
    }
    struct Frag { unsigned q, h; unsigned short s; f16_t d; };   // h: the pairs word of nibble word c
    static constexpr bool HALF_SCALES = true;   // a scale per 16 weights
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) {
        return {nibble_word(r.q, g, c), __ldcs(reinterpret_cast<const unsigned*>(r.h + g) + c / 2), __ldcs(r.s + g),
                __ldcs(r.d + g / 8)};
    }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int c, int, unsigned (&a)[4]) {
        nibble_codes_bf16<32>(f.q, pair_bits(f.h >> (4 * (c & 1))), a);
        const float d = f16_to_f32(f.d);
        return {d * (float)(signed char)(f.s & 0xff), d * (float)(signed char)(f.s >> 8), 0.0f};
    }
};

struct FP8 {           // e4m3 codes [N][K], float32 scale [N]
    static constexpr bool XSUM = false;
    struct Row { const unsigned char* q; float scale; };
    struct Group { uint4 a, b; float scale; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        // the scale is a weight, written by no kernel: __ldg before the grid wait is safe
        return {w + (size_t)r * K, __ldg(reinterpret_cast<const float*>(w + (size_t)N * K) + r)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        const uint4* q = reinterpret_cast<const uint4*>(r.q) + 2 * g;
        return {__ldcs(q), __ldcs(q + 1), r.scale};
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            float v[4];
            e4m3x4_to_f32(word_of(half ? g.b : g.a, w), v);
#pragma unroll
            for (int k = 0; k < 4; k++) s = fmaf(v[k], x[4 * w + k], s);
        }
        return g.scale * s;
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        float v[4];
        e4m3x4_to_f32(w[(size_t)r * K + k], v);
        return reinterpret_cast<const float*>(w + (size_t)N * K)[r] * v[0];
    }
    struct Frag { uint2 q; float scale; };
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) { return {byte_words(r.q, g, c), r.scale}; }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int, int, unsigned (&a)[4]) {
        byte_codes_bf16(f.q.x, f.q.y, a, e4m3x4_to_f32);
        return {f.scale, f.scale, 0.0f};
    }
};

// MXFP4 (gpt-oss's experts): e2m1 codes with a power-of-two scale (e8m0) per group of 32. A code's
// value, doubled, is an integer: {0, 1, 2, 3, 4, 6, 8, 12} for codes 0-7, negated for 8-15, so
// the codes are bytes for dp2a and exact bf16 for the tensor cores, and the scale is halved to
// match (2^(e - 128), as gguf's e8m0_to_fp32_half). The nibbles are in element order (byte j:
// weights 2j low and 2j + 1 high, the Hub's order): nibble word w holds weights 8w .. 8w + 7, so
// its low and high 16 bits are the table selectors of 4 codes each.
// The doubled values of the 4 codes in sel's low 16 bits, plus 12, as 4 bytes (0 .. 24): a code's
// low 3 bits pick its magnitude, and prmt_signed gives 0 where its top bit is set, so one lookup
// takes the positive codes, one (of `flipped`: sel ^ 0x8888) the negative ones, and
// 12 + positive - negative is each byte without a carry.
__device__ __forceinline__ unsigned e2m1_plus12(unsigned sel, unsigned flipped) {
    const uint2 magnitudes = {0x03020100u, 0x0C080604u};
    return prmt_signed(magnitudes, sel) + 0x0C0C0C0Cu - prmt_signed(magnitudes, flipped);
}
// Nibble word q's 8 codes as {weights 0-3, weights 4-7} in e2m1_plus12's bytes.
__device__ __forceinline__ uint2 e2m1_word(unsigned q) {
    const unsigned flipped = q ^ 0x88888888u;
    return {e2m1_plus12(q, flipped), e2m1_plus12(q >> 16, flipped >> 16)};
}
// The halved e8m0 scale 2^(e - 128) (subnormal below e = 2).
__device__ __forceinline__ float e8m0_half(unsigned e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

struct MXFP4 {         // nibbles [N][K/2] in element order, e8m0 scales [N][K/32]
    static constexpr bool XSUM = false;
    struct Row { const unsigned char* q; const unsigned char* e; };
    struct Group { uint4 q; unsigned e; };
    static __device__ __forceinline__ Row row(const unsigned char* w, int N, int K, int r) {
        return {w + (size_t)r * (K / 2), w + (size_t)N * (K / 2) + (size_t)r * (K / 32)};
    }
    static __device__ __forceinline__ Group load(const Row& r, int g) {
        return {__ldcs(reinterpret_cast<const uint4*>(r.q) + g), __ldcs(r.e + g)};
    }
    static __device__ __forceinline__ float idot(const Group& g, const XGroup& x) {
        int s = 0;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const uint2 u = e2m1_word(word_of(g.q, w));
            s = dot4_i16(&x.v[4 * w + 2], u.y, dot4_i16(&x.v[4 * w], u.x, s));
        }
        return centred_idot<12>({s, 0}, x, e8m0_half(g.e));
    }
    static __device__ __forceinline__ float dot(const Group& g, const float (&x)[16], int half, float) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < 2; w++) {
            const uint2 u = e2m1_word(word_of(g.q, 2 * half + w));
            s = dot4<12>(u.y, &x[8 * w + 4], dot4<12>(u.x, &x[8 * w], s));
        }
        return e8m0_half(g.e) * s;
    }
    static __device__ __forceinline__ float at(const unsigned char* w, int N, int K, int r, int k) {
        const Row row_ = row(w, N, K, r);
        const unsigned code = (row_.q[k / 2] >> (4 * (k & 1))) & 15u;
        return e8m0_half(row_.e[k / 32]) * (float)((int)(e2m1_plus12(code, code ^ 8u) & 0xffu) - 12);
    }
    struct Frag { unsigned short lo, hi; unsigned char e; };   // codes of weights 4c .., 16 + 4c ..
    static constexpr bool HALF_SCALES = false;
    static __device__ __forceinline__ Frag frag(const Row& r, int g, int c) {
        const unsigned short* q = reinterpret_cast<const unsigned short*>(r.q) + 8 * g + c;
        return {__ldcs(q), __ldcs(q + 4), __ldcs(r.e + g)};
    }
    static __device__ __forceinline__ GroupScale decode(const Frag& f, int, int, unsigned (&a)[4]) {
        const uint2 lo = codes_bf16<12>(e2m1_plus12(f.lo, f.lo ^ 0x8888u));
        const uint2 hi = codes_bf16<12>(e2m1_plus12(f.hi, f.hi ^ 0x8888u));
        a[0] = lo.x; a[1] = lo.y; a[2] = hi.x; a[3] = hi.y;
        const float d = e8m0_half(f.e);
        return {d, d, 0.0f};
    }
};

// 16 values of the input vector from x[k ..], through the vector's own load (a norm prologue
// applies its gain and gathers x^2 into ss).
template <class Vector>
__device__ __forceinline__ void load16(const Vector& v, int k, float (&x)[16], float& ss) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float part[8];
        v.load8(k + 8 * j, part, ss);
#pragma unroll
        for (int i = 0; i < 8; i++) x[8 * j + i] = part[i];
    }
}

// The float path: acc[r] += the dot products of NR rows' groups q[r] with the group's 32 input
// values from x[k ..], half by half: 16 values live at a time, not 32.
template <class F, int NR, class Vector>
__device__ __forceinline__ void dot_groups(const typename F::Group (&q)[NR], const Vector& v, int k,
                                           float (&acc)[NR], float& ss) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        float x[16];
        load16(v, k + 16 * half, x, ss);
        const float xsum = F::XSUM ? sum16(x) : 0.0f;
#pragma unroll
        for (int r = 0; r < NR; r++) acc[r] += F::dot(q[r], x, half, xsum);
    }
}

// The input vector of a quantized GEMV read as floats, group by group (any format).
template <class Vector>
struct FloatGroups {
    static constexpr bool NORMED = Vector::NORMED;
    Vector v;
    __device__ __forceinline__ FloatGroups from(int k0) const { return {v.from(k0)}; }
    __device__ __forceinline__ void wait() const { grid_wait_then_release(); }
    // acc[r] += the dot products of NR rows' groups q[r] with group g of the vector
    template <class F, int NR>
    __device__ __forceinline__ void dot(const typename F::Group (&q)[NR], int g, float (&acc)[NR], float& ss) const {
        dot_groups<F, NR>(q, v, 32 * g, acc, ss);
    }
};

// The input vector staged in shared memory for the integer formats: each group of 32 values as
// int16, scaled so that its largest magnitude is 32767 (an error of at most 2^-16 of it per
// value), with its scale and the sums of its halves.
// note: 16-byte aligned, so its size rounds up to 16 and every element of an array of them (the
// moe kernel's one per chosen expert) keeps v on the boundary its int4 accesses need.
template <int K>
struct __align__(16) StagedX {
    int v[K / 2];          // [K/32][16] int16 pairs
    float d[K / 32];       // [K/32] scales (NaN where the group held a NaN or an infinity)
    int2 sum[K / 32];      // [K/32] sums of the int16 of values 0-15 and 16-31
};

// Stage `src` (the previous kernel's output: after the grid wait) into x. Every thread of the
// block calls it once, then all meet at its barrier: thread t converts chunks t, t + blockDim, ...
// of 8 values, the 4 threads of a group sharing its largest magnitude. A norm prologue's sum of
// x^2 is added to *sumsq.
template <int K, class Vector>
__device__ __forceinline__ void stage_vector(const Vector& src, StagedX<K>& x, float* sumsq) {
    grid_wait_then_release();
    float ss = 0.0f;
    for (int c0 = 0; c0 < K / 8; c0 += blockDim.x) {   // the same trip count in every lane: shuffles
        const int c = c0 + threadIdx.x;
        const bool on = c < K / 8;
        float v[8] = {};
        if (on) src.load8(8 * c, v, ss);
        float amax = 0.0f;
        int bad = 0;                                   // fmaxf drops NaN: count the non-finite
#pragma unroll
        for (int i = 0; i < 8; i++) {
            amax = fmaxf(amax, fabsf(v[i]));
            bad |= !(fabsf(v[i]) <= 3.4e38f);
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            bad |= __shfl_xor_sync(0xffffffffu, bad, o);
        }
        const float inv = amax > 1e-30f ? 32767.0f / amax : 0.0f;
        int q[8], sum = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) sum += q[i] = bad ? 0 : __float2int_rn(v[i] * inv);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);   // chunks 0+1 and 2+3: the group's halves
        if (on) {
            int4 packed;
            packed.x = (q[0] & 0xffff) | (q[1] << 16);
            packed.y = (q[2] & 0xffff) | (q[3] << 16);
            packed.z = (q[4] & 0xffff) | (q[5] << 16);
            packed.w = (q[6] & 0xffff) | (q[7] << 16);
            reinterpret_cast<int4*>(x.v)[c] = packed;
            if ((c & 1) == 0) reinterpret_cast<int*>(&x.sum[c / 4])[(c & 3) >> 1] = sum;
            if ((c & 3) == 0) x.d[c / 4] = bad ? __int_as_float(0x7fc00000) : amax / 32767.0f;
        }
    }
    if (Vector::NORMED) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) atomicAdd(sumsq, ss);
    }
    __syncthreads();
}

// The staged vector as warp_dot_rows_q reads it: `wait` stages it, `dot` takes the integer path.
template <int K, class Vector>
struct StagedGroups {
    static constexpr bool NORMED = false;   // the staging gathered x^2 itself
    StagedX<K>* x;
    int g0;                                 // the slice's first group
    Vector src;
    float* sumsq;
    __device__ __forceinline__ StagedGroups from(int k0) const { return {x, k0 / 32, src, sumsq}; }
    __device__ __forceinline__ void wait() const { stage_vector<K>(src, *x, sumsq); }
    template <class F, int NR>
    __device__ __forceinline__ void dot(const typename F::Group (&q)[NR], int g, float (&acc)[NR], float&) const {
        XGroup xg;
        const int4* v = reinterpret_cast<const int4*>(x->v) + 4 * (g0 + g);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int4 t = v[i];
            xg.v[4 * i] = t.x; xg.v[4 * i + 1] = t.y; xg.v[4 * i + 2] = t.z; xg.v[4 * i + 3] = t.w;
        }
        xg.d = x->d[g0 + g];
        const int2 sum = x->sum[g0 + g];
        xg.sum[0] = sum.x; xg.sum[1] = sum.y;
#pragma unroll
        for (int r = 0; r < NR; r++) acc[r] += F::idot(q[r], xg);
    }
};

// acc[r] = dot(row r's weights [k0, k0 + K), the vector) for NR rows of format F, by the calling
// warp: as warp_dot_rows (gemv.cuh) with groups of 32 weights for 16-byte chunks. Lane l takes
// groups l, l + 32, ...; UNROLL x NR groups' loads are in flight before the first dot product.
// `src` (FloatGroups or StagedGroups) gives the vector's groups; while `pending`, it must
// first wait for the previous kernel (src.wait()), with those loads in flight meanwhile.
template <class F, int K, int UNROLL, int NR, class Source>
__device__ __forceinline__ void warp_dot_rows_q(const typename F::Row (&rows)[NR], int k0, const Source& src,
                                                float (&acc)[NR], bool& pending, float& sumsq) {
    static_assert(K % 32 == 0, "rows of quantized groups");
    constexpr int GROUPS = K / 32, STEP = 32 * UNROLL;
    constexpr int FULL = GROUPS / STEP * STEP, REM = (GROUPS - FULL + 31) / 32;
    const int lane = threadIdx.x & 31, g0 = k0 / 32;
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    for (int base = 0; base < FULL; base += STEP) {
        typename F::Group q[UNROLL][NR];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
#pragma unroll
            for (int r = 0; r < NR; r++) q[u][r] = F::load(rows[r], g0 + base + 32 * u + lane);
        if (pending) { src.wait(); pending = false; }   // weights in flight meanwhile
#pragma unroll
        for (int u = 0; u < UNROLL; u++) src.template dot<F, NR>(q[u], base + 32 * u + lane, acc, ss);
    }
    if constexpr (REM > 0) {
        typename F::Group q[REM][NR];
#pragma unroll
        for (int j = 0; j < REM; j++) {
            const int g = FULL + 32 * j + lane;
#pragma unroll
            for (int r = 0; r < NR; r++)
                if (g < GROUPS) q[j][r] = F::load(rows[r], g0 + g);
        }
        if (pending) { src.wait(); pending = false; }
#pragma unroll
        for (int j = 0; j < REM; j++) {
            const int g = FULL + 32 * j + lane;
            if (g < GROUPS) src.template dot<F, NR>(q[j], g, acc, ss);
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = warp_sum(acc[r]);
    sumsq = Source::NORMED ? warp_sum(ss) : 0.0f;
}

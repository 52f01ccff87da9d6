// 16-bit floats as raw bits (bfloat16: the KV cache, the mma operands, bf16 weights; IEEE half:
// f16 weights and quantization scales) and their conversions to and from float32, one value or
// packed pairs; and fp8 (e4m3) weights to float32.
#pragma once
#include "arch.cuh"

typedef unsigned short bf16_t;   // raw bfloat16 bits
typedef unsigned short f16_t;    // raw IEEE half bits

// Exact: a bf16 is the high half of a float32.
__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

// Exact (cvt.f32.f16).
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The 4 e4m3 values of a word (byte 0 first) as float32, exactly. sm_89 on: cvt of e4m3 pairs to
// f16 pairs. Before: the e4m3 bits moved into f16's fields (sign to bit 15, exponent and mantissa
// to bits 7-14) make the value times 2^-8, subnormals included; NaN (0x7f) is not kept.
__device__ __forceinline__ void e4m3x4_to_f32(unsigned w, float (&out)[4]) {
#if FUSELM_SM89
    unsigned lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(w & 0xffffu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(w >> 16)));
    out[0] = f16_to_f32(lo & 0xffffu);
    out[1] = f16_to_f32(lo >> 16);
    out[2] = f16_to_f32(hi & 0xffffu);
    out[3] = f16_to_f32(hi >> 16);
#else
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const unsigned b = (w >> (8 * k)) & 0xffu;
        out[k] = f16_to_f32((f16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))) * 256.0f;
    }
#endif
}

// x0 as e4m3 bits (the fp8 KV cache's codes): rounded to nearest even, saturated at +-448
// (cvt.rn.satfinite.e4m3x2.f32, sm_89 on; codegen refuses an fp8 cache before).
__device__ __forceinline__ unsigned char f32_to_e4m3(float x0) {
    unsigned short r = 0;
#if FUSELM_SM89
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x0));   // first source: high byte
#endif
    return (unsigned char)(r & 0xffu);
}

// Round to nearest even, in integer arithmetic (any arch); the KV cache is stored in bf16.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// (x0, x1) as a bf16 pair (x0 in the low half), rounded to nearest (cvt.rn.bf16x2.f32, sm_80 on).
__device__ __forceinline__ unsigned pack_bf16x2(float x0, float x1) {
    unsigned r = 0;
#if FUSELM_SM80
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));   // first source: high half
#endif
    return r;
}

// What e4m3x2_as_bf16x2's words hold of each code's value: the exponent biases' difference.
constexpr float E4M3_IN_BF16 = 0x1p-120f;
// Half of the 2^120 those words lack: the fp8 attention kernels give it back twice, on the
// queries and the rows' scales (the scores' sums stay far above float32's subnormals), and on
// the scales and the outputs (P x scale stays within bf16's range).
constexpr float E4M3_SHIFT = 0x1p60f;
static_assert(E4M3_SHIFT * E4M3_SHIFT * E4M3_IN_BF16 == 1.0f, "the shifts undo the codes' 2^-120");

// An e4m3 pair (byte 0 in the low half) as a bf16 pair of its values times 2^-120 (E4M3_IN_BF16),
// exactly, subnormals included: each code's sign goes to bit 15 and its exponent and mantissa to
// bits 4-10, so the exponent is read with bf16's bias (127) instead of e4m3's (7). Integer ops
// only, any arch: the cvt route (e4m3 pair to f16 pair, each to float32, the pair to bf16) is
// two F2FP and two HADD2.F32 a pair, suspected of bounding the fp8 cache's attention
// (docs/performance.md, "fp8 cache reads").
__device__ __forceinline__ unsigned e4m3x2_as_bf16x2(unsigned w) {
    const unsigned x = __byte_perm(w, 0u, 0x4140u);               // byte 0 to bits 0-7, byte 1 to 16-23
    return ((x & 0x00800080u) << 8) | ((x & 0x007f007fu) << 4);
}

// a * b + c on bf16 pairs, rounded to nearest (fma.rn.bf16x2, sm_80 on).
__device__ __forceinline__ unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned r = 0;
#if FUSELM_SM80
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
#endif
    return r;
}

// The same pair as hi + lo, both bf16 pairs: lo holds what rounding x to hi left out (two mma of
// hi and lo keep about float32 accuracy, |error| <= 2^-17 of the value).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// The 8 bf16 values of one 16-byte load, as float32.
__device__ __forceinline__ void unpack8_bf16(uint4 q, float (&out)[8]) {
    const bf16_t* h = reinterpret_cast<const bf16_t*>(&q);
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = bf16_to_f32(h[i]);
}

// Word i (a packed pair) of a 16-byte load; i a compile-time constant once unrolled.
__device__ __forceinline__ unsigned word_of(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// Integer dot products (dp2a, sm_61 on): two 16-bit values against two bytes of a word of four
// signed 8-bit codes, added to a 32-bit accumulator, in one instruction.
#pragma once

// acc + x.lo * (signed byte 0 of codes) + x.hi * (byte 1); x two int16 (x.lo in bits 0-15).
__device__ __forceinline__ int dp2a_lo(int x, unsigned codes, int acc) {
    int r;
    asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(codes), "r"(acc));
    return r;
}

// The same with bytes 2 and 3 of codes.
__device__ __forceinline__ int dp2a_hi(int x, unsigned codes, int acc) {
    int r;
    asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(codes), "r"(acc));
    return r;
}

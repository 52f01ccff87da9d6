// Integer dot products (dp2a, sm_61 on): two 16-bit values against two bytes of a word of four
// signed 8-bit codes, added to a 32-bit accumulator, in one instruction; and the byte permute
// that looks codes up in a table of 8 bytes.
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

// Bytes of the table {t.x, t.y} (bytes 0-7) picked by the 4 nibbles of the low 16 bits of `sel`:
// a nibble's low 3 bits pick the byte, its top bit replaces it by its sign (PTX prmt's default
// mode: 0x00 for a byte below 0x80). Written in PTX because __byte_perm documents 3-bit selectors.
__device__ __forceinline__ unsigned prmt_signed(uint2 t, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(t.x), "r"(t.y), "r"(sel));
    return r;
}

// Tensor-core matrix multiply-accumulate (mma.sync: warp-wide, every lane of the warp takes part
// with its fragment words; sm_80 on, empty before).
#pragma once
#include "arch.cuh"

// d += a b, m16n8k16: A 16x16 bf16 row-major (4 words a lane), B 16x8 bf16 column-major (2 words),
// float accumulators (lane l holds rows l / 4 and l / 4 + 8, columns 2 (l % 4) + {0, 1}).
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
#if FUSELM_SM80
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

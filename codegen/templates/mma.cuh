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

// Four 8x8 bf16 matrices from shared memory, a word of each per lane (ldmatrix.x4): lane l gives
// the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); word i of lane t holds
// row t / 4, columns 2 (t % 4) + {0, 1} of matrix i: for a matrix stored [n][k], mma's B words.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#if FUSELM_SM80
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row)) : "memory");
#endif
}

// As ldmatrix_x4, each matrix transposed (.trans): word i of lane t holds rows 2 (t % 4) + {0, 1},
// column t / 4 of matrix i: for a matrix stored [k][n], mma's B words.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
#if FUSELM_SM80
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row)) : "memory");
#endif
}

// Hopper's warpgroup tensor-core instructions (wgmma, sm_90a; empty elsewhere). A warpgroup is
// four consecutive warps; each wgmma multiplies a 64-row A by an N-column B, both read from
// shared memory through descriptors, into float accumulators spread over the warpgroup's
// registers as four m16 mma.sync tiles (warp w: rows 16 w .. 16 w + 15). The instructions are
// asynchronous: issued after wgmma_fence, grouped by wgmma_commit, waited for by wgmma_wait.
// The m64nNk16 instruction itself has one accumulator operand per register, so its wrapper is
// emitted per N by the kernel template (wgmma.j2).
#pragma once
#include "arch.cuh"

// Descriptor of a K-major bf16 tile in shared memory stored with the 128-byte swizzle: rows of
// 64 values (128 bytes), the 16-byte chunk c of row r at chunk c ^ (r % 8), groups of 8 rows
// 1024 bytes apart. The tile starts 1024-byte aligned; adding 2 (32 bytes >> 4) to a descriptor
// moves it 16 values along k inside the rows (the hardware swizzles the resulting addresses).
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* tile) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(tile);
    return (unsigned long long)((addr & 0x3FFFF) >> 4)   // start address, 16-byte units
         | (1ull << 16)                                  // leading-dimension offset: unused when swizzled
         | ((unsigned long long)(1024 >> 4) << 32)       // stride offset: one group of 8 rows
         | (1ull << 62);                                 // the 128-byte swizzle
}

// Store position of 16-byte chunk c (k 8 c .. 8 c + 8) of row r in such a tile.
__device__ __forceinline__ int sw128_offset(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// Orders the warpgroup's register and shared-memory accesses before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
#if FUSELM_SM90A
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

// Closes the group of the wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
#if FUSELM_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Waits until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if FUSELM_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
#endif
}

// Makes this thread's ordinary shared-memory writes (cp.async included) visible to the async
// proxy through which wgmma reads its operands.
__device__ __forceinline__ void fence_proxy_async() {
#if FUSELM_SM90A
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

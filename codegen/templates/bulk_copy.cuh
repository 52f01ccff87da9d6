// Bulk copies from global to shared memory (cp.async.bulk, sm_90; empty before): one thread
// starts the copy of a contiguous run of bytes, the copy engine moves it, and the mbarrier in the
// destination block counts its bytes (mbar_expect_tx, barrier.cuh). A multicast copy writes the
// same bytes at the same place of the shared memory of several blocks of a cluster, and counts
// them on each one's barrier at that place.
#pragma once
#include "arch.cuh"

// Start copying `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to
// shared `dst` of this block, counted on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
#if FUSELM_SM90
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
                    "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
#endif
}

// The same into the blocks of this cluster whose ranks are the bits of `blocks`, each counted on
// its barrier at `bar`'s place.
__device__ __forceinline__ void bulk_copy_multicast(void* dst, const void* src, unsigned bytes,
                                                    unsigned long long* bar, unsigned short blocks) {
#if FUSELM_SM90
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1], %2, [%3], %4;"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
                    "r"((unsigned)__cvta_generic_to_shared(bar)), "h"(blocks) : "memory");
#endif
}

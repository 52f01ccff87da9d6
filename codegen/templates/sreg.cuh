// Special registers read through PTX (the block timeline in common.cuh: BlockTrace).
#pragma once

// Nanoseconds of the GPU's global timer (%globaltimer).
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The SM this thread runs on (%smid).
__device__ __forceinline__ unsigned sm_id() {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    return smid;
}

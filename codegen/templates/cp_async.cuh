// Asynchronous copies from global to shared memory (cp.async, sm_80 on; empty before): the data
// goes straight to shared memory, through no registers, while the thread runs on.
#pragma once
#include "arch.cuh"

// Start copying 16 bytes from global `src` to shared `dst` (both 16-byte aligned), through L2
// only (.cg: skips L1, which may hold stale lines of another kernel's writes).
__device__ __forceinline__ void cp_async_16_cg(void* dst, const void* src) {
#if FUSELM_SM80
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#endif
}

// As cp_async_16_cg where `full`, else 16 zero bytes into `dst` (src is not read).
__device__ __forceinline__ void cp_async_16_cg_or_zero(void* dst, const void* src, bool full) {
#if FUSELM_SM80
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(full ? 16 : 0) : "memory");
#endif
}

// Wait for every copy this thread started; other threads' copies need a barrier after it.
__device__ __forceinline__ void cp_async_wait_all() {
#if FUSELM_SM80
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed cp.async groups are still copying.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
#if FUSELM_SM80
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// One arrival on the mbarrier `bar` (barrier.cuh) once every cp.async this thread has started
// so far has landed; .noinc: the barrier's count includes these arrivals.
__device__ __forceinline__ void cp_async_arrive_on(unsigned long long* bar) {
#if FUSELM_SM80
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];"
                 :: "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
#endif
}

// Closes the group of cp.async issued since the last commit (an empty group is fine).
__device__ __forceinline__ void cp_async_commit() {
#if FUSELM_SM80
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

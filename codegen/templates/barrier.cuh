// Barriers among some of a block's threads (sm_90 here; empty before). Named barriers: a barrier
// of `count` threads, for a part of the block that syncs without the rest. Shared-memory
// barriers that count arrivals by phase (mbarrier): a producer and its consumers hand pipeline
// slots to each other through them, with no barrier of the whole block. A barrier completes its
// phase once `count` arrivals have come and the bytes it expects of bulk copies (mbar_expect_tx)
// have landed; waiters name the phase they wait for by its parity (0, 1, 0, ...), so each slot
// needs only the number of times it has been filled. The blocks of a cluster (a kernel's
// __cluster_dims__) may arrive on each other's barriers and sync all their threads.
#pragma once
#include "arch.cuh"

// Waits until THREADS threads (whole warps) have reached named barrier ID (0 is __syncthreads').
template <int THREADS, int ID = 1>
__device__ __forceinline__ void named_sync() {
    static_assert(THREADS % 32 == 0 && ID > 0 && ID < 16, "named barrier of whole warps");
#if FUSELM_SM90
    asm volatile("bar.sync %0, %1;" :: "n"(ID), "n"(THREADS) : "memory");
#endif
}

// Set up the barrier at `bar` (8 bytes of shared memory) for `count` arrivals a phase.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
#if FUSELM_SM90
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"
                 :: "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(count) : "memory");
#endif
}

// Makes initialized barriers visible to the copy units that arrive on them (then a block barrier).
__device__ __forceinline__ void mbar_init_fence() {
#if FUSELM_SM90
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival on `bar` by this thread.
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
#if FUSELM_SM90
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];"
                 :: "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
#endif
}

// One arrival on `bar` by this thread that also expects `bytes` more of bulk copies this phase.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
#if FUSELM_SM90
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(bytes) : "memory");
#endif
}

// One arrival on the barrier at `bar`'s place in the shared memory of block `rank` of this
// block's cluster (this block's own included), after this thread's earlier memory accesses.
__device__ __forceinline__ void mbar_arrive_in(unsigned long long* bar, unsigned rank) {
#if FUSELM_SM90
    asm volatile("{\n.reg .b32 remote;\n"
                 "mapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}"
                 :: "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(rank) : "memory");
#endif
}

// This block's rank in its cluster (0 without one).
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank = 0;
#if FUSELM_SM90
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
    return rank;
}

// Waits until every thread of the cluster has come here or exited; their memory accesses before
// it are visible to the threads after it (barrier initializations included).
__device__ __forceinline__ void cluster_sync() {
#if FUSELM_SM90
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}

// Whether the phase of parity `parity` of `bar` has completed (waits a while in hardware first);
// CLUSTER: acquiring what threads of other blocks of the cluster released when they arrived.
template <bool CLUSTER = false>
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
#if FUSELM_SM90
    unsigned done;
    if constexpr (CLUSTER)
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
    else
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"((unsigned)__cvta_generic_to_shared(bar)), "r"(parity) : "memory");
    return done;
#else
    return true;
#endif
}

// Waits until the phase of parity `parity` of `bar` has completed (CLUSTER: as mbar_try_wait).
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    while (!mbar_try_wait<CLUSTER>(bar, parity)) {}
}

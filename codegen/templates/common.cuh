// Shared device helpers. Header-free on purpose: NVRTC needs no CUDA include path, so CI can
// compile every kernel without a GPU or a toolkit. PTX is wrapped in bf16.cuh, mma.cuh, idp.cuh,
// cp_async.cuh, pdl.cuh and sreg.cuh (one helper per instruction); nothing else writes asm.
#pragma once
#include "bf16.cuh"
#include "pdl.cuh"
#include "sreg.cuh"

#define NEG_INF __int_as_float(0xff800000)

#if FUSELM_WEIGHT_F16
typedef f16_t weight_t;
__device__ __forceinline__ float w2f(weight_t w) { return f16_to_f32(w); }
#else
typedef bf16_t weight_t;
__device__ __forceinline__ float w2f(weight_t w) { return bf16_to_f32(w); }
#endif

// Unpack 8 weights held in one 16-byte load.
__device__ __forceinline__ void unpack8(uint4 q, float (&out)[8]) {
    const weight_t* h = reinterpret_cast<const weight_t*>(&q);
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = w2f(h[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions for blocks of up to 1024 threads; every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();                       // partial[] may still be read from a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : NEG_INF;
    return warp_max(v);
}

// RoPE on one element of a rotated pair: `second` says whether this is the pair's second half.
__device__ __forceinline__ float rope_rotate(float self, float partner, bool second, float angle) {
    float s, c;
    sincosf(angle, &s, &c);  // not __sincosf: angles reach thousands of radians
    return second ? self * c + partner * s : self * c - partner * s;
}

__device__ __forceinline__ float rms_scale(float sum_sq, int n, float eps) { return rsqrtf(sum_sq / n + eps); }

// Whether this block is the last of the grid to get here. Every thread's global writes before the
// call are visible to the last block after it (each thread fences before its block is counted
// in). `count` is 0 before a launch's first arrival; the last block leaves it at 0 for the next.
__device__ __forceinline__ bool last_block_arrives(unsigned* count) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(count, 1u) == gridDim.x - 1;
        if (last) *count = 0u;                   // every other block has counted in
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Block timeline for `fuselm trace` (a module built with trace=True compiles it in): thread 0 of every block
// records its own times: when it started, when its wait for the previous kernel returned (0 if it
// never waited) and when it left. codegen's module_source numbers each kernel's TRACE_BLOCK() in
// module order (TRACE_BLOCK_AS(id)): the id names the kernel, and defines FUSELM_TRACE_EVENTS
// (codegen.TRACE_EVENTS), the events the buffer holds.
#if FUSELM_TRACE
__device__ unsigned long long fuselm_trace[FUSELM_TRACE_EVENTS][4];   // [event] id|smid|block, start, waited, end
__device__ unsigned fuselm_trace_count;

// Thread 0's stamps, in shared memory: no register held through the kernel for them.
__device__ __forceinline__ unsigned long long& trace_started() {
    __shared__ unsigned long long t;
    return t;
}

__device__ __forceinline__ unsigned long long& trace_waited() {
    __shared__ unsigned long long t;
    return t;
}

struct BlockTrace {
    unsigned id;
    __device__ explicit BlockTrace(unsigned kernel) : id(kernel) {
        if (threadIdx.x == 0) { trace_started() = global_ns(); trace_waited() = 0; }
    }
    __device__ ~BlockTrace() {   // also at an early return
        if (threadIdx.x != 0) return;
        const unsigned long long end = global_ns();
        const unsigned i = atomicAdd(&fuselm_trace_count, 1u);
        if (i >= FUSELM_TRACE_EVENTS) return;   // the host sees the count and refuses
        const unsigned smid = sm_id();
        const unsigned block = blockIdx.y * gridDim.x + blockIdx.x;
        fuselm_trace[i][0] = (unsigned long long)id << 48 | (unsigned long long)smid << 32 | block;
        fuselm_trace[i][1] = trace_started();
        fuselm_trace[i][2] = trace_waited();
        fuselm_trace[i][3] = end;
    }
};
#define TRACE_BLOCK_AS(kernel) BlockTrace block_trace_(kernel)
#define TRACE_WAITED() do { if (threadIdx.x == 0) trace_waited() = global_ns(); } while (0)
#define TRACE_BLOCK() static_assert(false, "a TRACE_BLOCK() that module_source did not number")
#else
#define TRACE_WAITED() do {} while (0)
#define TRACE_BLOCK() do {} while (0)
#endif

// Programmatic dependent launch (Hopper and later; no-ops before sm_90 and when the launch did
// not ask for it). A kernel launched that way may start while the previous one still runs: before
// this wait, which returns once the previous grid has finished and its writes are visible, it may
// read only data no running kernel writes (weights, earlier cache rows, and what
// compiler/plan_early_reads.py shows finished) and write nothing. A GEMV lets
// its successor be scheduled right after its own wait (with its first weight loads in flight,
// see warp_dot_rows), so it does not take SM slots from the blocks of the kernel before it.
__device__ __forceinline__ void grid_wait_then_release() {
#if FUSELM_SM90   // before, no wait: none to trace either
    griddep_wait();
    TRACE_WAITED();
    griddep_launch_dependents();
#endif
}

// Kernels of a few blocks (row-wise, attention) let their successor be scheduled at once, before
// they wait: the GEMV after them then starts its weight stream while they, and the kernel before
// them, still run. Safe however many kernels run ahead: each waits for its predecessor, which
// finished only after waiting for its own (a grid finishes only once all its blocks have; blocks
// that leave without waiting, empty attention chunks, touch nothing a later kernel writes).
// (Releasing again in grid_wait_then_release is a no-op.)
__device__ __forceinline__ void grid_release() { griddep_launch_dependents(); }

// Routed expert FFN (mixture of experts). For one token (decode), every block re-derives the top-k
// experts from the router logits (one warp, from registers: cheap even for 128 experts), so
// routing needs no extra launch and no host round trip, and only the chosen experts' weights are
// streamed. For a step of TT tokens (batched prefill), nearly every expert has some token (8
// experts, top 2, 32 tokens: all but (3/4)^32; 128 experts, top 8: 7 in 8), so each expert's
// weights are streamed once for all the step's tokens; one launch routes the step's tokens, and
// each expert multiplies only the tokens that chose it (on average TT K / E of the TT).
#pragma once
#include "gemv.cuh"

// The top-K experts of logits[0:E] (ties: lower index first) and their router weights: a softmax
// over the chosen logits (NORM: their probabilities renormalised to sum 1), else their
// probabilities in the softmax over all E (Qwen3-MoE's norm_topk_prob false). Computed by one
// whole warp, every lane getting the result: lane l holds logits l, l + 32, ... in registers, and
// each of the K picks is a shuffle arg-max over the lanes' best unchosen logit, so a decode block
// routes 128 experts in K x (E/32 + 10) steps instead of K x E loads.
template <int E, int K, bool NORM>
__device__ __forceinline__ void warp_route(const float* logits, int (&expert)[K], float (&weight)[K]) {
    constexpr int PER = (E + 31) / 32;
    static_assert(PER <= 16, "a lane keeps at most 16 logits in registers (E <= 512)");
    const int lane = threadIdx.x & 31;
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {   // NaN as -inf: the lanes' picks agree, so no expert comes twice
        const float x = j * 32 + lane < E ? logits[j * 32 + lane] : NEG_INF;
        v[j] = isnan(x) ? NEG_INF : x;
    }
    unsigned taken = 0u;                           // bit j: logit j * 32 + lane chosen
#pragma unroll
    for (int k = 0; k < K; k++) {
        float best = NEG_INF;
        int arg = -1;                              // -1: this lane has none left
#pragma unroll
        for (int j = 0; j < PER; j++)
            if (j * 32 + lane < E && !((taken >> j) & 1u) && (arg < 0 || v[j] > best)) {
                best = v[j];
                arg = j * 32 + lane;
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best, o);
            const int other_arg = __shfl_xor_sync(0xffffffffu, arg, o);
            if (other_arg >= 0 && (arg < 0 || other > best || (other == best && other_arg < arg))) {
                best = other;
                arg = other_arg;
            }
        }
        if ((arg & 31) == lane) taken |= 1u << (arg >> 5);
        expert[k] = arg;
        weight[k] = best;
    }
    const float top = weight[0];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) sum += weight[k] = __expf(weight[k] - top);
    if (!NORM) {   // the softmax's denominator over every expert
        sum = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; j++) sum += j * 32 + lane < E ? __expf(v[j] - top) : 0.0f;
        sum = warp_sum(sum);
    }
#pragma unroll
    for (int k = 0; k < K; k++) weight[k] /= sum;
}

// warp_route for the block's one token: warp 0 routes, every thread gets the result.
template <int E, int K, bool NORM>
__device__ __forceinline__ void moe_route(const float* logits, int (&expert)[K], float (&weight)[K]) {
    __shared__ int s_expert[K];
    __shared__ float s_weight[K];
    if (threadIdx.x < 32) {
        int e[K];
        float w[K];
        warp_route<E, K, NORM>(logits, e, w);
        if (threadIdx.x == 0)
            for (int k = 0; k < K; k++) { s_expert[k] = e[k]; s_weight[k] = w[k]; }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; k++) { expert[k] = s_expert[k]; weight[k] = s_weight[k]; }
}

// A step's routes (the batched-prefill `_route` launch): warp w of the grid routes token w of TT
// (logits [TT, E]) as warp_route does for decode, writing its K choices in pick order as entries
// t K + k: expert[] the expert, weight[] its router weight. The experts' kernels then find their
// tokens in these TT K entries instead of each block routing every token again.
template <int E, int K, bool NORM, int TT>
__device__ __forceinline__ void route_step(const float* logits, int* expert, float* weight) {
    const int t = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (t >= TT) return;                           // whole warps leave together
    int e[K];
    float w[K];
    warp_route<E, K, NORM>(logits + (size_t)t * E, e, w);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int k = 0; k < K; k++) {
            expert[t * K + k] = e[k];
            weight[t * K + k] = w[k];
        }
}

// The entries t K + k of route_step's `expert` [TT K] that chose expert e, in entry (so token)
// order, into entry_of[0 : count]; returns count (every thread). A token chooses an expert at
// most once, so count <= TT. THREADS: the block's threads, whole warps. Every thread loads all its
// entries before looking at any (one round trip, not one a round), the warps' counts of each
// round meet in shared memory once, and each thread then places its chosen entries after those
// of the rounds and warps before it.
template <int TT, int K, int THREADS>
__device__ __forceinline__ int entries_routed_to(const int* expert, int e, int (&entry_of)[TT]) {
    constexpr int WARPS = THREADS / 32, ROUNDS = (TT * K + THREADS - 1) / THREADS;
    __shared__ int warp_count[ROUNDS][WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int mine[ROUNDS];
#pragma unroll
    for (int r = 0; r < ROUNDS; r++) {
        const int i = r * THREADS + threadIdx.x;
        mine[r] = i < TT * K ? expert[i] : -1;
    }
    unsigned ballot[ROUNDS];
#pragma unroll
    for (int r = 0; r < ROUNDS; r++) {
        ballot[r] = __ballot_sync(0xffffffffu, mine[r] == e);
        if (lane == 0) warp_count[r][warp] = __popc(ballot[r]);
    }
    __syncthreads();
    int count = 0;                                 // entries of the rounds before
#pragma unroll
    for (int r = 0; r < ROUNDS; r++) {
        int offset = count + __popc(ballot[r] & ((1u << lane) - 1u));   // the chosen lanes before mine
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            if (w < warp) offset += warp_count[r][w];
            count += warp_count[r][w];
        }
        if (mine[r] == e && offset < TT) entry_of[offset] = r * THREADS + threadIdx.x;   // at most TT
    }
    __syncthreads();                               // entry_of is complete
    return min(count, TT);
}

// gpt-oss's expert product of gate a and up b: g sigmoid(alpha g) (u + 1), with g = min(a, limit)
// and u = b clipped to [-limit, limit].
__device__ __forceinline__ float clamped_swiglu(float a, float b, float limit, float alpha) {
    const float g = fminf(a, limit), u = fminf(fmaxf(b, -limit), limit);
    return g / (1.0f + __expf(-alpha * g)) * (u + 1.0f);
}

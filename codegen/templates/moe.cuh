// Routed expert FFN (mixture of experts). For one token (decode), every block re-derives the top-k
// experts from the router logits (one warp, from registers: cheap even for 128 experts), so
// routing needs no extra launch and no host round trip, and only the chosen experts' weights are
// streamed. For a step of TT tokens (batched prefill), nearly every expert has some token (8
// experts, top 2, 32 tokens: all but (3/4)^32; 128 experts, top 8: 7 in 8), so each expert's
// weights are streamed once for all the step's tokens, and each token's output takes only its
// chosen experts' products, weighted by the router.
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
    for (int j = 0; j < PER; j++) v[j] = j * 32 + lane < E ? logits[j * 32 + lane] : NEG_INF;
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

// Which of the top K of logits[0:E] expert `e` is (warp_route's order and weights), or -1, with
// its router weight in `weight` (0 when not chosen), by the calling thread alone. Each pick is the
// largest logit below the previous one in (value down, index up) order, so no mask of the chosen
// is kept: a batched-prefill block routes a token per thread in few registers.
template <int E, int K, bool NORM>
__device__ __forceinline__ int route_token_to(const float* logits, int e, float& weight) {
    float last = -NEG_INF, top = 0.0f, sum = 0.0f, mine = 0.0f;
    int last_index = -1, slot = -1;
    for (int k = 0; k < K; k++) {
        int best = -1;
        float value = NEG_INF;
        for (int i = 0; i < E; i++) {
            const float v = logits[i];
            if ((v < last || (v == last && i > last_index)) && (best < 0 || v > value)) { best = i; value = v; }
        }
        if (k == 0) top = value;
        sum += __expf(value - top);
        if (best == e) { slot = k; mine = value; }
        last = value;
        last_index = best;
    }
    if (!NORM) {   // the softmax's denominator over every expert
        sum = 0.0f;
        for (int i = 0; i < E; i++) sum += __expf(logits[i] - top);
    }
    weight = slot < 0 ? 0.0f : __expf(mine - top) / sum;
    return slot;
}

// For each of TT tokens (logits [TT, E]): the weight of expert `e` in its output and which of its
// K choices e is (slot_of -1 and weight 0 where e is not among them); thread t routes token t
// (blockDim.x >= TT). Returns whether any token chose e.
template <int E, int K, bool NORM, int TT>
__device__ __forceinline__ bool route_tokens_to(const float* logits, int e, float (&weight_of)[TT], int (&slot_of)[TT]) {
    __shared__ int chosen;
    if (threadIdx.x == 0) chosen = 0;
    __syncthreads();
    if (threadIdx.x < TT) {
        const int slot = route_token_to<E, K, NORM>(logits + threadIdx.x * E, e, weight_of[threadIdx.x]);
        slot_of[threadIdx.x] = slot;
        if (slot >= 0) chosen = 1;   // by choice, not weight: a weight may underflow to 0
    }
    __syncthreads();
    return chosen != 0;
}

// gpt-oss's expert product of gate a and up b: g sigmoid(alpha g) (u + 1), with g = min(a, limit)
// and u = b clipped to [-limit, limit].
__device__ __forceinline__ float clamped_swiglu(float a, float b, float limit, float alpha) {
    const float g = fminf(a, limit), u = fminf(fmaxf(b, -limit), limit);
    return g / (1.0f + __expf(-alpha * g)) * (u + 1.0f);
}

// Routed expert FFN (mixture of experts). For one token (decode), every block re-derives the top-k
// experts from the router logits (E is small), so routing needs no extra launch and no host round
// trip, and only the chosen experts' weights are streamed. For a step of TT tokens (batched
// prefill), nearly every expert has some token (8 experts, top 2, 32 tokens: all but (3/4)^32),
// so each expert's weights are streamed once for all the step's tokens, and each token's output
// takes only its chosen experts' products, weighted by the router (the others weigh 0).
#pragma once
#include "gemv.cuh"

// The top-K experts of logits[0:E] (ties: lower index first) and their weights, renormalised
// over the chosen ones (a softmax over the top-K logits), by the calling thread alone.
template <int E, int K>
__device__ __forceinline__ void route_token(const float* logits, int (&expert)[K], float (&weight)[K]) {
    unsigned long long taken = 0ull;              // E <= 64
    float top = NEG_INF, sum = 0.0f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!((taken >> e) & 1ull) && (best < 0 || logits[e] > logits[best])) best = e;
        taken |= 1ull << best;
        expert[k] = best;
        weight[k] = logits[best];
        top = fmaxf(top, logits[best]);
    }
    for (int k = 0; k < K; k++) sum += weight[k] = __expf(weight[k] - top);
    for (int k = 0; k < K; k++) weight[k] /= sum;
}

// route_token for the block's one token: thread 0 routes, every thread gets the result.
template <int E, int K>
__device__ __forceinline__ void moe_route(const float* logits, int (&expert)[K], float (&weight)[K]) {
    __shared__ int s_expert[K];
    __shared__ float s_weight[K];
    if (threadIdx.x == 0) {
        int e[K];
        float w[K];
        route_token<E, K>(logits, e, w);
        for (int k = 0; k < K; k++) { s_expert[k] = e[k]; s_weight[k] = w[k]; }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; k++) { expert[k] = s_expert[k]; weight[k] = s_weight[k]; }
}

// For each of TT tokens (logits [TT, E]), the weight of expert `e` in its output: its router
// weight where e is among its top K, else 0 (thread t routes token t; blockDim.x >= TT). Returns
// whether any token chose e.
template <int E, int K, int TT>
__device__ __forceinline__ bool route_tokens_to(const float* logits, int e, float (&weight_of)[TT]) {
    __shared__ int chosen;
    if (threadIdx.x == 0) chosen = 0;
    __syncthreads();
    if (threadIdx.x < TT) {
        int expert[K];
        float weight[K];
        route_token<E, K>(logits + threadIdx.x * E, expert, weight);
        float w = 0.0f;
        for (int k = 0; k < K; k++)
            if (expert[k] == e) w = weight[k];
        weight_of[threadIdx.x] = w;
        if (w != 0.0f) chosen = 1;
    }
    __syncthreads();
    return chosen != 0;
}

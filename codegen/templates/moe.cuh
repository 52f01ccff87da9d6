// Routed expert FFN (mixture of experts) for one token: every block re-derives the top-k experts
// from the router logits (E is small), so routing needs no extra launch and no host round trip,
// and only the chosen experts' weights are streamed.
#pragma once
#include "gemv.cuh"

// The top-K experts of logits[0:E] (ties: lower index first) and their weights, renormalised
// over the chosen ones (a softmax over the top-K logits). Computed by thread 0 into shared memory.
template <int E, int K>
__device__ __forceinline__ void moe_route(const float* logits, int (&expert)[K], float (&weight)[K]) {
    __shared__ int s_expert[K];
    __shared__ float s_weight[K];
    if (threadIdx.x == 0) {
        unsigned long long taken = 0ull;          // E <= 64
        float top = NEG_INF, sum = 0.0f;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!((taken >> e) & 1ull) && (best < 0 || logits[e] > logits[best])) best = e;
            taken |= 1ull << best;
            s_expert[k] = best;
            s_weight[k] = logits[best];
            top = fmaxf(top, logits[best]);
        }
        for (int k = 0; k < K; k++) sum += s_weight[k] = __expf(s_weight[k] - top);
        for (int k = 0; k < K; k++) s_weight[k] /= sum;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; k++) { expert[k] = s_expert[k]; weight[k] = s_weight[k]; }
}

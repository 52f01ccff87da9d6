// Sampling on the GPU. Greedy: an argmax shared by the sampler's blocks (last_block_of_argmax,
// reduce_block_argmaxes). Otherwise, in one block: repetition penalty, temperature, then the
// top-k, top-p and min-p cuts as one logit threshold found by bisection (no sort), then an
// inverse-CDF draw.
#pragma once
#include "rowwise.cuh"

struct SamplingArgs {      // mirrors SAMPLING_ARGS in runtime/cuda_engine.py
    float temperature, top_p, min_p, repetition_penalty;
    int top_k, seed, step, pad;
};

__device__ __forceinline__ float penalized(const float* logits, const unsigned char* seen, int i, float rp) {
    const float l = logits[i];
    return seen[i] ? (l > 0.0f ? l / rp : l * rp) : l;
}

// Counter-based uniform in [0, 1): splitmix64 of (seed, step), so replays are reproducible.
__device__ __forceinline__ float uniform01(int seed, int step) {
    unsigned long long z = ((unsigned long long)(unsigned)seed << 32) + (unsigned)step + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// Count and probability mass (relative to max m) of logits/T above threshold `thr`.
template <int V>
__device__ __forceinline__ void mass_above(const float* logits, const unsigned char* seen, const SamplingArgs& a,
                                           float m, float thr, float& count, float& mass) {
    float c = 0.0f, s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float l = penalized(logits, seen, i, a.repetition_penalty) / a.temperature;
        if (l >= thr) { c += 1.0f; s += __expf(l - m); }
    }
    count = block_sum(c);
    mass = block_sum(s);
}

// The highest logit threshold in [lo, m] at which keep(count, mass) still holds; it holds at lo,
// and both count and mass shrink as the threshold rises, so bisection finds it.
template <int V, class Keep>
__device__ float highest_threshold(const float* logits, const unsigned char* seen, const SamplingArgs& a,
                                   float m, float lo, Keep keep) {
    float hi = m;
    for (int it = 0; it < 40; it++) {
        const float mid = 0.5f * (lo + hi);
        float c, s;
        mass_above<V>(logits, seen, a, m, mid, c, s);
        if (keep(c, s)) lo = mid; else hi = mid;
    }
    float c, s;
    mass_above<V>(logits, seen, a, m, hi, c, s);      // `hi` itself may already be enough
    return keep(c, s) ? hi : lo;
}

template <int V>
__device__ int sample_token(const float* logits, const unsigned char* seen, const SamplingArgs& a) {
    __shared__ float scan[1024];
    float m = NEG_INF, lo = __int_as_float(0x7f800000);
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float l = penalized(logits, seen, i, a.repetition_penalty) / a.temperature;
        m = fmaxf(m, l);
        lo = fminf(lo, l);
    }
    m = block_max(m);
    lo = -block_max(-lo);
    // The cuts in Hugging Face's order: top-k, then top-p measured within what top-k kept, then
    // min-p (relative to the best token, so independent of what the others removed).
    float thr = lo;
    if (a.top_k > 0 && a.top_k < V)
        thr = highest_threshold<V>(logits, seen, a, m, thr, [&](float c, float) { return c >= a.top_k; });
    if (a.top_p < 1.0f) {
        float c, kept;
        mass_above<V>(logits, seen, a, m, thr, c, kept);
        thr = highest_threshold<V>(logits, seen, a, m, thr, [&](float, float s) { return s >= a.top_p * kept; });
    }
    if (a.min_p > 0.0f) thr = fmaxf(thr, m + __logf(a.min_p));
    // Inverse CDF over contiguous ranges per thread, in token order.
    constexpr int PER = (V + 1023) / 1024;
    const int begin = threadIdx.x * PER, stop = min(V, begin + PER);
    float mine = 0.0f;
    for (int i = begin; i < stop; i++) {
        const float l = penalized(logits, seen, i, a.repetition_penalty) / a.temperature;
        if (l >= thr) mine += __expf(l - m);
    }
    scan[threadIdx.x] = mine;
    __syncthreads();
    for (int off = 1; off < 1024; off <<= 1) {   // inclusive Hillis-Steele scan
        const float add = threadIdx.x >= off ? scan[threadIdx.x - off] : 0.0f;
        __syncthreads();
        scan[threadIdx.x] += add;
        __syncthreads();
    }
    const float target = uniform01(a.seed, a.step) * scan[1023];
    __shared__ int chosen;
    if (threadIdx.x == 0) chosen = -1;
    __syncthreads();
    const float before = scan[threadIdx.x] - mine;
    if (target >= before && target < scan[threadIdx.x] && mine > 0.0f) {
        float acc = before;
        int pick = -1;
        for (int i = begin; i < stop; i++) {
            const float l = penalized(logits, seen, i, a.repetition_penalty) / a.temperature;
            if (l >= thr) { pick = i; acc += __expf(l - m); if (acc > target) break; }
        }
        chosen = pick;
    }
    __syncthreads();
    return chosen >= 0 ? chosen : block_argmax(logits, V);
}

constexpr unsigned NONFINITE_BIT = 0x80000000u;   // beside a block's argmax index: its slice held NaN or inf

// Grid-wide argmax of the penalized logits, step one: this block's best of [begin, end) goes to
// scratch (values as float bits at [0, G), indices at [G, 2G) with NONFINITE_BIT set when the
// slice held a NaN or inf, a finished-block counter at 2G, left at 0); returns true in the one block that
// finishes last, which then sees every block's result.
__device__ bool last_block_of_argmax(const float* logits, const unsigned char* seen, float rp,
                                     int begin, int end, unsigned* scratch) {
    float m = NEG_INF;
    int idx = begin;                              // all -inf (or an empty slice): its first index
    bool nonfinite = false;
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float l = penalized(logits, seen, i, rp);
        nonfinite |= !isfinite(logits[i]);
        if (l > m) { m = l; idx = i; }
    }
    nonfinite = __syncthreads_or(nonfinite);
    const float bm = block_max(m);
    __shared__ int first;
    if (threadIdx.x == 0) first = 0x7fffffff;
    __syncthreads();
    if (m == bm) atomicMin(&first, idx);
    __syncthreads();
    const unsigned G = gridDim.x;
    if (threadIdx.x == 0) {
        scratch[blockIdx.x] = __float_as_uint(bm);
        scratch[G + blockIdx.x] = (unsigned)first | (nonfinite ? NONFINITE_BIT : 0u);
    }
    return last_block_arrives(&scratch[2 * G]);
}

// Step two, in the last block: the best of the blocks' results (lowest index on ties).
__device__ int reduce_block_argmaxes(unsigned* scratch, unsigned G) {
    const volatile unsigned* v = scratch;
    float m = NEG_INF;
    int idx = 0x7fffffff;
    for (unsigned b = threadIdx.x; b < G; b += blockDim.x) {
        const float l = __uint_as_float(v[b]);
        const int i = (int)(v[G + b] & ~NONFINITE_BIT);
        if (l > m || (l == m && i < idx)) { m = l; idx = i; }
    }
    const float bm = block_max(m);
    __shared__ int first;
    if (threadIdx.x == 0) first = 0x7fffffff;
    __syncthreads();
    if (m == bm) atomicMin(&first, idx);
    __syncthreads();
    return first;
}

// In the last block: whether any block's slice held a NaN or inf.
__device__ bool any_block_nonfinite(unsigned* scratch, unsigned G) {
    const volatile unsigned* v = scratch;
    bool any = false;
    for (unsigned b = threadIdx.x; b < G; b += blockDim.x) any |= (v[G + b] & NONFINITE_BIT) != 0;
    return __syncthreads_or(any);
}

// Sampled picks of a batch step's rows, one block a row: the filters of runtime/sampling.py's
// sample_rows (temperature, top-k, top-p, min-p, then an inverse-CDF draw with the row's uniform
// number), in float64 and with ties in id order as its stable sort has them, but without a sort:
// each cut is a radix select over the row's keys (the values' bits, 8 at a time from the top),
// counting ids for top-k and adding probabilities for top-p, then the ids equal to the cut's
// value are taken in id order. Probabilities are summed as integers of 2^-60 (FIXED), so every
// sum, and so every pick, is the same on every run whatever order the threads add in.
#pragma once
#include "common.cuh"

constexpr int PICK_THREADS = 1024;
constexpr double FIXED = 1152921504606846976.0;       // 2^60: a probability's integer units

typedef unsigned long long u64;

// The float64 value's bits as an unsigned key in the values' order (-0.0 as 0.0).
__device__ __forceinline__ u64 ordered_key(double y) {
    const u64 b = (u64)__double_as_longlong(y + 0.0);
    return (b >> 63) ? ~b : b | (1ull << 63);
}

// Sum over the block, the same in every thread and on every run (a fixed order of adds).
template <class T>
__device__ T block_total(T v) {
    __shared__ T part[PICK_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();                                  // `part` of an earlier call read by all
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < PICK_THREADS / 32; w++) total += part[w];
    return total;
}

// What the threads before this one hold, summed (integers: exact), and the block's total.
__device__ u64 block_before(u64 v, u64& total) {
    __shared__ u64 part[PICK_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 upto = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 other = __shfl_up_sync(0xffffffffu, upto, o);
        if (lane >= o) upto += other;
    }
    __syncthreads();
    if (lane == 31) part[warp] = upto;
    __syncthreads();
    u64 before = upto - v;
    total = 0;
    for (int w = 0; w < PICK_THREADS / 32; w++) {
        if (w < warp) before += part[w];
        total += part[w];
    }
    return before;
}

__device__ __forceinline__ double block_max_of(double v) {
    __shared__ double part[PICK_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    double m = part[0];
    for (int w = 1; w < PICK_THREADS / 32; w++) m = fmax(m, part[w]);
    return m;
}

// A cut of the row's falling order: every id whose key is above `key`, and the first `ties` ids
// (in id order) of those whose key equals it. `first` is this thread's count of such equal ids
// before its range (where `ties` matters). all(): no cut.
struct Cut {
    u64 key;
    u64 ties;
    u64 first;
    static __device__ Cut all() { return {0, ~0ull, 0}; }
};

// One row of a batch step: its values y = x / temperature in a thread's contiguous range of ids
// (contiguous so that ties and the draw go in id order).
struct PickRow {
    const double* x;
    double temperature;
    int begin, end;

    __device__ double value(int i) const { return x[i] / temperature; }

    // The `first` of `cut` for this thread: ids before its range with the cut's key.
    __device__ Cut counted(Cut cut) const {
        u64 mine = 0;
        for (int i = begin; i < end; i++) mine += ordered_key(value(i)) == cut.key;
        u64 total;
        cut.first = block_before(mine, total);
        return cut;
    }
};

// Walks a thread's range calling f(i, key, kept) with kept: whether `cut` keeps id i.
template <class F>
__device__ __forceinline__ void walk(const PickRow& row, const Cut& cut, F f) {
    u64 tied = cut.first;
    for (int i = row.begin; i < row.end; i++) {
        const u64 key = ordered_key(row.value(i));
        bool kept = key > cut.key;
        if (key == cut.key) kept = tied++ < cut.ties;
        f(i, key, kept);
    }
}

// The radix select: the highest key whose ids, added to those of every higher key, reach `goal`
// of weight (weight(i) of the ids `cut` keeps), one 8-bit digit a pass from the top. Returns
// false where all of them together stay below it; else the key, the weight above it and the
// number of kept ids with it.
template <class Weight>
__device__ bool select_key(const PickRow& row, const Cut& cut, u64 goal, Weight weight,
                           u64& key, u64& above, u64& count) {
    __shared__ u64 mass[256], ids[256];
    __shared__ u64 prefix, decided, base;
    __shared__ bool found;
    __syncthreads();                                  // the last call's results read by all
    if (threadIdx.x == 0) { prefix = 0; decided = 0; base = 0; found = true; }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) mass[d] = ids[d] = 0;
        __syncthreads();
        const u64 p = prefix, mask = decided;
        walk(row, cut, [&](int i, u64 k, bool kept) {
            if (kept && (k & mask) == p) {
                const int d = (k >> shift) & 255;
                atomicAdd(&mass[d], weight(i));
                atomicAdd(&ids[d], 1ull);
            }
        });
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            u64 acc = base;
            for (; d >= 0 && acc + mass[d] < goal; d--) acc += mass[d];
            if (d < 0) { found = false; d = 0; }
            base = acc;
            prefix |= (u64)d << shift;
            decided |= 255ull << shift;
            count = ids[d];
        }
        __syncthreads();
        if (!found) return false;
    }
    __shared__ u64 last_count;
    if (threadIdx.x == 0) last_count = count;
    __syncthreads();
    key = prefix, above = base, count = last_count;
    return true;
}

// The row's pick: top-k (k-th largest by count, ties by id), softmax over what it keeps, top-p
// (the shortest prefix of the order reaching top_p of probability), min-p (probabilities at least
// min_p of the largest), then the first id whose running probability passes u of the total.
__device__ long long pick_row(const PickRow& row, int V, double top_k, double top_p, double min_p, double u) {
    double m = __longlong_as_double(0xfff0000000000000ll);     // -inf
    for (int i = row.begin; i < row.end; i++) m = fmax(m, row.value(i));
    m = block_max_of(m);
    Cut cut = Cut::all();
    u64 key, above, count;
    const long long k = (long long)top_k;
    if (k > 0 && k < V && select_key(row, cut, (u64)k, [](int) { return 1ull; }, key, above, count))
        cut = row.counted(Cut{key, (u64)k - above, 0});
    double z = 0.0;                                   // the softmax's sum over what top-k keeps
    walk(row, cut, [&](int i, u64, bool kept) { if (kept) z += exp(row.value(i) - m); });
    z = block_total(z);
    auto prob = [&](int i) { return exp(row.value(i) - m) / z; };
    auto fixed = [&](int i) { return (u64)(prob(i) * FIXED); };
    if (top_p < 1.0 && select_key(row, cut, (u64)(top_p * FIXED), fixed, key, above, count)) {
        // ids with the boundary's key, each `unit`: those whose running sum stays below top_p,
        // and the one that reaches it
        const u64 goal = (u64)(top_p * FIXED);
        __shared__ u64 unit;
        __syncthreads();
        walk(row, cut, [&](int i, u64 k2, bool kept) { if (kept && k2 == key) unit = fixed(i); });
        __syncthreads();
        const u64 below = unit ? (goal - above - 1) / unit : count;
        cut = row.counted(Cut{key, below + 1 < count ? below + 1 : count, 0});
    }
    const double floor_p = min_p * (1.0 / z);         // min-p against the largest probability, 1 / z
    u64 mine = 0;
    walk(row, cut, [&](int i, u64, bool kept) {
        if (kept && prob(i) >= floor_p) mine += fixed(i);
    });
    u64 total;
    const u64 before = block_before(mine, total);
    const u64 target = (u64)(u * (double)total);
    __shared__ long long chosen;
    if (threadIdx.x == 0) chosen = V - 1;              // none passes: the last id, as numpy's
    __syncthreads();
    if (mine > 0 && before <= target && target < before + mine) {
        u64 run = before;
        walk(row, cut, [&](int i, u64, bool kept) {
            if (run <= target && kept && prob(i) >= floor_p) {
                run += fixed(i);
                if (run > target) chosen = i;
            }
        });
    }
    __syncthreads();
    return chosen;
}

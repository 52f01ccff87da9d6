// gpt-oss's attention sinks: a learned logit per query head that joins its softmax and attends to
// nothing, so an output a / l (scores' running max m) becomes a / (l + e^(sink - m))
// (AttentionSinks); NoSinks adds nothing. The sinks are weights, written by no kernel: __ldg is
// safe before the wait for the previous kernel.
#pragma once
#include "common.cuh"

struct NoSinks {
    __device__ __forceinline__ float operator()(int, float) const { return 0.0f; }
};

struct AttentionSinks {
    const weight_t* logit;   // [H]
    __device__ __forceinline__ float operator()(int head, float m) const { return __expf(w2f(__ldg(logit + head)) - m); }
};

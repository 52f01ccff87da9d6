// Programmatic dependent launch (griddepcontrol, sm_90 on; empty before). Both instructions are
// no-ops in a kernel whose launch did not ask for programmatic serialization. common.cuh says how
// the kernels use them (grid_wait_then_release, grid_release).
#pragma once
#include "arch.cuh"

// Wait until the previous grid has finished and its writes are visible.
__device__ __forceinline__ void griddep_wait() {
#if FUSELM_SM90
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next grid be scheduled now; its blocks then run as soon as SM slots are free.
__device__ __forceinline__ void griddep_launch_dependents() {
#if FUSELM_SM90
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

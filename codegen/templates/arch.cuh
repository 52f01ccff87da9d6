// Which PTX the target has. The wrapper headers (bf16, mma, cp_async, pdl) emit an instruction
// only where it exists and are empty before; callers that need one say so with a static_assert.
// NVRTC compiles device code alone, so __CUDA_ARCH__ is defined wherever code is generated.
#pragma once

// sm_80 on: mma.sync on bf16, cvt to bf16x2, cp.async.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FUSELM_SM80 0
#else
#define FUSELM_SM80 1
#endif

// sm_89 on: cvt from e4m3 pairs.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FUSELM_SM89 1
#else
#define FUSELM_SM89 0
#endif

// sm_90 on: griddepcontrol (programmatic dependent launch).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSELM_SM90 1
#else
#define FUSELM_SM90 0
#endif

// sm_90a (Hopper's arch-specific features): wgmma, the warpgroup tensor-core instructions.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSELM_SM90A 1
#else
#define FUSELM_SM90A 0
#endif

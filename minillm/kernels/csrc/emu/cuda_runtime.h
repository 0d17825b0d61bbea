// The CPU emulator's stand-in for <cuda_runtime.h>: just enough of CUDA's language and runtime for the chapter 12
// kernels to compile with a host C++ compiler and run on the CPU (minillm.kernels.emulator builds them with it).
// The CUDA keywords become plain C++ (__shared__ arrays become statics shared by a block's threads), the few
// runtime calls the launchers make are answered here, and the thread model (threadIdx, __syncthreads,
// __shfl_xor_sync, launches) comes from emu.h.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one copy for the block's threads; blocks run one after another
#define __align__(n) alignas(n)

enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorLaunchFailure = 4,
    cudaErrorInvalidConfiguration = 9,
};
typedef struct CUstream_st* cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

#include "emu.h"

inline cudaError_t cudaGetLastError() { return static_cast<cudaError_t>(::emu::take_error()); }
inline const char* cudaGetErrorString(cudaError_t err) { return ::emu::error_string(static_cast<int>(err)); }
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }  // no limit to raise

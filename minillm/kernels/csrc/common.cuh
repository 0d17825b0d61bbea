// Shared helpers of the chapter 12 kernels: dtype conversion, warp/block reductions, 16-byte packs.
// Plain CUDA, no torch headers, so every kernel file compiles with bare `nvcc -c` (the compile test does that).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace minillm {

// Element dtypes as the launchers receive them (the bindings map torch dtypes onto these).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Every value is loaded into fp32, accumulated in fp32 and rounded once when stored.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// 16 bytes of T: one vectorized load or store (4 floats, 8 halves or bfloat16s).
template <typename T> struct alignas(16) Pack {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

__host__ __device__ inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;  // every lane holds the sum
}

__device__ __forceinline__ float warp_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;  // every lane holds the max
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` is 32 floats of shared memory. subtle: the trailing __syncthreads lets the caller reuse scratch at once.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    x = warp_sum(x);
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < num_warps; ++w) total += scratch[w];  // same order in every thread: identical results
    __syncthreads();
    return total;
}

__device__ __forceinline__ float block_max(float x, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    x = warp_max(x);
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float m = -INFINITY;
    for (int w = 0; w < num_warps; ++w) m = fmaxf(m, scratch[w]);
    __syncthreads();
    return m;
}

inline int ceil_div(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace minillm

// Instantiate a launcher body for the dtype code `dtype`; anything else returns cudaErrorInvalidValue.
#define MINILLM_DISPATCH(dtype, ...)                                   \
    switch (dtype) {                                                   \
        case ::minillm::kFloat32: { using T = float; __VA_ARGS__; break; }          \
        case ::minillm::kFloat16: { using T = __half; __VA_ARGS__; break; }         \
        case ::minillm::kBFloat16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
        default: return cudaErrorInvalidValue;                         \
    }

// Fused bias + GELU, out = gelu_tanh(x + bias), the tanh approximation GPT-2 uses ("gelu_new", as
// minillm.core.model's MLP: F.gelu(..., approximate="tanh")); fp32 math, two versions:
//   v1  one thread per element.
//   v2  one thread per 16-byte pack (4 floats or 8 halves): fewer, wider memory transactions; the tail that does
//       not fill a pack (and misaligned pointers) goes element by element.
// gelu_tanh(u) = 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))   (Hendrycks & Gimpel 2016, section 2)
// Reference twins: minillm.kernels.naive.bias_gelu, minillm.kernels.mirror.bias_gelu.
#include "common.cuh"
#include "kernels.h"

namespace minillm {

__device__ __forceinline__ float gelu_tanh(float u) {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * u * (1.f + tanhf(k * (u + 0.044715f * u * u * u)));
}

template <typename T>
__global__ void bias_gelu_v1_kernel(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ out,
                                    int64_t n, int64_t cols) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = from_float<T>(gelu_tanh(to_float(x[i]) + to_float(b[i % cols])));
}

// Thread i handles elements [i * P, i * P + P) when they all exist; n_packs = n / P full packs.
template <typename T>
__global__ void bias_gelu_v2_kernel(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ out,
                                    int64_t n_packs, int64_t cols) {
    constexpr int P = Pack<T>::N;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n_packs) return;
    const Pack<T> p = reinterpret_cast<const Pack<T>*>(x)[i];
    Pack<T> q;
#pragma unroll
    for (int j = 0; j < P; ++j) q.v[j] = from_float<T>(gelu_tanh(to_float(p.v[j]) + to_float(b[(i * P + j) % cols])));
    reinterpret_cast<Pack<T>*>(out)[i] = q;
}

// The elements from `start` on, one thread each (v2's tail, fewer than one pack).
template <typename T>
__global__ void bias_gelu_tail_kernel(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ out,
                                      int64_t start, int64_t n, int64_t cols) {
    const int64_t i = start + threadIdx.x;
    if (i >= n) return;
    out[i] = from_float<T>(gelu_tanh(to_float(x[i]) + to_float(b[i % cols])));
}

cudaError_t bias_gelu_forward(int version, int dtype, const void* x, const void* bias, void* out, int64_t rows,
                              int64_t cols, cudaStream_t stream) {
    const int64_t n = rows * cols;
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    MINILLM_DISPATCH(dtype, {
        const T* xt = static_cast<const T*>(x);
        const T* bt = static_cast<const T*>(bias);
        T* yt = static_cast<T*>(out);
        constexpr int P = Pack<T>::N;
        if (version != 1 && version != 2) return cudaErrorInvalidValue;
        if (version == 1 || !(is_aligned16(x) && is_aligned16(out))) {
            bias_gelu_v1_kernel<T><<<ceil_div(n, 256), 256, 0, stream>>>(xt, bt, yt, n, cols);
        } else {
            const int64_t n_packs = n / P;
            if (n_packs > 0) bias_gelu_v2_kernel<T><<<ceil_div(n_packs, 256), 256, 0, stream>>>(xt, bt, yt, n_packs, cols);
            const cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) return err;
            if (n_packs * P < n) bias_gelu_tail_kernel<T><<<1, P, 0, stream>>>(xt, bt, yt, n_packs * P, n, cols);
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

// Weight-only int8 GEMV (chapter 09's weight-only quantization, decode-sized batches):
// out (M, N) = x (M, K) @ (w (N, K) int8 * scale (N,) per output row)^T + bias (N,), fp32 accumulation; the
// scale is applied once per dot product, after the sum: sum_k x_k (w_k s) = s sum_k x_k w_k. Two versions:
//   v1  one thread per output element (m, n), looping over K: neighbouring threads read rows of w K bytes apart,
//       so their loads never coalesce.
//   v2  one warp per output row n: the 32 lanes read 32 consecutive int8 weights (coalesced), reduce their
//       partial sums with shuffles; the warp reuses its row of w (from L1) for every one of the M inputs.
// Reference twins: minillm.kernels.naive.int8_gemv, minillm.kernels.mirror.int8_gemv (v2's lane partial sums).
#include "common.cuh"
#include "kernels.h"

namespace minillm {

template <typename T>
__global__ void int8_gemv_v1_kernel(const T* __restrict__ x, const int8_t* __restrict__ w, const T* __restrict__ scale,
                                    const T* __restrict__ bias, T* __restrict__ out, int64_t M, int64_t N, int64_t K) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= M * N) return;
    const int64_t m = idx / N, n = idx % N;
    const T* xr = x + m * K;
    const int8_t* wr = w + n * K;
    float acc = 0.f;
    for (int64_t kk = 0; kk < K; ++kk) acc += to_float(xr[kk]) * static_cast<float>(wr[kk]);
    float y = acc * to_float(scale[n]);
    if (bias != nullptr) y += to_float(bias[n]);
    out[idx] = from_float<T>(y);
}

// blockDim.x == 128: warp k of block b owns output column n = 4 * b + k.
template <typename T>
__global__ void int8_gemv_v2_kernel(const T* __restrict__ x, const int8_t* __restrict__ w, const T* __restrict__ scale,
                                    const T* __restrict__ bias, T* __restrict__ out, int64_t M, int64_t N, int64_t K) {
    const int lane = threadIdx.x % 32;
    const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) return;  // the whole warp leaves together: the shuffles stay full-warp
    const int8_t* wr = w + n * K;
    const float s = to_float(scale[n]);
    const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
    for (int64_t m = 0; m < M; ++m) {
        const T* xr = x + m * K;
        float acc = 0.f;
        for (int64_t kk = lane; kk < K; kk += 32) acc += to_float(xr[kk]) * static_cast<float>(wr[kk]);
        acc = warp_sum(acc);
        if (lane == 0) out[m * N + n] = from_float<T>(acc * s + b);
    }
}

cudaError_t int8_gemv_forward(int version, int dtype, const void* x, const int8_t* w, const void* scale,
                              const void* bias, void* out, int64_t M, int64_t N, int64_t K, cudaStream_t stream) {
    if (M <= 0 || N <= 0) return cudaSuccess;  // K == 0 is fine: every output is the bias
    MINILLM_DISPATCH(dtype, {
        const T* xt = static_cast<const T*>(x);
        const T* st = static_cast<const T*>(scale);
        const T* bt = static_cast<const T*>(bias);
        T* yt = static_cast<T*>(out);
        if (version == 1) {
            int8_gemv_v1_kernel<T><<<ceil_div(M * N, 128), 128, 0, stream>>>(xt, w, st, bt, yt, M, N, K);
        } else if (version == 2) {
            int8_gemv_v2_kernel<T><<<ceil_div(N, 4), 128, 0, stream>>>(xt, w, st, bt, yt, M, N, K);
        } else {
            return cudaErrorInvalidValue;
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

// Weight-only int8 GEMV (chapter 09's weight-only quantization, decode-sized batches):
// out (M, N) = x (M, K) @ (w (N, K) int8 * scale (N,) per output row)^T + bias (N,), fp32 accumulation; the
// scale is applied once per dot product, after the sum: sum_k x_k (w_k s) = s sum_k x_k w_k. Two versions:
//   v1  one thread per output element (m, n), looping over K: neighbouring threads read rows of w K bytes apart,
//       so their loads never coalesce.
//   v2  one warp per output row n: the 32 lanes read 32 consecutive int8 weights (coalesced), reduce their
//       partial sums with shuffles; the warp reuses its row of w (from L1) for every one of the M inputs.
//   v3  v2 with 16-byte loads: each lane reads 16 int8 weights at once (a warp, 512 consecutive bytes per load
//       instead of 32) and multiplies them into running sums for up to 8 inputs at a time, so the weight row is
//       read from memory once for all of them. Rows whose length is not a whole number of 16-byte packs (or
//       misaligned pointers) take the same loop one weight per lane at a time.
// Reference twins: minillm.kernels.naive.int8_gemv, minillm.kernels.mirror.int8_gemv (the lane partial sums of v2,
// and of v3 with pack=16).
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

// v3: blockDim.x == 128, warp k of block b owns output column n = 4 * b + k (as v2). VEC: K % 16 == 0 and x, w
// 16-byte aligned, so every weight row and every input row starts on a 16-byte boundary.
template <typename T, bool VEC>
__global__ void int8_gemv_v3_kernel(const T* __restrict__ x, const int8_t* __restrict__ w, const T* __restrict__ scale,
                                    const T* __restrict__ bias, T* __restrict__ out, int64_t M, int64_t N, int64_t K) {
    constexpr int MT = 8;                 // inputs per pass over the weight row
    constexpr int P = Pack<T>::N;         // elements of x per 16-byte pack: 4 (fp32) or 8 (fp16, bf16)
    const int lane = threadIdx.x % 32;
    const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (n >= N) return;  // the whole warp leaves together: the shuffles stay full-warp
    const int8_t* wr = w + n * K;
    const float s = to_float(scale[n]);
    const float b = bias != nullptr ? to_float(bias[n]) : 0.f;
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int mt = M - m0 < MT ? static_cast<int>(M - m0) : MT;  // the same in every lane of the warp
        float acc[MT];
#pragma unroll
        for (int mm = 0; mm < MT; ++mm) acc[mm] = 0.f;
        if (VEC) {
            const int4* wp = reinterpret_cast<const int4*>(wr);
#pragma unroll 2
            for (int64_t i = lane; i < K / 16; i += 32) {  // weights 16 i .. 16 i + 15
                const int4 packed = wp[i];
                const int8_t* w8 = reinterpret_cast<const int8_t*>(&packed);
                float wf[16];
#pragma unroll
                for (int e = 0; e < 16; ++e) wf[e] = static_cast<float>(w8[e]);
#pragma unroll
                for (int mm = 0; mm < MT; ++mm) {
                    if (mm >= mt) break;
                    const Pack<T>* xp = reinterpret_cast<const Pack<T>*>(x + (m0 + mm) * K + 16 * i);
#pragma unroll
                    for (int p = 0; p < 16 / P; ++p) {
                        const Pack<T> xv = xp[p];
#pragma unroll
                        for (int e = 0; e < P; ++e) acc[mm] = fmaf(to_float(xv.v[e]), wf[p * P + e], acc[mm]);
                    }
                }
            }
        } else {
            for (int64_t kk = lane; kk < K; kk += 32) {
                const float wf = static_cast<float>(wr[kk]);
#pragma unroll
                for (int mm = 0; mm < MT; ++mm) {
                    if (mm >= mt) break;
                    acc[mm] = fmaf(to_float(x[(m0 + mm) * K + kk]), wf, acc[mm]);
                }
            }
        }
#pragma unroll
        for (int mm = 0; mm < MT; ++mm) {
            if (mm >= mt) break;
            const float total = warp_sum(acc[mm]);
            if (lane == 0) out[(m0 + mm) * N + n] = from_float<T>(total * s + b);
        }
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
        } else if (version == 3) {
            if (K % 16 == 0 && is_aligned16(x) && is_aligned16(w))
                int8_gemv_v3_kernel<T, true><<<ceil_div(N, 4), 128, 0, stream>>>(xt, w, st, bt, yt, M, N, K);
            else
                int8_gemv_v3_kernel<T, false><<<ceil_div(N, 4), 128, 0, stream>>>(xt, w, st, bt, yt, M, N, K);
        } else {
            return cudaErrorInvalidValue;
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

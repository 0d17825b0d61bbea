// LayerNorm over the last dimension, out = (x - mean) * rsqrt(var + eps) * weight + bias (biased variance, as
// torch.nn.functional.layer_norm), statistics in fp32, three versions:
//   v1  one thread per row: one pass for mean, one for variance, one to write.
//   v2  one block per row: each thread sums its elements, the block combines the sums by a shared-memory tree
//       reduction (the mean); then the same again for the squared deviations (x - mean)^2 (the variance).
//   v3  one warp per row (4 rows per block): the same two sums, combined by warp shuffles alone, no shared memory
//       and no __syncthreads.
//   v4  v3 reading and writing 16-byte packs (x, weight, bias and out): lane l owns packs l, l + 32, ..., so a
//       warp moves 512 bytes per load instead of 64 (bf16); rows that are not a whole number of packs (or
//       misaligned pointers) run v3.
// subtle: the variance is a second pass over x - mean, not E[x^2] - mean^2 from one pass of sums of x and x^2:
// that difference cancels in fp32 when |mean| >> std (a row of mean 3000 and std 1 comes out off by 1.45, and by
// ~2000 in v4's order of sums). The second read of the row mostly hits the cache; the tests use rows of mean 3000.
// Reference twins: minillm.kernels.naive.layernorm, minillm.kernels.mirror.layernorm_warp (v3's lane sums;
// v4's with pack=8 or 4).
#include "common.cuh"
#include "kernels.h"

namespace minillm {

template <typename T>
__global__ void layernorm_v1_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                    T* __restrict__ out, int64_t rows, int64_t cols, float eps) {
    const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const T* xr = x + r * cols;
    T* yr = out + r * cols;
    float sum = 0.f;
    for (int64_t c = 0; c < cols; ++c) sum += to_float(xr[c]);
    const float mean = sum / cols;
    float sq = 0.f;
    for (int64_t c = 0; c < cols; ++c) {
        const float d = to_float(xr[c]) - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(sq / cols + eps);
    for (int64_t c = 0; c < cols; ++c)
        yr[c] = from_float<T>((to_float(xr[c]) - mean) * rstd * to_float(w[c]) + to_float(b[c]));
}

// v2's shared-memory tree reduction: s (blockDim.x floats, a power of two) holds each thread's value, half the
// threads add the other half's, and so on; every thread gets the total.
__device__ __forceinline__ float tree_sum(float v, float* s) {
    const int tid = threadIdx.x;
    s[tid] = v;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) s[tid] += s[tid + stride];
        __syncthreads();
    }
    const float total = s[0];
    __syncthreads();  // every thread has read s[0] before the next tree_sum overwrites s
    return total;
}

// v2: blockDim.x == 256 (a power of two, as the tree reduction needs).
template <typename T>
__global__ void layernorm_v2_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                    T* __restrict__ out, int64_t rows, int64_t cols, float eps) {
    __shared__ float s[256];
    const int64_t r = blockIdx.x;
    const int tid = threadIdx.x;
    const T* xr = x + r * cols;
    T* yr = out + r * cols;
    float sum = 0.f;
    for (int64_t c = tid; c < cols; c += blockDim.x) sum += to_float(xr[c]);
    const float mean = tree_sum(sum, s) / cols;
    float sq = 0.f;
    for (int64_t c = tid; c < cols; c += blockDim.x) {  // the second pass: squared deviations from the mean
        const float d = to_float(xr[c]) - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(tree_sum(sq, s) / cols + eps);
    for (int64_t c = tid; c < cols; c += blockDim.x)
        yr[c] = from_float<T>((to_float(xr[c]) - mean) * rstd * to_float(w[c]) + to_float(b[c]));
}

// v3: blockDim.x == 128, warp k of block i handles row 4 * i + k.
template <typename T>
__global__ void layernorm_v3_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                    T* __restrict__ out, int64_t rows, int64_t cols, float eps) {
    const int lane = threadIdx.x % 32;
    const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;  // a whole warp leaves together, so the shuffles below stay full-warp
    const T* xr = x + r * cols;
    T* yr = out + r * cols;
    float sum = 0.f;
    for (int64_t c = lane; c < cols; c += 32) sum += to_float(xr[c]);
    const float mean = warp_sum(sum) / cols;
    float sq = 0.f;
    for (int64_t c = lane; c < cols; c += 32) {  // the second pass: squared deviations from the mean
        const float d = to_float(xr[c]) - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(warp_sum(sq) / cols + eps);
    for (int64_t c = lane; c < cols; c += 32)
        yr[c] = from_float<T>((to_float(xr[c]) - mean) * rstd * to_float(w[c]) + to_float(b[c]));
}

// v4: blockDim.x == 128, warp k of block i handles row 4 * i + k (as v3). The launcher picks it only when cols is a
// whole number of packs and all four pointers are 16-byte aligned, so every row starts on a pack boundary; other
// inputs run v3.
template <typename T>
__global__ void layernorm_v4_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                    T* __restrict__ out, int64_t rows, int64_t cols, float eps) {
    constexpr int P = Pack<T>::N;
    const int lane = threadIdx.x % 32;
    const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;  // a whole warp leaves together, so the shuffles below stay full-warp
    const Pack<T>* xp = reinterpret_cast<const Pack<T>*>(x + r * cols);
    float sum = 0.f;
    for (int64_t i = lane; i < cols / P; i += 32) {
        const Pack<T> p = xp[i];
#pragma unroll
        for (int e = 0; e < P; ++e) sum += to_float(p.v[e]);
    }
    const float mean = warp_sum(sum) / cols;
    float sq = 0.f;
    for (int64_t i = lane; i < cols / P; i += 32) {  // the second pass: squared deviations from the mean
        const Pack<T> p = xp[i];
#pragma unroll
        for (int e = 0; e < P; ++e) {
            const float d = to_float(p.v[e]) - mean;
            sq += d * d;
        }
    }
    const float rstd = rsqrtf(warp_sum(sq) / cols + eps);
    const Pack<T>* wp = reinterpret_cast<const Pack<T>*>(w);
    const Pack<T>* bp = reinterpret_cast<const Pack<T>*>(b);
    Pack<T>* yp = reinterpret_cast<Pack<T>*>(out + r * cols);
    for (int64_t i = lane; i < cols / P; i += 32) {  // the third read of the row: mostly from cache
        const Pack<T> p = xp[i], pw = wp[i], pb = bp[i];
        Pack<T> y;
#pragma unroll
        for (int e = 0; e < P; ++e)
            y.v[e] = from_float<T>((to_float(p.v[e]) - mean) * rstd * to_float(pw.v[e]) + to_float(pb.v[e]));
        yp[i] = y;
    }
}

cudaError_t layernorm_forward(int version, int dtype, const void* x, const void* weight, const void* bias, void* out,
                              int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    if (rows > 2147483647LL) return cudaErrorInvalidValue;
    MINILLM_DISPATCH(dtype, {
        const T* xt = static_cast<const T*>(x);
        const T* wt = static_cast<const T*>(weight);
        const T* bt = static_cast<const T*>(bias);
        T* yt = static_cast<T*>(out);
        switch (version) {
            case 1: layernorm_v1_kernel<T><<<ceil_div(rows, 128), 128, 0, stream>>>(xt, wt, bt, yt, rows, cols, eps); break;
            case 2: layernorm_v2_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(xt, wt, bt, yt, rows, cols, eps); break;
            case 3: layernorm_v3_kernel<T><<<ceil_div(rows, 4), 128, 0, stream>>>(xt, wt, bt, yt, rows, cols, eps); break;
            case 4:
                if (cols % Pack<T>::N == 0 && is_aligned16(x) && is_aligned16(weight) && is_aligned16(bias) &&
                    is_aligned16(out))
                    layernorm_v4_kernel<T><<<ceil_div(rows, 4), 128, 0, stream>>>(xt, wt, bt, yt, rows, cols, eps);
                else  // rows that are not whole packs: v3, element by element
                    layernorm_v3_kernel<T><<<ceil_div(rows, 4), 128, 0, stream>>>(xt, wt, bt, yt, rows, cols, eps);
                break;
            default: return cudaErrorInvalidValue;
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

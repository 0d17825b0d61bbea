// Row softmax, out[r, c] = exp(x[r, c] - max_r) / sum_c' exp(x[r, c'] - max_r), fp32 accumulation, four versions:
//   v1  one thread per row: three passes over the row (max, sum, write); no cooperation at all.
//   v2  one block per row: threads stride the row, partial max and sum combine by a shared-memory tree reduction.
//   v3  v2 with warp-shuffle reductions: lanes combine in registers, shared memory only across the block's warps.
//   v4  v3 reading 16-byte packs, and one pass for max and sum (online softmax, Milakov & Gimelshein 2018):
//       each thread keeps a running (max m, sum s) and rescales s by exp(m_old - m_new) when m grows.
// Reference twins: minillm.kernels.naive.softmax (plain torch), minillm.kernels.mirror.softmax_online (v4's math).
#include "common.cuh"
#include "kernels.h"

namespace minillm {

template <typename T>
__global__ void softmax_v1_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t cols) {
    const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const T* xr = x + r * cols;
    T* yr = out + r * cols;
    float m = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) m = fmaxf(m, to_float(xr[c]));
    float s = 0.f;
    for (int64_t c = 0; c < cols; ++c) s += expf(to_float(xr[c]) - m);
    for (int64_t c = 0; c < cols; ++c) yr[c] = from_float<T>(expf(to_float(xr[c]) - m) / s);
}

// v2: block r computes row r (the grid has one block per row); blockDim.x == 256, a power of two, as the tree
// reduction needs. Thread t takes columns t, t + 256, ...; the block's maximum, then its sum of exp(x - max), is
// combined from the threads' partial results by a tree reduction in shared memory (stride 128, 64, .., 1), with a
// __syncthreads() wherever a thread reads what another one wrote. This kernel is the chapter's CUDA exercise.
template <typename T>
__global__ void softmax_v2_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t cols) {
    // BEGIN SOLUTION
    __shared__ float buf[256];
    const int64_t r = blockIdx.x;
    const int tid = threadIdx.x;
    const T* xr = x + r * cols;
    T* yr = out + r * cols;
    float m = -INFINITY;
    for (int64_t c = tid; c < cols; c += blockDim.x) m = fmaxf(m, to_float(xr[c]));
    buf[tid] = m;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) buf[tid] = fmaxf(buf[tid], buf[tid + stride]);
        __syncthreads();
    }
    m = buf[0];
    __syncthreads();  // everyone has read buf[0] before it is overwritten below
    float s = 0.f;
    for (int64_t c = tid; c < cols; c += blockDim.x) s += expf(to_float(xr[c]) - m);
    buf[tid] = s;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) buf[tid] += buf[tid + stride];
        __syncthreads();
    }
    s = buf[0];
    for (int64_t c = tid; c < cols; c += blockDim.x) yr[c] = from_float<T>(expf(to_float(xr[c]) - m) / s);
    // END SOLUTION
}

template <typename T>
__global__ void softmax_v3_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t cols) {
    __shared__ float scratch[32];
    const int64_t r = blockIdx.x;
    const T* xr = x + r * cols;
    T* yr = out + r * cols;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, to_float(xr[c]));
    m = block_max(m, scratch);
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(to_float(xr[c]) - m);
    s = block_sum(s, scratch);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = from_float<T>(expf(to_float(xr[c]) - m) / s);
}

// One step of the online softmax: fold value v into the running (m, s).
__device__ __forceinline__ void online_update(float& m, float& s, float v) {
    if (v > m) {
        s = s * expf(m - v) + 1.f;  // subtle: m = -inf at the start gives expf(-inf) = 0, so s becomes 1
        m = v;
    } else if (v != -INFINITY) {  // subtle: with m = -inf too, expf(v - m) would be expf(nan)
        s += expf(v - m);
    }
}

// Merge two running (max, sum) pairs; an empty pair is (-inf, 0).
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;  // both empty (or the row is all -inf): keep (-inf, 0)
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

// v4: VEC = true reads Pack<T> (16 bytes) at a time; the launcher picks it only when cols is a whole number of
// packs and both pointers are 16-byte aligned (then every row starts aligned too).
template <typename T, bool VEC>
__global__ void softmax_v4_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t cols) {
    __shared__ float sm[32], ss[32];
    constexpr int P = Pack<T>::N;
    const int64_t r = blockIdx.x;
    const T* xr = x + r * cols;
    T* yr = out + r * cols;
    float m = -INFINITY, s = 0.f;
    if (VEC) {
        const Pack<T>* xp = reinterpret_cast<const Pack<T>*>(xr);
        for (int64_t i = threadIdx.x; i < cols / P; i += blockDim.x) {
            const Pack<T> p = xp[i];
#pragma unroll
            for (int j = 0; j < P; ++j) online_update(m, s, to_float(p.v[j]));
        }
    } else {
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) online_update(m, s, to_float(xr[c]));
    }
    // Warp: merge (m, s) pairs across lanes by shuffles; then the warps' pairs through shared memory.
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        online_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    m = -INFINITY;
    s = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) online_merge(m, s, sm[w], ss[w]);
    const float inv = 1.f / s;
    if (VEC) {
        const Pack<T>* xp = reinterpret_cast<const Pack<T>*>(xr);
        Pack<T>* yp = reinterpret_cast<Pack<T>*>(yr);
        for (int64_t i = threadIdx.x; i < cols / P; i += blockDim.x) {
            const Pack<T> p = xp[i];
            Pack<T> q;
#pragma unroll
            for (int j = 0; j < P; ++j) q.v[j] = from_float<T>(expf(to_float(p.v[j]) - m) * inv);
            yp[i] = q;
        }
    } else {
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = from_float<T>(expf(to_float(xr[c]) - m) * inv);
    }
}

cudaError_t softmax_forward(int version, int dtype, const void* x, void* out, int64_t rows, int64_t cols,
                            cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return cudaSuccess;
    if (rows > 2147483647LL) return cudaErrorInvalidValue;  // one block per row: gridDim.x limit
    MINILLM_DISPATCH(dtype, {
        const T* xt = static_cast<const T*>(x);
        T* yt = static_cast<T*>(out);
        switch (version) {
            case 1: softmax_v1_kernel<T><<<ceil_div(rows, 128), 128, 0, stream>>>(xt, yt, rows, cols); break;
            case 2: softmax_v2_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(xt, yt, rows, cols); break;
            case 3: softmax_v3_kernel<T><<<static_cast<unsigned>(rows), 256, 0, stream>>>(xt, yt, rows, cols); break;
            case 4:
                if (cols % Pack<T>::N == 0 && is_aligned16(x) && is_aligned16(out))
                    softmax_v4_kernel<T, true><<<static_cast<unsigned>(rows), 256, 0, stream>>>(xt, yt, rows, cols);
                else
                    softmax_v4_kernel<T, false><<<static_cast<unsigned>(rows), 256, 0, stream>>>(xt, yt, rows, cols);
                break;
            default: return cudaErrorInvalidValue;
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

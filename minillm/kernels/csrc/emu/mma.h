// The CPU emulator's stand-in for <mma.h>: the warp matrix functions (nvcuda::wmma) for 16 x 16 x 16 tiles of fp16
// or bf16 with fp32 accumulators, the part of the API the kernels use.
// On a GPU a fragment is spread over the warp's 32 lanes in an unspecified layout; here every lane holds the whole
// tile, and load, store and mma work on it alone, which gives the same results for code that touches fragments only
// through these functions (and element-wise operations applied to every element alike). Loads and stores are
// collective, as on the GPU: the warp waits at a barrier before and after each, so no lane reads a tile while
// another is still writing it. They also check what the hardware requires: a 256-bit aligned pointer and a leading
// dimension that is a multiple of 16 bytes.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K>
struct tile_shape {  // rows x cols of the operand: A is M x K, B is K x N, the accumulator M x N
    static constexpr int rows = std::is_same<Use, matrix_b>::value ? K : M;
    static constexpr int cols = std::is_same<Use, matrix_a>::value ? K : N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static constexpr int rows = tile_shape<Use, M, N, K>::rows, cols = tile_shape<Use, M, N, K>::cols;
    static constexpr int num_elements = rows * cols;
    T x[num_elements];  // row-major, whatever the memory layout it was loaded from
};

inline float elem_to_float(float v) { return v; }
inline float elem_to_float(__half v) { return __half2float(v); }
inline float elem_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
inline void check_operand(const T* p, unsigned ldm, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0 || (ldm * sizeof(T)) % 16 != 0) {
        std::fprintf(stderr, "wmma::%s: pointer %p must be 256-bit aligned and ldm %u a multiple of 16 bytes\n", what,
                     static_cast<const void*>(p), ldm);
        std::abort();
    }
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& v) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = static_cast<T>(v);
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
    check_operand(p, ldm, "load_matrix_sync");
    constexpr bool row = std::is_same<Layout, row_major>::value;
    __syncwarp();
    for (int r = 0; r < f.rows; ++r)
        for (int c = 0; c < f.cols; ++c) f.x[r * f.cols + c] = row ? p[r * ldm + c] : p[c * ldm + r];
    __syncwarp();
}

template <int M, int N, int K, typename T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm, layout_t layout) {
    check_operand(p, ldm, "load_matrix_sync");
    __syncwarp();
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
    __syncwarp();
}

template <int M, int N, int K, typename T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
    check_operand(p, ldm, "store_matrix_sync");
    __syncwarp();
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * N + c];
    __syncwarp();
}

// d = a b + c, products of the 16-bit inputs exact in fp32, accumulated in fp32.
template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
    float out[M * N];
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            float acc = c.x[m * N + n];
            for (int k = 0; k < K; ++k) acc += elem_to_float(a.x[m * K + k]) * elem_to_float(b.x[k * N + n]);
            out[m * N + n] = acc;
        }
    for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda

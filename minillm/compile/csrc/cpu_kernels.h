// What the two C++ files of chapter 13's CPU extension share: the GEMV of gemv_cpu.cpp, called by the whole decode
// step of decode_cpu.cpp, and the hook that registers the decoder class in the one Python module they build.
#pragma once

#include <cstdint>

// subtle: three of torch's headers, not <torch/extension.h>. That one brings all of libtorch's C++ API (autograd,
// nn, optim, serialization) and took 24 s to parse per file on a 2-core machine; these take 10 s, which is most of
// the extension's first build. What the files use: at::Tensor, at::empty, TORCH_CHECK and pybind11 with torch's
// Tensor conversions.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace minillm {

// y (M, N) = x (M, K) W (N, K)^T + b (N); b may be null. One pass over W whatever M (gemv_cpu.cpp).
void small_gemm(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N);

// The same for int8 weights with one scale per row (chapter 09's weight-only int8): y[m, n] = scale[n] *
// sum_k q[n, k] x[m, k] + b[n]; b may be null. The codes are read as bytes and widened to float in registers.
void small_gemm_q8(const float* x, const int8_t* q, const float* scale, const float* b, float* y, int64_t M, int64_t K,
                   int64_t N);

// The same for chapter 09's int4 group-wise weights (symmetric): p (N, K/2) holds two 4-bit two's complement codes
// per byte (code 2i in the low nibble of byte i, as pack_int4), scale (N, K/G) one float per row and group of G
// columns: y[m, n] = sum_g scale[n, g] * sum_{k in group g} q[n, k] x[m, k] + b[n]. G must be even and divide K.
void small_gemm_q4(const float* x, const uint8_t* p, const float* scale, const float* b, float* y, int64_t M,
                   int64_t K, int64_t N, int64_t G);

// subtle: every loop here reads a tensor through its raw pointer. A negative view (`torch._neg_view(x)`, values -x)
// keeps its sign in a bit, not in memory, and a sparse tensor has no strided memory to read: the loops would compute
// with +x, or with garbage. The Python wrappers resolve the bit first (`cpu_gemv.as_cpp_reads`) and refuse sparse
// tensors; a direct caller gets this ValueError naming the tensor (`who`: the entry point, `name`: the argument).
inline void check_plain_memory(const at::Tensor& t, const char* who, const char* name) {
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, who, ": ", name, " must be a strided (dense) tensor, got layout ",
                      t.layout());
    TORCH_CHECK_VALUE(!t.is_neg() && !t.is_conj(), who, ": ", name, " is a negative (or conjugate) view: its sign is a "
                      "bit the raw pointer misses; call .resolve_neg() (.resolve_conj()) first");
}

// Whether this build took the AVX2 + FMA path (false: the scalar loops).
bool uses_avx2();

// Which loop small_gemm_q8 runs in this build: "AVX-512", "AVX2 + FMA" or "scalar".
const char* int8_path();

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {  // the 8 lanes' sum (inline: called once per dot product, thousands of times a step)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// Which loop small_gemm_q4 runs in this build for group size G: int8_path's, or "scalar" when the vector loops do
// not take G (it must be a multiple of their run of codes, 32 with AVX-512, 16 with AVX2).
const char* int4_path(int64_t group_size);

// Adds the FusedDecoder class and paged_decode_attention (decode_cpu.cpp) to the extension module.
void register_decoder(pybind11::module& m);

}  // namespace minillm

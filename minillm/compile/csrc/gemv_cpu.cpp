// A decode-sized linear layer for the CPU, y = x W^T + b, written for what decode does: a few rows of x (one per
// sequence in the batch) against a weight matrix that is read once from memory per call. One version, AVX2 + FMA
// when the compiler may use them:
//   four weight rows at a time, each dotted with every row of x before the next four are loaded (one pass over W
//   whatever the batch); each dot product keeps an 8-wide accumulator: every step loads 8 floats of x and 8 of
//   each of the 4 weight rows (4 memory streams in flight) and fuses the multiply and the add; a scalar loop
//   finishes the K % 8 tail and the N % 4 last rows; the bias is added to the finished sums.
// Why it exists: at batch 1, torch.nn.functional.linear goes through a general GEMM path whose fixed cost per
// call is as large as the streaming itself for these small matrices (chapter 13 measures both in one run).
// Reference twin: torch.nn.functional.linear (the tests compare every shape, with and without bias).
#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINILLM_AVX2 1
#endif

namespace minillm {

// Rows of x (M, K) against W (N, K) into y (M, N); b may be null. The weight is walked once: for each block of 4
// weight rows (4 K floats, at most 16 KB for K = 1024: they stay in L1), every row of x is multiplied by it before the
// next block is loaded, so M rows cost one pass over the weights, not M.
void small_gemm(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N) {
    int64_t n = 0;
#ifdef MINILLM_AVX2
    const int64_t K8 = K - K % 8;
    for (; n + 4 <= N; n += 4) {
        const float* r0 = w + n * K;
        const float* r1 = r0 + K;
        const float* r2 = r1 + K;
        const float* r3 = r2 + K;
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
            __m256 a3 = _mm256_setzero_ps();
            for (int64_t k = 0; k < K8; k += 8) {
                const __m256 xv = _mm256_loadu_ps(xr + k);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + k), xv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + k), xv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + k), xv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + k), xv, a3);
            }
            float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            for (int64_t k = K8; k < K; ++k) {  // the tail that does not fill 8 lanes
                s[0] += r0[k] * xr[k];
                s[1] += r1[k] * xr[k];
                s[2] += r2[k] * xr[k];
                s[3] += r3[k] * xr[k];
            }
            float* yr = y + m * N;
            for (int i = 0; i < 4; ++i) yr[n + i] = s[i] + (b ? b[n + i] : 0.f);
        }
    }
#endif
    for (; n < N; ++n) {  // the last N % 4 weight rows (every row without AVX2)
        const float* r = w + n * K;
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * K;
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += r[k] * xr[k];
            y[m * N + n] = s + (b ? b[n] : 0.f);
        }
    }
}

bool uses_avx2() {
#ifdef MINILLM_AVX2
    return true;
#else
    return false;
#endif
}

}  // namespace minillm

namespace {

// x (M, K), w (N, K), bias (N) or empty -> (M, N); float32, contiguous, CPU (checked by the Python wrapper too).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && bias.device().is_cpu(), "gemv: CPU tensors only");
    // TORCH_CHECK_TYPE / _VALUE raise Python's TypeError / ValueError: `FastLinear` calls this without a Python
    // check in front (a per-token path), so the checks here are what a caller sees.
    TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                     "gemv: x and w must be float32, got x ", x.scalar_type(), " and w ", w.scalar_type());
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
                "gemv: x must be (M, K) and w (N, K) with the same K, got x ", x.sizes(), " and w ", w.sizes());
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv: x and w must be contiguous");
    const bool has_bias = bias.numel() > 0;
    TORCH_CHECK_TYPE(!has_bias || bias.scalar_type() == at::kFloat, "gemv: bias must be float32 (like w), got ",
                     bias.scalar_type());
    TORCH_CHECK_VALUE(!has_bias || (bias.dim() == 1 && bias.size(0) == w.size(0) && bias.is_contiguous()),
                      "gemv: bias must be a contiguous (N,) tensor or empty, got ", bias.sizes());
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    auto y = at::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    minillm::small_gemm(xp, wp, bp, yp, M, K, N);
    return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("gemv", &gemv, "y = x W^T + b for a few rows of x (float32, CPU)");
    m.def("uses_avx2", &minillm::uses_avx2, "whether this build took the AVX2 + FMA path");
    minillm::register_decoder(m);  // the whole decode step, decode_cpu.cpp
}

// A decode-sized linear layer for the CPU, y = x W^T + b, written for what decode does: a few rows of x (one per
// sequence in the batch) against a weight matrix that is read once from memory per call. One version, AVX2 + FMA
// when the compiler may use them:
//   four weight rows at a time, each dotted with every row of x before the next four are loaded (one pass over W
//   whatever the batch); each dot product keeps an 8-wide accumulator: every step loads 8 floats of x and 8 of
//   each of the 4 weight rows (4 memory streams in flight) and fuses the multiply and the add; a scalar loop
//   finishes the K % 8 tail and the N % 4 last rows; the bias is added to the finished sums.
//   Several rows of x (a verify, a short prompt) with AVX-512: small_gemm_rows, 16 lanes and two rows of x per pass
//   (one row waits on memory, so wider registers do not help it; each further row is arithmetic, which they halve).
// Why it exists: at batch 1, torch.nn.functional.linear goes through a general GEMM path whose fixed cost per
// call is as large as the streaming itself for these small matrices (chapter 13 measures both in one run).
// Reference twin: torch.nn.functional.linear (the tests compare every shape, with and without bias).
//
// The int8 version, small_gemm_q8, runs chapter 09's weight-only int8 layers: y[n] = scale[n] * sum_k q[n, k] x[k]
// + b[n], with q the layer's int8 codes (one byte per weight) and one float scale per output row. The scale factors
// out of the row's sum, so the loop never builds the float weight: it loads the codes as bytes, widens them to
// float in registers (sign-extend to int32, convert) and multiplies by x in float32, so it gives the eager
// QuantLinear's numbers to float rounding. Why: the weights are the bytes a decode step streams, and int8 codes are
// a quarter of float32's. The widening costs instructions the float loop does not have (the byte-to-int32 widening
// runs on one port: one instruction per 8 codes with AVX2, per 16 with AVX-512). Measured on the course's Xeon
// (AVX-512), one thread, `base`'s 24 block matrices in a loop: float32 625 us; int8 codes merely read 139 us, the
// AVX2 loop 220 us, the AVX-512 loop 189 us (an integer route, x rounded to int8 and VNNI dot products, 176 us: not
// worth other numbers than the eager model's). So the int8 loop wins where the weights stream from beyond L2, as a
// whole step's do; a single matrix called again and again from the cache runs faster in float32.
// Same blocking as above (4 rows, one pass over the codes whatever M):
//   AVX-512 (when the build may use it): 16 codes per step per row (_mm512_cvtepi8_epi32 + cvt + FMA);
//   AVX2 + FMA: 8 codes per step per row (_mm256_cvtepi8_epi32 on 8 bytes + cvt + FMA);
//   otherwise (and for the K tail and the N % 4 last rows): a scalar loop.
// Reference twin: chapter 09's QuantLinear (int8, symmetric per channel): F.linear(x, q.float()) * scale + b.
#include "cpu_kernels.h"

#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MINILLM_AVX2 1
#endif
#if defined(__AVX512F__) && defined(MINILLM_AVX2)
#define MINILLM_AVX512 1
#endif

namespace minillm {

#if defined(MINILLM_AVX512)
// The four sums of a[0..3]'s 16 lanes each, as one 4-float vector: halves added (16 -> 8 lanes), then two rounds
// of pairwise adds across the four (hadd), then the two 128-bit halves. 13 instructions, where four separate
// reductions take about 32: at K = 256 the reductions were a fifth of a multi-row product's instructions.
inline __m128 sum4(const __m512 a[4]) {
    __m256 h[4];
    for (int i = 0; i < 4; ++i) {  // AVX-512F has no 256-bit float extract: go through the double view
        h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    }
    // hadd(h0, h1) = [h0 01, h0 23, h1 01, h1 23 | h0 45, h0 67, h1 45, h1 67] (pairs summed within 128-bit lanes)
    const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));  // [s0 s1 s2 s3 | ...]
    return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

// R rows of x (at x, K floats apart) against 4 weight rows r: y[j * N + i] = x_j . r_i + b_i (b may be null).
// R = 4 keeps 16 accumulators in registers (of 32) and feeds 16 FMAs from 8 loads per 16 columns.
template <int R>
inline void dot4_rows(const float* x, const float* const r[4], const float* b, float* y, int64_t K, int64_t N) {
    const int64_t K16 = K - K % 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1);  // the last K % 16 columns' lanes
    __m512 a[R][4];
    for (int j = 0; j < R; ++j) {
        for (int i = 0; i < 4; ++i) a[j][i] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 lanes = k < K16 ? static_cast<__mmask16>(0xFFFF) : tail;
        __m512 xv[R];
        for (int j = 0; j < R; ++j) xv[j] = _mm512_maskz_loadu_ps(lanes, x + j * K + k);
        for (int i = 0; i < 4; ++i) {
            const __m512 wv = _mm512_maskz_loadu_ps(lanes, r[i] + k);  // each weight load feeds R FMAs
            for (int j = 0; j < R; ++j) a[j][i] = _mm512_fmadd_ps(wv, xv[j], a[j][i]);
        }
    }
    const __m128 bias = b ? _mm_loadu_ps(b) : _mm_setzero_ps();
    for (int j = 0; j < R; ++j) _mm_storeu_ps(y + j * N, _mm_add_ps(sum4(a[j]), bias));
}

// small_gemm for several rows of x (speculative decoding's verify, a short prompt): the same walk over the weights,
// 16 floats per fused multiply-add instead of 8, and two rows of x per pass over a block of 4 weight rows (each weight
// load feeds two FMAs). One row is bound by the bytes it streams, so wider registers do not help it; every further
// row adds only arithmetic, which these halve.
void small_gemm_rows(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) {
        const float* const r[4] = {w + n * K, w + (n + 1) * K, w + (n + 2) * K, w + (n + 3) * K};
        const float* bn = b ? b + n : nullptr;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) dot4_rows<4>(x + m * K, r, bn, y + m * N + n, K, N);
        for (; m + 2 <= M; m += 2) dot4_rows<2>(x + m * K, r, bn, y + m * N + n, K, N);
        if (m < M) dot4_rows<1>(x + m * K, r, bn, y + m * N + n, K, N);  // an odd M's last row
    }
    for (; n < N; ++n) {  // the last N % 4 weight rows
        for (int64_t m = 0; m < M; ++m) {
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += w[n * K + k] * x[m * K + k];
            y[m * N + n] = s + (b ? b[n] : 0.f);
        }
    }
}
#endif

// Rows of x (M, K) against W (N, K) into y (M, N); b may be null. The weight is walked once: for each block of 4
// weight rows (4 K floats, at most 16 KB for K = 1024: they stay in L1), every row of x is multiplied by it before the
// next block is loaded, so M rows cost one pass over the weights, not M.
void small_gemm(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N) {
#ifdef MINILLM_AVX512
    if (M > 1) return small_gemm_rows(x, w, b, y, M, K, N);  // several rows: 16-wide, two rows per pass
#endif
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

#if defined(MINILLM_AVX512)
constexpr int64_t kQ8Lanes = 16;  // codes per step of one row: a 16-byte load widened into one 512-bit register

// s[i] = sum over k < K (a multiple of 16) of r[i][k] * x[k], for 4 rows of codes r[0..3]
inline void dot4_q8(const float* x, const int8_t* const r[4], int64_t K, float s[4]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        // 16 bytes -> 16 int32 (sign-extended) -> 16 floats, each exact: codes are integers in [-127, 127]
        auto widen = [k](const int8_t* p) {
            return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k))));
        };
        a0 = _mm512_fmadd_ps(widen(r[0]), xv, a0);
        a1 = _mm512_fmadd_ps(widen(r[1]), xv, a1);
        a2 = _mm512_fmadd_ps(widen(r[2]), xv, a2);
        a3 = _mm512_fmadd_ps(widen(r[3]), xv, a3);
    }
    s[0] = _mm512_reduce_add_ps(a0);
    s[1] = _mm512_reduce_add_ps(a1);
    s[2] = _mm512_reduce_add_ps(a2);
    s[3] = _mm512_reduce_add_ps(a3);
}
#elif defined(MINILLM_AVX2)
constexpr int64_t kQ8Lanes = 8;  // codes per step of one row: an 8-byte load widened into one 256-bit register

// s[i] = sum over k < K (a multiple of 8) of r[i][k] * x[k], for 4 rows of codes r[0..3]
inline void dot4_q8(const float* x, const int8_t* const r[4], int64_t K, float s[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        // 8 bytes -> 8 int32 (sign-extended) -> 8 floats, each exact: codes are integers in [-127, 127]
        auto widen = [k](const int8_t* p) {
            return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + k))));
        };
        a0 = _mm256_fmadd_ps(widen(r[0]), xv, a0);
        a1 = _mm256_fmadd_ps(widen(r[1]), xv, a1);
        a2 = _mm256_fmadd_ps(widen(r[2]), xv, a2);
        a3 = _mm256_fmadd_ps(widen(r[3]), xv, a3);
    }
    s[0] = hsum(a0);
    s[1] = hsum(a1);
    s[2] = hsum(a2);
    s[3] = hsum(a3);
}
#endif

// Rows of x (M, K) against int8 codes q (N, K) with per-row scales into y (M, N); b may be null. Blocked as
// small_gemm: each block of 4 code rows (4 K bytes) is used by every row of x before the next block is read.
void small_gemm_q8(const float* x, const int8_t* q, const float* scale, const float* b, float* y, int64_t M, int64_t K,
                   int64_t N) {
    int64_t n = 0;
#if defined(MINILLM_AVX512) || defined(MINILLM_AVX2)
    const int64_t KV = K - K % kQ8Lanes;  // the columns that fill whole registers
    for (; n + 4 <= N; n += 4) {
        const int8_t* const r[4] = {q + n * K, q + (n + 1) * K, q + (n + 2) * K, q + (n + 3) * K};
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * K;
            float s[4];
            dot4_q8(xr, r, KV, s);
            for (int64_t k = KV; k < K; ++k) {  // the tail that does not fill a register
                for (int i = 0; i < 4; ++i) s[i] += static_cast<float>(r[i][k]) * xr[k];
            }
            float* yr = y + m * N;
            for (int i = 0; i < 4; ++i) yr[n + i] = scale[n + i] * s[i] + (b ? b[n + i] : 0.f);
        }
    }
#endif
    for (; n < N; ++n) {  // the last N % 4 rows (every row without AVX2)
        const int8_t* r = q + n * K;
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * K;
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += static_cast<float>(r[k]) * xr[k];
            y[m * N + n] = scale[n] * s + (b ? b[n] : 0.f);
        }
    }
}

// ----- int4 ----------------------------------------------------------------------------------------------------------
// Codes come two per byte: byte i of a row holds code 2i in its low nibble and code 2i+1 in its high one. The vector
// loops widen a run of bytes to 32-bit lanes once and take both nibbles from the same register, so lane i of the low
// half meets x[2i] and lane i of the high half x[2i+1]: x is first copied into `xs` with each run's even columns,
// then its odd ones (once per call, shared by every weight row). A group's sum is scaled once (the scale factors out
// of it), added into the row's total, and the next group starts from zero.
#if defined(MINILLM_AVX512)
constexpr int64_t kQ4Lanes = 32;  // codes per step of one row: 16 bytes widened into one 512-bit register, 2 halves

// The 16 values a 4-bit two's complement code stands for, indexed by the code: vpermps looks a lane up by its low
// 4 bits, so one instruction turns a nibble into its float (no masking, no sign extension, no int -> float convert).
inline __m512 q4_table() {
    return _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, -8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f);
}

// t[i] += scale[i] * (sum over k < G of q[i][k] * x[k]) for 4 rows of codes r[0..3] (G/2 bytes each, G a multiple
// of 32), x in `xs` order (each 32 columns: 16 even, 16 odd)
inline void dot4_q4_group(const float* xs, const uint8_t* const r[4], int64_t G, const float scale[4], __m512 t[4]) {
    const __m512 table = q4_table();
    __m512 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < G; k += kQ4Lanes) {
        const __m512 xe = _mm512_loadu_ps(xs + k), xo = _mm512_loadu_ps(xs + k + 16);
        for (int i = 0; i < 4; ++i) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r[i] + k / 2)));
            a[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, table), xe, a[i]);  // low nibbles: the table's index
            a[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), xo, a[i]);  // high ones
        }
    }
    for (int i = 0; i < 4; ++i) t[i] = _mm512_fmadd_ps(_mm512_set1_ps(scale[i]), a[i], t[i]);
}
inline float q4_total(__m512 t) { return _mm512_reduce_add_ps(t); }
using Q4Acc = __m512;
inline Q4Acc q4_zero() { return _mm512_setzero_ps(); }
#elif defined(MINILLM_AVX2)
constexpr int64_t kQ4Lanes = 16;  // codes per step of one row: 8 bytes widened into one 256-bit register, 2 halves

// As above with 8 lanes: vpermps has only 8 entries here, so each nibble is sign-extended by shifting it to the
// top of its lane and back (arithmetic shift), then converted.
inline void dot4_q4_group(const float* xs, const uint8_t* const r[4], int64_t G, const float scale[4], __m256 t[4]) {
    __m256 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < G; k += kQ4Lanes) {
        const __m256 xe = _mm256_loadu_ps(xs + k), xo = _mm256_loadu_ps(xs + k + 8);
        for (int i = 0; i < 4; ++i) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r[i] + k / 2)));
            const __m256i low = _mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28);   // bits 0-3, sign-extended
            const __m256i high = _mm256_srai_epi32(_mm256_slli_epi32(b, 24), 28);  // bits 4-7, sign-extended
            a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), xe, a[i]);
            a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), xo, a[i]);
        }
    }
    for (int i = 0; i < 4; ++i) t[i] = _mm256_fmadd_ps(_mm256_set1_ps(scale[i]), a[i], t[i]);
}
inline float q4_total(__m256 t) { return hsum(t); }
using Q4Acc = __m256;
inline Q4Acc q4_zero() { return _mm256_setzero_ps(); }
#endif

// Code k of a row of packed bytes, as an int in -8..7 (the scalar loops)
inline int q4_code(const uint8_t* row, int64_t k) {
    const int nibble = (k % 2 == 0) ? (row[k / 2] & 0xF) : (row[k / 2] >> 4);
    return (nibble ^ 8) - 8;  // 4-bit two's complement: 0..7 stay, 8..15 -> -8..-1
}

// Rows of x (M, K) against packed int4 codes p (N, K/2) with scales (N, K/G) into y (M, N); b may be null. The
// vector loops run when G is a multiple of their run of codes (32 with AVX-512, 16 with AVX2: true of chapter 09's
// group sizes 32, 64, 128); otherwise every row takes the scalar loop. Blocked as small_gemm.
void small_gemm_q4(const float* x, const uint8_t* p, const float* scale, const float* b, float* y, int64_t M,
                   int64_t K, int64_t N, int64_t G) {
    const int64_t groups = K / G, bytes = K / 2;
    int64_t n = 0;
#if defined(MINILLM_AVX512) || defined(MINILLM_AVX2)
    if (G % kQ4Lanes == 0) {
        thread_local std::vector<float> xs;  // x in the loops' order: per run of kQ4Lanes columns, evens then odds
        xs.resize(M * K);
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t k = 0; k < K; k += kQ4Lanes) {
                for (int64_t i = 0; i < kQ4Lanes / 2; ++i) {
                    xs[m * K + k + i] = x[m * K + k + 2 * i];
                    xs[m * K + k + kQ4Lanes / 2 + i] = x[m * K + k + 2 * i + 1];
                }
            }
        }
        for (; n + 4 <= N; n += 4) {
            const uint8_t* const r[4] = {p + n * bytes, p + (n + 1) * bytes, p + (n + 2) * bytes, p + (n + 3) * bytes};
            for (int64_t m = 0; m < M; ++m) {
                Q4Acc t[4] = {q4_zero(), q4_zero(), q4_zero(), q4_zero()};
                for (int64_t g = 0; g < groups; ++g) {
                    const uint8_t* const rg[4] = {r[0] + g * G / 2, r[1] + g * G / 2, r[2] + g * G / 2,
                                                  r[3] + g * G / 2};
                    const float s[4] = {scale[n * groups + g], scale[(n + 1) * groups + g],
                                        scale[(n + 2) * groups + g], scale[(n + 3) * groups + g]};
                    dot4_q4_group(xs.data() + m * K + g * G, rg, G, s, t);
                }
                float* yr = y + m * N;
                for (int i = 0; i < 4; ++i) yr[n + i] = q4_total(t[i]) + (b ? b[n + i] : 0.f);
            }
        }
    }
#endif
    for (; n < N; ++n) {  // the last N % 4 rows (every row without AVX2, or with a group size the loops do not take)
        const uint8_t* r = p + n * bytes;
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * K;
            float total = 0.f;
            for (int64_t g = 0; g < groups; ++g) {
                float s = 0.f;
                for (int64_t k = g * G; k < (g + 1) * G; ++k) s += static_cast<float>(q4_code(r, k)) * xr[k];
                total += scale[n * groups + g] * s;
            }
            y[m * N + n] = total + (b ? b[n] : 0.f);
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

const char* int8_path() {
#if defined(MINILLM_AVX512)
    return "AVX-512";
#elif defined(MINILLM_AVX2)
    return "AVX2 + FMA";
#else
    return "scalar";
#endif
}

const char* int4_path(int64_t group_size) {
#if defined(MINILLM_AVX512) || defined(MINILLM_AVX2)
    if (group_size % kQ4Lanes == 0) return int8_path();
#endif
    return "scalar";
}

}  // namespace minillm

namespace {

// x (M, K), w (N, K), bias (N) or empty -> (M, N); float32, contiguous, CPU (checked by the Python wrapper too).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && bias.device().is_cpu(), "gemv: CPU tensors only");
    minillm::check_plain_memory(x, "gemv", "x");
    minillm::check_plain_memory(w, "gemv", "w");
    minillm::check_plain_memory(bias, "gemv", "bias");
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

// x (M, K) float32, q (N, K) int8 codes, scale (N,) float32, bias (N) float32 or empty -> (M, N); contiguous, CPU
// (checked by the Python wrapper, `cpu_gemv.int8_gemv`, too).
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias) {
    TORCH_CHECK_VALUE(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu() && bias.device().is_cpu(),
                      "int8_gemv: CPU tensors only");
    minillm::check_plain_memory(x, "int8_gemv", "x");
    minillm::check_plain_memory(q, "int8_gemv", "q");
    minillm::check_plain_memory(scale, "int8_gemv", "scale");
    minillm::check_plain_memory(bias, "int8_gemv", "bias");
    TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
                     "int8_gemv: x must be float32, q int8 and scale float32, got x ", x.scalar_type(), ", q ",
                     q.scalar_type(), " and scale ", scale.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1),
                      "int8_gemv: x must be (M, K) and q (N, K) with the same K, got x ", x.sizes(), " and q ",
                      q.sizes());
    TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == q.size(0), "int8_gemv: scale must be (N,) for q ", q.sizes(),
                      ", got ", scale.sizes());
    TORCH_CHECK_VALUE(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous(),
                      "int8_gemv: x, q and scale must be contiguous");
    const bool has_bias = bias.numel() > 0;
    TORCH_CHECK_TYPE(!has_bias || bias.scalar_type() == at::kFloat, "int8_gemv: bias must be float32, got ",
                     bias.scalar_type());
    TORCH_CHECK_VALUE(!has_bias || (bias.dim() == 1 && bias.size(0) == q.size(0) && bias.is_contiguous()),
                      "int8_gemv: bias must be a contiguous (N,) tensor or empty, got ", bias.sizes());
    const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
    auto y = at::empty({M, N}, x.options());
    minillm::small_gemm_q8(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                           has_bias ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N);
    return y;
}

// x (M, K) float32, p (N, K/2) packed int4 codes (uint8), scale (N, groups) float32 with groups dividing K into even
// groups, bias (N) float32 or empty -> (M, N); contiguous, CPU (checked by the wrapper, `cpu_gemv.int4_gemv`, too).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& p, const at::Tensor& scale, const at::Tensor& bias) {
    TORCH_CHECK_VALUE(x.device().is_cpu() && p.device().is_cpu() && scale.device().is_cpu() && bias.device().is_cpu(),
                      "int4_gemv: CPU tensors only");
    minillm::check_plain_memory(x, "int4_gemv", "x");
    minillm::check_plain_memory(p, "int4_gemv", "p");
    minillm::check_plain_memory(scale, "int4_gemv", "scale");
    minillm::check_plain_memory(bias, "int4_gemv", "bias");
    TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && p.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat,
                     "int4_gemv: x must be float32, p uint8 (two codes per byte) and scale float32, got x ",
                     x.scalar_type(), ", p ", p.scalar_type(), " and scale ", scale.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 2 && p.dim() == 2 && x.size(1) == 2 * p.size(1),
                      "int4_gemv: x must be (M, K) and p (N, K/2), got x ", x.sizes(), " and p ", p.sizes());
    const int64_t M = x.size(0), K = x.size(1), N = p.size(0);
    TORCH_CHECK_VALUE(scale.dim() == 2 && scale.size(0) == N && scale.size(1) >= 1 && K % scale.size(1) == 0 &&
                          (K / scale.size(1)) % 2 == 0,
                      "int4_gemv: scale must be (N, groups) with groups dividing K = ", K, " into even groups, got ",
                      scale.sizes(), " for p ", p.sizes());
    TORCH_CHECK_VALUE(x.is_contiguous() && p.is_contiguous() && scale.is_contiguous(),
                      "int4_gemv: x, p and scale must be contiguous");
    const bool has_bias = bias.numel() > 0;
    TORCH_CHECK_TYPE(!has_bias || bias.scalar_type() == at::kFloat, "int4_gemv: bias must be float32, got ",
                     bias.scalar_type());
    TORCH_CHECK_VALUE(!has_bias || (bias.dim() == 1 && bias.size(0) == N && bias.is_contiguous()),
                      "int4_gemv: bias must be a contiguous (N,) tensor or empty, got ", bias.sizes());
    auto y = at::empty({M, N}, x.options());
    minillm::small_gemm_q4(x.data_ptr<float>(), p.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                           has_bias ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N,
                           K / scale.size(1));
    return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("gemv", &gemv, "y = x W^T + b for a few rows of x (float32, CPU)");
    m.def("int8_gemv", &int8_gemv, "y = (x q^T) * scale + b for a few rows of x, int8 codes q (CPU)");
    m.def("uses_avx2", &minillm::uses_avx2, "whether this build took the AVX2 + FMA path");
    m.def("int8_path", &minillm::int8_path, "the int8 GEMV's loop in this build: AVX-512, AVX2 + FMA or scalar");
    m.def("int4_gemv", &int4_gemv, "y = x (q * scale)^T + b for a few rows of x, packed int4 codes, group scales (CPU)");
    m.def("int4_path", &minillm::int4_path, pybind11::arg("group_size"),
          "the int4 GEMV's loop in this build for a group size: AVX-512, AVX2 + FMA or scalar");
    minillm::register_decoder(m);  // the whole decode step, decode_cpu.cpp
}

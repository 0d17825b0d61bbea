// Causal attention forward, out = softmax(q k^T / sqrt(D) + causal mask) v, for q, k, v, out of shape (B*H, T, D)
// contiguous, D <= 128; fp32 accumulation, two versions:
//   v1  one thread block per query row, thread d owning output dimension d: for each key j <= i the block sums
//       q . k_j (a block reduction), then folds it into the running (max m, sum l, output acc) of the online
//       softmax. Correct and obvious, and slow: one reduction and two barriers per key, K/V read once per query.
//   v2  FlashAttention tiling (Dao et al. 2022, Algorithm 1): a block owns BR = 16 query rows; it walks the keys in
//       tiles of BC = 16, staging each K/V tile in shared memory once for all 16 rows, computing the 16 x 16 score
//       tile, and rescaling its running output by exp(m_old - m_new) (Algorithm 1, lines 9-12). Causality stops
//       the walk at the tile's last query row. Everything stays in fp32 shared memory (33 KB of the 48 KB).
//   v3  FlashAttention-2's work split (Dao 2023) with register tiles: a block of 128 threads owns BR = 64 query
//       rows and walks key tiles of BC = 64. Thread (ty, tx) = (tid / 8, tid % 8) keeps a 4 x 8 tile of scores
//       and a 4 x (Dp / 8) tile of the output in registers, so each value read from shared memory feeds 4 or 8
//       multiply-adds instead of one. The 8 threads of a row group share its max and sum through three
//       shuffles. Q is pre-scaled by log2(e) / sqrt(D) so the exponentials are exp2f; the output is divided by l
//       once at the end. Q^T, K^T, V and P^T of a tile live in dynamic shared memory (fp32, 43 / 69 / 120 KB for
//       head sizes padded to 32 / 64 / 128), and the heaviest query tiles (the last, with the most keys) start
//       first. Still no tensor cores: every product is an fp32 FMA.
//   v4  v3's tiles on the tensor cores (nvcuda::wmma, 16 x 16 x 16 tiles, fp16 or bf16 in, fp32 accumulated): each
//       of the 4 warps owns 16 of the block's 64 query rows. S = Q K^T and O += P V are warp matrix products from
//       shared memory; the online softmax runs between them on S stored to shared memory, two lanes per row (32
//       columns each, combined with one shuffle), writing P in the input dtype and rescaling the row of O, which
//       lives in shared memory in fp32. l sums P as rounded, so the normalization matches what is multiplied.
//       fp32 inputs have no 16-bit tensor-core path here and run v3.
// Reference twins: minillm.kernels.naive.attention (dense softmax), minillm.kernels.mirror.flash_attention (v2),
// minillm.kernels.mirror.flash_attention_v3 (v3's base-2 exponentials and per-thread partial max and sum).
#include <mma.h>

#include <type_traits>

#include "common.cuh"
#include "kernels.h"

namespace minillm {

constexpr int kMaxHeadDim = 128;

// v1: blockDim.x == 128 >= D; block b computes row b of the flattened (BH * T, D) output.
template <typename T>
__global__ void attention_v1_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                    T* __restrict__ out, int64_t seq_len, int64_t head_dim, float scale) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;  // bh * T + i
    const int64_t bh = row / seq_len, i = row % seq_len;
    const int d = threadIdx.x;
    const bool active = d < head_dim;
    const T* kb = k + bh * seq_len * head_dim;  // (T, D) of this (batch, head)
    const T* vb = v + bh * seq_len * head_dim;
    const float qd = active ? to_float(q[row * head_dim + d]) : 0.f;
    float m = -INFINITY, l = 0.f, acc = 0.f;
    for (int64_t j = 0; j <= i; ++j) {  // causal: keys 0..i
        const float s = block_sum(active ? qd * to_float(kb[j * head_dim + d]) : 0.f, scratch) * scale;
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new);  // m = -inf on the first key: alpha = 0
        const float p = expf(s - m_new);
        l = l * alpha + p;
        acc = acc * alpha + p * (active ? to_float(vb[j * head_dim + d]) : 0.f);
        m = m_new;
    }
    if (active) out[row * head_dim + d] = from_float<T>(acc / l);
}

// v2: blockDim.x == 128; block b handles (bh, tile) = (b / num_tiles, b % num_tiles), rows tile*BR .. +BR-1.
template <typename T>
__global__ void attention_v2_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                    T* __restrict__ out, int64_t seq_len, int64_t head_dim, float scale) {
    constexpr int BR = 16, BC = 16, DM = kMaxHeadDim;
    __shared__ float sQ[BR][DM], sK[BC][DM], sV[BC][DM], sO[BR][DM];
    __shared__ float sS[BR][BC], sM[BR], sL[BR], sA[BR];
    const int64_t num_tiles = (seq_len + BR - 1) / BR;
    const int64_t bh = blockIdx.x / num_tiles;
    const int64_t q0 = (blockIdx.x % num_tiles) * BR;  // first query row of this tile
    const int64_t base = bh * seq_len * head_dim;      // (T, D) of this (batch, head)
    const int D = static_cast<int>(head_dim);
    const int tid = threadIdx.x, nt = blockDim.x;

    for (int idx = tid; idx < BR * D; idx += nt) {
        const int r = idx / D, d = idx % D;
        const int64_t qi = q0 + r;
        sQ[r][d] = qi < seq_len ? to_float(q[base + qi * D + d]) : 0.f;
        sO[r][d] = 0.f;
    }
    if (tid < BR) {
        sM[tid] = -INFINITY;
        sL[tid] = 0.f;
    }
    __syncthreads();

    // BEGIN INCLUDE attention_v2_tiles
    const int64_t kv_end = q0 + BR < seq_len ? q0 + BR : seq_len;  // causal: no key after the last query row
    for (int64_t k0 = 0; k0 < kv_end; k0 += BC) {
        for (int idx = tid; idx < BC * D; idx += nt) {  // stage the K and V tiles, zeros past the end
            const int c = idx / D, d = idx % D;
            const int64_t kj = k0 + c;
            sK[c][d] = kj < seq_len ? to_float(k[base + kj * D + d]) : 0.f;
            sV[c][d] = kj < seq_len ? to_float(v[base + kj * D + d]) : 0.f;
        }
        __syncthreads();
        for (int idx = tid; idx < BR * BC; idx += nt) {  // S = scale * Q K^T on the tile, -inf where masked
            const int r = idx / BC, c = idx % BC;
            const int64_t qi = q0 + r, kj = k0 + c;
            float s = -INFINITY;
            if (qi < seq_len && kj <= qi) {  // kj <= qi < seq_len also keeps padding keys out
                float dot = 0.f;
                for (int d = 0; d < D; ++d) dot += sQ[r][d] * sK[c][d];
                s = dot * scale;
            }
            sS[r][c] = s;
        }
        __syncthreads();
        if (tid < BR) {  // online softmax, one thread per row: new max, P = exp(S - m_new), l and the rescale
            const int r = tid;
            float mt = -INFINITY;
            for (int c = 0; c < BC; ++c) mt = fmaxf(mt, sS[r][c]);
            const float m_old = sM[r], m_new = fmaxf(m_old, mt);
            float alpha = 1.f;
            if (m_new == -INFINITY) {  // no visible key yet (or a padding row): contribute nothing
                for (int c = 0; c < BC; ++c) sS[r][c] = 0.f;
            } else {
                alpha = expf(m_old - m_new);
                float sum = 0.f;
                for (int c = 0; c < BC; ++c) {
                    const float p = expf(sS[r][c] - m_new);  // masked: expf(-inf) = 0
                    sS[r][c] = p;
                    sum += p;
                }
                sL[r] = sL[r] * alpha + sum;
                sM[r] = m_new;
            }
            sA[r] = alpha;
        }
        __syncthreads();
        for (int idx = tid; idx < BR * D; idx += nt) {  // O = diag(alpha) O + P V
            const int r = idx / D, d = idx % D;
            float acc = sO[r][d] * sA[r];
            for (int c = 0; c < BC; ++c) acc += sS[r][c] * sV[c][d];
            sO[r][d] = acc;
        }
        __syncthreads();  // the next tile overwrites sK, sV, sS
    }
    // END INCLUDE attention_v2_tiles
    for (int idx = tid; idx < BR * D; idx += nt) {
        const int r = idx / D, d = idx % D;
        const int64_t qi = q0 + r;
        if (qi < seq_len) out[base + qi * D + d] = from_float<T>(sO[r][d] / sL[r]);
    }
}

// v3's geometry: 64 x 64 tiles, 128 threads as 16 row groups (ty) of 8 threads (tx); rows of the transposed
// tiles are padded by 4 floats (16 bytes, so float4 accesses stay aligned).
constexpr int kV3Rows = 64, kV3Cols = 64, kV3Threads = 128, kV3Pad = 4;

// The head size v3 pads to (its template instance): 32, 64 or 128; 0 when head_dim > 128.
__host__ __device__ constexpr int attention_v3_padded_dim(int64_t head_dim) {
    return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 0;
}

size_t attention_v3_smem_bytes(int64_t head_dim) {
    const int dp = attention_v3_padded_dim(head_dim);
    // sQt (dp, BR + pad), sKt (dp, BC + pad), sV (BC, dp), sPt (BC, BR + pad), all fp32
    const size_t d = static_cast<size_t>(dp);
    return sizeof(float) *
           (d * (kV3Rows + kV3Pad) + d * (kV3Cols + kV3Pad) + kV3Cols * d + kV3Cols * (kV3Rows + kV3Pad));
}

// v3: blockDim.x == 128, dynamic shared memory attention_v3_smem_bytes(DP). Block b handles (batch-head, query tile)
// = (b % batch_heads, num_tiles - 1 - b / batch_heads): every head's last tile first.
template <typename T, int DP>
__global__ void __launch_bounds__(kV3Threads)
attention_v3_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                    int64_t batch_heads, int64_t seq_len, int64_t head_dim, float q_scale) {
    constexpr int BR = kV3Rows, BC = kV3Cols, LQ = BR + kV3Pad, LK = BC + kV3Pad;
    constexpr int DG = DP / 32;  // groups of 4 output dimensions per thread: d = g * 32 + tx * 4 + t
    extern __shared__ float4 smem4[];  // float4: the base is 16-byte aligned
    float* sQt = reinterpret_cast<float*>(smem4);  // (DP, LQ): Q^T, pre-scaled, zeros past D and past the sequence
    float* sKt = sQt + DP * LQ;                     // (DP, LK): K^T of the current key tile
    float* sV = sKt + DP * LK;                      // (BC, DP): V of the current key tile
    float* sPt = sV + BC * DP;                      // (BC, LQ): P^T = exp2(S - m)^T of the current tile

    const int tid = threadIdx.x, ty = tid / 8, tx = tid % 8;
    const int64_t num_tiles = (seq_len + BR - 1) / BR;
    const int64_t bh = blockIdx.x % batch_heads;
    const int64_t q0 = (num_tiles - 1 - blockIdx.x / batch_heads) * BR;  // first query row of this tile
    const int64_t base = bh * seq_len * head_dim;                          // (T, D) of this (batch, head)
    const int D = static_cast<int>(head_dim);

    for (int idx = tid; idx < BR * DP; idx += kV3Threads) {  // coalesced reads along d
        const int r = idx / DP, d = idx % DP;
        const int64_t qi = q0 + r;
        sQt[d * LQ + r] = qi < seq_len && d < D ? to_float(q[base + qi * D + d]) * q_scale : 0.f;
    }

    // Thread (ty, tx) owns rows ty * 4 + i (i < 4); score columns col(j) = (j / 4) * 32 + tx * 4 + j % 4 (j < 8),
    // interleaved so the 8 threads of a row group read 32 consecutive floats per float4 load (no bank conflicts).
    float m[4], l[4], o[4][4 * DG];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.f;
#pragma unroll
        for (int t = 0; t < 4 * DG; ++t) o[i][t] = 0.f;
    }

    const int64_t kv_end = q0 + BR < seq_len ? q0 + BR : seq_len;  // causal: no key after the tile's last row
    for (int64_t k0 = 0; k0 < kv_end; k0 += BC) {
        __syncthreads();  // the previous tile's sKt, sV, sPt are read by everyone (and sQt is written, the first time)
        for (int idx = tid; idx < BC * DP; idx += kV3Threads) {
            const int c = idx / DP, d = idx % DP;
            const int64_t kj = k0 + c;
            const bool in = kj < seq_len && d < D;
            sKt[d * LK + c] = in ? to_float(k[base + kj * D + d]) : 0.f;
            sV[c * DP + d] = in ? to_float(v[base + kj * D + d]) : 0.f;
        }
        __syncthreads();

        float s[4][8];  // S = Q K^T in log2 units on this thread's 4 x 8 cells
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) s[i][j] = 0.f;
#pragma unroll 8
        for (int d = 0; d < DP; ++d) {
            const float4 a = *reinterpret_cast<const float4*>(&sQt[d * LQ + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&sKt[d * LK + tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&sKt[d * LK + 32 + tx * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) s[i][j] = fmaf(av[i], bv[j], s[i][j]);
        }
        if (k0 + BC - 1 > q0 || k0 + BC > seq_len) {  // only the diagonal tile (and the sequence's end) is masked
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int64_t qi = q0 + ty * 4 + i, kj = k0 + (j / 4) * 32 + tx * 4 + j % 4;
                    if (kj > qi || kj >= seq_len) s[i][j] = -INFINITY;
                }
        }
        // Online softmax per row, its 64 scores spread over the 8 threads tx = 0..7 (lanes differing in bits 0-2).
        // Every row sees key 0 in the first tile, so m is finite from then on and exp2f(m - m_new) never meets nan.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float mt = s[i][0];
#pragma unroll
            for (int j = 1; j < 8; ++j) mt = fmaxf(mt, s[i][j]);
#pragma unroll
            for (int offset = 1; offset < 8; offset <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, offset));
            const float m_new = fmaxf(m[i], mt);
            const float alpha = exp2f(m[i] - m_new);  // 0 on the first tile (m = -inf)
            float rs = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                s[i][j] = exp2f(s[i][j] - m_new);  // masked: exp2f(-inf) = 0
                rs += s[i][j];
            }
#pragma unroll
            for (int offset = 1; offset < 8; offset <<= 1) rs += __shfl_xor_sync(0xffffffffu, rs, offset);
            l[i] = l[i] * alpha + rs;
            m[i] = m_new;
#pragma unroll
            for (int t = 0; t < 4 * DG; ++t) o[i][t] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // P^T: column col(j) of P becomes row col(j) of sPt, this thread's 4 rows
            const int c = (j / 4) * 32 + tx * 4 + j % 4;
            *reinterpret_cast<float4*>(&sPt[c * LQ + ty * 4]) = make_float4(s[0][j], s[1][j], s[2][j], s[3][j]);
        }
        __syncthreads();
#pragma unroll 4
        for (int c = 0; c < BC; ++c) {  // O += P V on this thread's 4 rows x 4 * DG dimensions
            const float4 a = *reinterpret_cast<const float4*>(&sPt[c * LQ + ty * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int g = 0; g < DG; ++g) {
                const float4 b = *reinterpret_cast<const float4*>(&sV[c * DP + g * 32 + tx * 4]);
                const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int t = 0; t < 4; ++t) o[i][g * 4 + t] = fmaf(av[i], bv[t], o[i][g * 4 + t]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int64_t qi = q0 + ty * 4 + i;
        if (qi >= seq_len) continue;
        const float inv = 1.f / l[i];
#pragma unroll
        for (int g = 0; g < DG; ++g)
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const int d = g * 32 + tx * 4 + t;
                if (d < D) out[base + qi * D + d] = from_float<T>(o[i][g * 4 + t] * inv);
            }
    }
}

template <typename T, int DP>
cudaError_t launch_attention_v3(const T* q, const T* k, const T* v, T* out, int64_t batch_heads, int64_t seq_len,
                                int64_t head_dim, cudaStream_t stream) {
    const int64_t blocks = batch_heads * ((seq_len + kV3Rows - 1) / kV3Rows);
    if (blocks > 2147483647LL) return cudaErrorInvalidValue;
    const size_t smem = attention_v3_smem_bytes(DP);
    // Above 48 KB a kernel must opt in to dynamic shared memory (the bindings check the device allows this much).
    const cudaError_t err = cudaFuncSetAttribute(attention_v3_kernel<T, DP>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    const float q_scale = 1.4426950408889634f / sqrtf(static_cast<float>(head_dim));  // log2(e) / sqrt(D)
    attention_v3_kernel<T, DP><<<static_cast<unsigned>(blocks), kV3Threads, smem, stream>>>(
        q, k, v, out, batch_heads, seq_len, head_dim, q_scale);
    return cudaGetLastError();
}

// v4's geometry: v3's 64 x 64 tiles, 4 warps of 16 query rows each. Row strides (in elements) are padded so that every
// wmma tile starts 256-bit aligned and consecutive rows fall in different shared-memory banks.
constexpr int kV4Warps = 4;

template <int DP>
struct V4Layout {
    static constexpr int BR = 64, BC = 64;
    static constexpr int LDT = DP + 8;   // sQ, sK, sV: (64, DP) in the input dtype
    static constexpr int LDS = BC + 4;   // sS: per warp (16, 64) fp32 scores
    static constexpr int LDP = BC + 8;   // sP: per warp (16, 64) probabilities in the input dtype
    static constexpr int LDO = DP + 4;   // sO: per warp (16, DP) fp32 output
    static constexpr size_t bytes = 2 * (3 * BR * LDT + kV4Warps * 16 * LDP) + 4 * (kV4Warps * 16 * (LDS + LDO));
};

size_t attention_v4_smem_bytes(int64_t head_dim) {
    switch (attention_v3_padded_dim(head_dim)) {
        case 32: return V4Layout<32>::bytes;
        case 64: return V4Layout<64>::bytes;
        default: return V4Layout<128>::bytes;
    }
}

// v4: blockDim.x == 128, T = __half or __nv_bfloat16, dynamic shared memory V4Layout<DP>::bytes; blocks map to
// (batch-head, query tile) as in v3.
template <typename T, int DP>
__global__ void __launch_bounds__(128, 1)  // (128, 1): let ptxas use the registers it needs, no spills
attention_v4_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                    int64_t batch_heads, int64_t seq_len, int64_t head_dim, float s_scale) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // 16-bit wmma with bf16 needs sm_80 (the bindings check)
    namespace wmma = nvcuda::wmma;
    using L = V4Layout<DP>;
    constexpr int BR = L::BR, BC = L::BC, LDT = L::LDT, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO;
    extern __shared__ __align__(128) unsigned char smem_v4[];
    T* sQ = reinterpret_cast<T*>(smem_v4);                        // (BR, LDT)
    T* sK = sQ + BR * LDT;                                        // (BC, LDT)
    T* sV = sK + BC * LDT;                                        // (BC, LDT)
    T* sP = sV + BC * LDT;                                        // (4 warps, 16, LDP)
    float* sS = reinterpret_cast<float*>(sP + kV4Warps * 16 * LDP);  // (4 warps, 16, LDS)
    float* sO = sS + kV4Warps * 16 * LDS;                         // (4 warps, 16, LDO)

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int64_t num_tiles = (seq_len + BR - 1) / BR;
    const int64_t bh = blockIdx.x % batch_heads;
    const int64_t q0 = (num_tiles - 1 - blockIdx.x / batch_heads) * BR;  // heaviest tiles first, as v3
    const int64_t base = bh * seq_len * head_dim;
    const int D = static_cast<int>(head_dim);
    const T zero = from_float<T>(0.f);

    for (int idx = tid; idx < BR * DP; idx += blockDim.x) {
        const int r = idx / DP, d = idx % DP;
        const int64_t qi = q0 + r;
        sQ[r * LDT + d] = qi < seq_len && d < D ? q[base + qi * D + d] : zero;
    }
    T* sPw = sP + warp * 16 * LDP;  // this warp's 16 rows
    float* sSw = sS + warp * 16 * LDS;
    float* sOw = sO + warp * 16 * LDO;
    for (int idx = lane; idx < 16 * DP; idx += 32) sOw[(idx / DP) * LDO + idx % DP] = 0.f;
    const int r = lane / 2, half = lane % 2;  // a lane's row of the warp's 16, and its half of the columns
    const int64_t qi = q0 + warp * 16 + r;
    float m = -INFINITY, l = 0.f;  // the same in both lanes of a row

    const int64_t kv_end = q0 + BR < seq_len ? q0 + BR : seq_len;
    for (int64_t k0 = 0; k0 < kv_end; k0 += BC) {
        __syncthreads();  // the previous tile's sK, sV are read by every warp (and sQ is written, the first time)
        for (int idx = tid; idx < BC * DP; idx += blockDim.x) {
            const int c = idx / DP, d = idx % DP;
            const int64_t kj = k0 + c;
            const bool in = kj < seq_len && d < D;
            sK[c * LDT + d] = in ? k[base + kj * D + d] : zero;
            sV[c * LDT + d] = in ? v[base + kj * D + d] : zero;
        }
        __syncthreads();

#pragma unroll 1  // one 16-column block at a time: fewer live fragments, no spills
        for (int nb = 0; nb < BC / 16; ++nb) {  // S (16 x 64) = Q (16 x DP) K^T, 16 key columns at a time
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kb = 0; kb < DP / 16; ++kb) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;  // K row-major is K^T col-major
                wmma::load_matrix_sync(a, sQ + warp * 16 * LDT + kb * 16, LDT);
                wmma::load_matrix_sync(b, sK + nb * 16 * LDT + kb * 16, LDT);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(sSw + nb * 16, acc, LDS, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax on row r, columns half * 32 .. half * 32 + 31 (log2 units: s_scale = log2(e) / sqrt(D)).
        float mt = -INFINITY;
        for (int c = half * 32; c < half * 32 + 32; ++c) {
            const int64_t kj = k0 + c;
            const float sv = kj > qi || kj >= seq_len ? -INFINITY : sSw[r * LDS + c] * s_scale;
            sSw[r * LDS + c] = sv;
            mt = fmaxf(mt, sv);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));  // the other half of the row
        const float m_new = fmaxf(m, mt);  // finite: every row sees key 0 in the first tile
        const float alpha = exp2f(m - m_new);
        float rs = 0.f;
        for (int c = half * 32; c < half * 32 + 32; ++c) {
            const T p = from_float<T>(exp2f(sSw[r * LDS + c] - m_new));
            sPw[r * LDP + c] = p;
            rs += to_float(p);  // the rounded p: l then normalizes exactly what P V multiplies
        }
        rs += __shfl_xor_sync(0xffffffffu, rs, 1);
        l = l * alpha + rs;
        m = m_new;
        for (int d = half * (DP / 2); d < (half + 1) * (DP / 2); ++d) sOw[r * LDO + d] *= alpha;
        __syncwarp();

#pragma unroll 1
        for (int db = 0; db < DP / 16; ++db) {  // O (16 x DP) += P (16 x 64) V (64 x DP), 16 dimensions at a time
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, sOw + db * 16, LDO, wmma::mem_row_major);
#pragma unroll
            for (int kb = 0; kb < BC / 16; ++kb) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                wmma::load_matrix_sync(a, sPw + kb * 16, LDP);
                wmma::load_matrix_sync(b, sV + kb * 16 * LDT + db * 16, LDT);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(sOw + db * 16, acc, LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }
    if (qi < seq_len) {
        const float inv = 1.f / l;
        for (int d = half * (DP / 2); d < (half + 1) * (DP / 2); ++d)
            if (d < D) out[base + qi * D + d] = from_float<T>(sOw[r * LDO + d] * inv);
    }
#endif
}

template <typename T, int DP>
cudaError_t launch_attention_v4(const T* q, const T* k, const T* v, T* out, int64_t batch_heads, int64_t seq_len,
                                int64_t head_dim, cudaStream_t stream) {
    if constexpr (std::is_same<T, float>::value) {  // no fp32 tensor-core path here: fp32 runs v3
        return launch_attention_v3<T, DP>(q, k, v, out, batch_heads, seq_len, head_dim, stream);
    } else {
        const int64_t blocks = batch_heads * ((seq_len + 63) / 64);
        if (blocks > 2147483647LL) return cudaErrorInvalidValue;
        const size_t smem = V4Layout<DP>::bytes;
        const cudaError_t err = cudaFuncSetAttribute(attention_v4_kernel<T, DP>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(smem));
        if (err != cudaSuccess) return err;
        const float s_scale = 1.4426950408889634f / sqrtf(static_cast<float>(head_dim));  // log2(e) / sqrt(D)
        attention_v4_kernel<T, DP><<<static_cast<unsigned>(blocks), 128, smem, stream>>>(
            q, k, v, out, batch_heads, seq_len, head_dim, s_scale);
        return cudaGetLastError();
    }
}

cudaError_t attention_forward(int version, int dtype, const void* q, const void* k, const void* v, void* out,
                              int64_t batch_heads, int64_t seq_len, int64_t head_dim, cudaStream_t stream) {
    if (batch_heads <= 0 || seq_len <= 0 || head_dim <= 0) return cudaSuccess;
    if (head_dim > kMaxHeadDim) return cudaErrorInvalidValue;
    const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
    MINILLM_DISPATCH(dtype, {
        const T* qt = static_cast<const T*>(q);
        const T* kt = static_cast<const T*>(k);
        const T* vt = static_cast<const T*>(v);
        T* yt = static_cast<T*>(out);
        if (version == 1) {
            const int64_t blocks = batch_heads * seq_len;
            if (blocks > 2147483647LL) return cudaErrorInvalidValue;
            attention_v1_kernel<T><<<static_cast<unsigned>(blocks), 128, 0, stream>>>(qt, kt, vt, yt, seq_len, head_dim, scale);
        } else if (version == 2) {
            const int64_t blocks = batch_heads * ((seq_len + 15) / 16);
            if (blocks > 2147483647LL) return cudaErrorInvalidValue;
            attention_v2_kernel<T><<<static_cast<unsigned>(blocks), 128, 0, stream>>>(qt, kt, vt, yt, seq_len, head_dim, scale);
        } else if (version == 3) {
            switch (attention_v3_padded_dim(head_dim)) {
                case 32: return launch_attention_v3<T, 32>(qt, kt, vt, yt, batch_heads, seq_len, head_dim, stream);
                case 64: return launch_attention_v3<T, 64>(qt, kt, vt, yt, batch_heads, seq_len, head_dim, stream);
                default: return launch_attention_v3<T, 128>(qt, kt, vt, yt, batch_heads, seq_len, head_dim, stream);
            }
        } else if (version == 4) {
            switch (attention_v3_padded_dim(head_dim)) {
                case 32: return launch_attention_v4<T, 32>(qt, kt, vt, yt, batch_heads, seq_len, head_dim, stream);
                case 64: return launch_attention_v4<T, 64>(qt, kt, vt, yt, batch_heads, seq_len, head_dim, stream);
                default: return launch_attention_v4<T, 128>(qt, kt, vt, yt, batch_heads, seq_len, head_dim, stream);
            }
        } else {
            return cudaErrorInvalidValue;
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

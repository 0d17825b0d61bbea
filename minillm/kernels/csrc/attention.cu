// Causal attention forward, out = softmax(q k^T / sqrt(D) + causal mask) v, for q, k, v, out of shape (B*H, T, D)
// contiguous, D <= 128; fp32 accumulation, two versions:
//   v1  one thread block per query row, thread d owning output dimension d: for each key j <= i the block sums
//       q . k_j (a block reduction), then folds it into the running (max m, sum l, output acc) of the online
//       softmax. Correct and obvious, and slow: one reduction and two barriers per key, K/V read once per query.
//   v2  FlashAttention tiling (Dao et al. 2022, Algorithm 1): a block owns BR = 16 query rows; it walks the keys in
//       tiles of BC = 16, staging each K/V tile in shared memory once for all 16 rows, computing the 16 x 16 score
//       tile, and rescaling its running output by exp(m_old - m_new) (Algorithm 1, lines 9-12). Causality stops
//       the walk at the tile's last query row. Everything stays in fp32 shared memory (33 KB of the 48 KB).
// Reference twins: minillm.kernels.naive.attention (dense softmax), minillm.kernels.mirror.flash_attention.
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
    for (int idx = tid; idx < BR * D; idx += nt) {
        const int r = idx / D, d = idx % D;
        const int64_t qi = q0 + r;
        if (qi < seq_len) out[base + qi * D + d] = from_float<T>(sO[r][d] / sL[r]);
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
        } else {
            return cudaErrorInvalidValue;
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

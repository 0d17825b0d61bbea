// Paged-attention decode: one query token per sequence attends to its whole context, whose K/V sit in chapter 05's
// block pools (minillm.paged.PagedKVCache: k_pool, v_pool of shape (nb, bs, nh, hs)) and are found through the
// sequence's block table (block_tables (S, max_nb) int64, -1 padded) and its length (context_lens (S,) int64).
// Token j of sequence s lives in block block_tables[s, j / bs] at offset j % bs, i.e. pool row
// slot = block * bs + j % bs (minillm.paged.compute_slot_mapping). Two versions:
//   v1  one thread block per (sequence, head), thread d owning dimension d; for each of the ctx keys the block
//       reduces q . k_j and folds it into an online softmax (as attention.cu v1), reading K/V in place from the
//       pool: no gather, no padding to the longest sequence (Kwon et al. 2023, section 4.1). Two __syncthreads
//       per key, and only one key in flight per block.
//   v2  the 4 warps of the block split the keys (warp w takes keys w, w + 4, ...); within a warp, lane l owns up
//       to 4 neighbouring dimensions, so q . k_j is a per-lane partial sum and five shuffles, with no barrier.
//       Each warp keeps its own online-softmax state (m, l, and its lanes' share of the output); at the end the
//       four states merge through shared memory, rescaled to the largest m (the merge of softmax.cu v4).
// A block index outside 0..nb-1 (or a context longer than the table) makes that (sequence, head) output NaN, so
// a bad table is loud instead of reading out of bounds; a context of 0 gives zeros.
// Reference twins: minillm.kernels.naive.paged_attention_decode, minillm.kernels.mirror.paged_attention_decode
// (num_warps=4: v2's split of the keys and the merge of the warps' states).
#include "common.cuh"
#include "kernels.h"

namespace minillm {

// blockDim.x == 128 >= hs; block b handles sequence b / nh, head b % nh.
template <typename T>
__global__ void paged_attention_v1_kernel(const T* __restrict__ q, const T* __restrict__ k_pool,
                                          const T* __restrict__ v_pool, const int64_t* __restrict__ block_tables,
                                          const int64_t* __restrict__ context_lens, T* __restrict__ out,
                                          int64_t num_heads, int64_t head_dim, int64_t num_blocks,
                                          int64_t block_size, int64_t max_blocks_per_seq, float scale) {
    __shared__ float scratch[32];
    const int64_t s = blockIdx.x / num_heads, h = blockIdx.x % num_heads;
    const int d = threadIdx.x;
    const bool active = d < head_dim;
    const int64_t ctx = context_lens[s];
    const int64_t* table = block_tables + s * max_blocks_per_seq;
    const float qd = active ? to_float(q[(s * num_heads + h) * head_dim + d]) : 0.f;
    float m = -INFINITY, l = 0.f, acc = 0.f;
    bool bad = ctx > max_blocks_per_seq * block_size;
    for (int64_t j = 0; j < ctx && !bad; ++j) {
        const int64_t block = table[j / block_size];  // the same value in every thread: the branch is uniform
        if (block < 0 || block >= num_blocks) {
            bad = true;
            break;
        }
        const int64_t row = (block * block_size + j % block_size) * num_heads + h;  // pool as (nb*bs*nh, hs)
        const float sc = block_sum(active ? qd * to_float(k_pool[row * head_dim + d]) : 0.f, scratch) * scale;
        const float m_new = fmaxf(m, sc);
        const float alpha = expf(m - m_new);
        const float p = expf(sc - m_new);
        l = l * alpha + p;
        acc = acc * alpha + p * (active ? to_float(v_pool[row * head_dim + d]) : 0.f);
        m = m_new;
    }
    if (!active) return;
    float y = 0.f;
    if (bad) y = NAN;
    else if (ctx > 0) y = acc / l;
    out[(s * num_heads + h) * head_dim + d] = from_float<T>(y);
}

// v2: blockDim.x == 128 (4 warps), head_dim <= 128; block b handles sequence b / nh, head b % nh.
template <typename T>
__global__ void paged_attention_v2_kernel(const T* __restrict__ q, const T* __restrict__ k_pool,
                                          const T* __restrict__ v_pool, const int64_t* __restrict__ block_tables,
                                          const int64_t* __restrict__ context_lens, T* __restrict__ out,
                                          int64_t num_heads, int64_t head_dim, int64_t num_blocks,
                                          int64_t block_size, int64_t max_blocks_per_seq, float scale) {
    constexpr int kWarps = 4, kDims = 4;  // warps per block; dimensions per lane at most (128 / 32)
    __shared__ float s_m[kWarps], s_l[kWarps], s_acc[kWarps][128];
    __shared__ int s_bad;
    const int64_t s = blockIdx.x / num_heads, h = blockIdx.x % num_heads;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int D = static_cast<int>(head_dim);
    const int per_lane = (D + 31) / 32;  // 1 to 4: lane owns dimensions lane * per_lane .. + per_lane - 1
    const int64_t ctx = context_lens[s];
    const int64_t* table = block_tables + s * max_blocks_per_seq;
    const bool too_long = ctx > max_blocks_per_seq * block_size;  // the table cannot hold the context
    if (threadIdx.x == 0) s_bad = too_long;
    __syncthreads();

    float qd[kDims], acc[kDims];
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
        const int d = lane * per_lane + i;
        qd[i] = i < per_lane && d < D ? to_float(q[(s * num_heads + h) * head_dim + d]) * scale : 0.f;
        acc[i] = 0.f;
    }
    // BEGIN INCLUDE paged_attention_v2_keys
    float m = -INFINITY, l = 0.f;
    for (int64_t j = warp; j < ctx && !too_long; j += kWarps) {
        const int64_t block = table[j / block_size];  // the same in every lane: the branch is warp-uniform
        if (block < 0 || block >= num_blocks) {
            s_bad = 1;  // every writer writes 1; the others read it after the barrier below
            break;
        }
        const int64_t row = ((block * block_size + j % block_size) * num_heads + h) * head_dim;  // pool row start
        float partial = 0.f;
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
            const int d = lane * per_lane + i;
            if (i < per_lane && d < D) partial += qd[i] * to_float(k_pool[row + d]);
        }
        const float score = warp_sum(partial);  // every lane: q . k_j / sqrt(D)
        const float m_new = fmaxf(m, score);
        const float alpha = expf(m - m_new);  // 0 on the warp's first key (m = -inf)
        const float p = expf(score - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int i = 0; i < kDims; ++i) {
            const int d = lane * per_lane + i;
            acc[i] = acc[i] * alpha + (i < per_lane && d < D ? p * to_float(v_pool[row + d]) : 0.f);
        }
        m = m_new;
    }
    // END INCLUDE paged_attention_v2_keys
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
        const int d = lane * per_lane + i;
        if (i < per_lane && d < D) s_acc[warp][d] = acc[i];
    }
    __syncthreads();
    // Merge the warps' states (a warp that saw no key holds (-inf, 0, 0) and contributes nothing).
    float m_all = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, s_m[w]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float y = 0.f;
        if (s_bad) {
            y = NAN;
        } else if (ctx > 0) {
            float l_all = 0.f, o = 0.f;
            for (int w = 0; w < kWarps; ++w) {
                const float r = s_m[w] == -INFINITY ? 0.f : expf(s_m[w] - m_all);
                l_all += s_l[w] * r;
                o += s_acc[w][d] * r;
            }
            y = o / l_all;
        }
        out[(s * num_heads + h) * head_dim + d] = from_float<T>(y);
    }
}

cudaError_t paged_attention_decode(int version, int dtype, const void* q, const void* k_pool, const void* v_pool,
                                   const int64_t* block_tables, const int64_t* context_lens, void* out,
                                   int64_t num_seqs, int64_t num_heads, int64_t head_dim, int64_t num_blocks,
                                   int64_t block_size, int64_t max_blocks_per_seq, cudaStream_t stream) {
    if (num_seqs <= 0 || num_heads <= 0 || head_dim <= 0) return cudaSuccess;
    if (head_dim > 128 || block_size <= 0 || num_seqs * num_heads > 2147483647LL) return cudaErrorInvalidValue;
    const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
    const unsigned blocks = static_cast<unsigned>(num_seqs * num_heads);
    MINILLM_DISPATCH(dtype, {
        const T* qt = static_cast<const T*>(q);
        const T* kp = static_cast<const T*>(k_pool);
        const T* vp = static_cast<const T*>(v_pool);
        T* yt = static_cast<T*>(out);
        if (version == 1) {
            paged_attention_v1_kernel<T><<<blocks, 128, 0, stream>>>(qt, kp, vp, block_tables, context_lens, yt,
                num_heads, head_dim, num_blocks, block_size, max_blocks_per_seq, scale);
        } else if (version == 2) {
            paged_attention_v2_kernel<T><<<blocks, 128, 0, stream>>>(qt, kp, vp, block_tables, context_lens, yt,
                num_heads, head_dim, num_blocks, block_size, max_blocks_per_seq, scale);
        } else {
            return cudaErrorInvalidValue;
        }
    });
    return cudaGetLastError();
}

}  // namespace minillm

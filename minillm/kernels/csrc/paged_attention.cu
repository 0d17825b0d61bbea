// Paged-attention decode: one query token per sequence attends to its whole context, whose K/V sit in chapter 05's
// block pools (minillm.paged.PagedKVCache: k_pool, v_pool of shape (nb, bs, nh, hs)) and are found through the
// sequence's block table (block_tables (S, max_nb) int64, -1 padded) and its length (context_lens (S,) int64).
// Token j of sequence s lives in block block_tables[s, j / bs] at offset j % bs, i.e. pool row
// slot = block * bs + j % bs (minillm.paged.compute_slot_mapping). One version:
//   v1  one thread block per (sequence, head), thread d owning dimension d; for each of the ctx keys the block
//       reduces q . k_j and folds it into an online softmax (as attention.cu v1), reading K/V in place from the
//       pool: no gather, no padding to the longest sequence (Kwon et al. 2023, section 4.1).
// A block index outside 0..nb-1 (or a context longer than the table) makes that (sequence, head) output NaN, so
// a bad table is loud instead of reading out of bounds; a context of 0 gives zeros.
// Reference twins: minillm.kernels.naive.paged_attention_decode, minillm.kernels.mirror.paged_attention_decode.
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

cudaError_t paged_attention_decode(int dtype, const void* q, const void* k_pool, const void* v_pool,
                                   const int64_t* block_tables, const int64_t* context_lens, void* out,
                                   int64_t num_seqs, int64_t num_heads, int64_t head_dim, int64_t num_blocks,
                                   int64_t block_size, int64_t max_blocks_per_seq, cudaStream_t stream) {
    if (num_seqs <= 0 || num_heads <= 0 || head_dim <= 0) return cudaSuccess;
    if (head_dim > 128 || block_size <= 0 || num_seqs * num_heads > 2147483647LL) return cudaErrorInvalidValue;
    const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
    MINILLM_DISPATCH(dtype, {
        paged_attention_v1_kernel<T><<<static_cast<unsigned>(num_seqs * num_heads), 128, 0, stream>>>(
            static_cast<const T*>(q), static_cast<const T*>(k_pool), static_cast<const T*>(v_pool), block_tables,
            context_lens, static_cast<T*>(out), num_heads, head_dim, num_blocks, block_size, max_blocks_per_seq,
            scale);
    });
    return cudaGetLastError();
}

}  // namespace minillm

// The launchers of the chapter 12 kernels: raw pointers, sizes and a stream; no torch types.
// Each returns the launch's cudaError_t (cudaGetLastError right after the launch), cudaErrorInvalidValue for a
// version or dtype code it does not know, and cudaSuccess without launching anything for an empty input.
// dtype codes: 0 float32, 1 float16, 2 bfloat16 (minillm::DType in common.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace minillm {

// softmax.cu: out[r, :] = softmax(x[r, :]) over rows x cols, versions 1..4.
cudaError_t softmax_forward(int version, int dtype, const void* x, void* out, int64_t rows, int64_t cols,
                            cudaStream_t stream);

// layernorm.cu: out = (x - mean) / sqrt(var + eps) * weight + bias per row, versions 1..4.
cudaError_t layernorm_forward(int version, int dtype, const void* x, const void* weight, const void* bias, void* out,
                              int64_t rows, int64_t cols, float eps, cudaStream_t stream);

// bias_gelu.cu: out = gelu_tanh(x + bias), bias broadcast over rows, versions 1..2.
cudaError_t bias_gelu_forward(int version, int dtype, const void* x, const void* bias, void* out, int64_t rows,
                              int64_t cols, cudaStream_t stream);

// attention.cu: causal attention, q, k, v, out (BH, T, D) contiguous, scale 1/sqrt(D), D <= 128, versions 1..4.
cudaError_t attention_forward(int version, int dtype, const void* q, const void* k, const void* v, void* out,
                              int64_t batch_heads, int64_t seq_len, int64_t head_dim, cudaStream_t stream);

// The dynamic shared memory one block of attention v3 / v4 needs for this head size (the caller checks the device
// has it).
size_t attention_v3_smem_bytes(int64_t head_dim);
size_t attention_v4_smem_bytes(int64_t head_dim);

// paged_attention.cu: one query token per sequence against its K/V in the block pools, versions 1..2.
// q, out (S, nh, hs); pools (nb, bs, nh, hs); block_tables (S, max_nb) int64; context_lens (S,) int64.
cudaError_t paged_attention_decode(int version, int dtype, const void* q, const void* k_pool, const void* v_pool,
                                   const int64_t* block_tables, const int64_t* context_lens, void* out,
                                   int64_t num_seqs, int64_t num_heads, int64_t head_dim, int64_t num_blocks,
                                   int64_t block_size, int64_t max_blocks_per_seq, cudaStream_t stream);

// int8_gemv.cu: out (M, N) = x (M, K) @ (w (N, K) int8 * scale (N,))^T + bias (N,) (bias may be null), versions 1..3.
cudaError_t int8_gemv_forward(int version, int dtype, const void* x, const int8_t* w, const void* scale,
                              const void* bias, void* out, int64_t M, int64_t N, int64_t K, cudaStream_t stream);

// kv_write.cu: pool row slot_mapping[t] <- key/value row t, slot -1 skipped, version 1.
// key, value (T, nh, hs); pools (num_slots = nb * bs, nh, hs).
cudaError_t kv_cache_write(int dtype, const void* key, const void* value, void* k_pool, void* v_pool,
                           const int64_t* slot_mapping, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                           int64_t num_slots, cudaStream_t stream);

}  // namespace minillm

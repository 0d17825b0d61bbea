// KV-cache write (the kernel behind minillm.paged.write_kv): row t of key and value, (T, nh, hs), is copied to row
// slot_mapping[t] of the pools seen as (nb * bs, nh, hs), where slot = block * bs + offset
// (minillm.paged.compute_slot_mapping). A slot of -1 (a padding token, nothing to store) is skipped, and so is any
// slot outside 0..nb*bs-1: the kernel never writes out of bounds (minillm.kernels.ops checks the slots first).
// One version:
//   v1  one thread block per token, its threads striding over the nh * hs elements of the K row and the V row.
// Reference twins: minillm.kernels.naive.kv_cache_write, minillm.kernels.mirror.kv_cache_write.
#include "common.cuh"
#include "kernels.h"

namespace minillm {

template <typename T>
__global__ void kv_write_v1_kernel(const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_pool,
                                   T* __restrict__ v_pool, const int64_t* __restrict__ slot_mapping,
                                   int64_t row_elems, int64_t num_slots) {
    const int64_t t = blockIdx.x;
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;  // -1: padding; anything else out of range: never written
    for (int64_t e = threadIdx.x; e < row_elems; e += blockDim.x) {
        k_pool[slot * row_elems + e] = key[t * row_elems + e];
        v_pool[slot * row_elems + e] = value[t * row_elems + e];
    }
}

cudaError_t kv_cache_write(int dtype, const void* key, const void* value, void* k_pool, void* v_pool,
                           const int64_t* slot_mapping, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                           int64_t num_slots, cudaStream_t stream) {
    if (num_tokens <= 0 || num_heads <= 0 || head_dim <= 0) return cudaSuccess;
    if (num_tokens > 2147483647LL) return cudaErrorInvalidValue;
    MINILLM_DISPATCH(dtype, {
        kv_write_v1_kernel<T><<<static_cast<unsigned>(num_tokens), 128, 0, stream>>>(
            static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(k_pool),
            static_cast<T*>(v_pool), slot_mapping, num_heads * head_dim, num_slots);
    });
    return cudaGetLastError();
}

}  // namespace minillm

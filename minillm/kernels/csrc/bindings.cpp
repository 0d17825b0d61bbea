// PyTorch operators for the chapter 12 kernels: torch.ops.minillm_kernels.<name>.
// The host wrappers check what a caller can get wrong (device, dtype, contiguity, shapes, version) with TORCH_CHECK
// messages that name the argument and its value, pick the current device and stream, call the plain-CUDA launcher
// (kernels.h) and turn its cudaError_t into an error naming the op. Every op writes into an `out` (or pool) tensor
// the caller allocates, so a test can poison it with NaN and see any element a kernel forgot to write.
// Registered for the CUDA dispatch key only: CPU tensors never reach these functions (the dispatcher refuses them,
// and minillm.kernels.ops says so first); check_cuda still guards a CUDA call that mixes in a CPU tensor.
// subtle: torch's operator-registration and Tensor headers, not <torch/extension.h> (all of libtorch's C++ API:
// three times the parse time, for nothing these wrappers use).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

// subtle: c10's stream header, not ATen/cuda/CUDAContext.h, which pulls in cuSPARSE/cuBLAS headers that a bare
// CUDA toolkit (nvcc alone) may not ship.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <string>

#include "kernels.h"

namespace {

// "[4, 8]": sizes and strides spelled out by hand for the error messages.
std::string dims(at::IntArrayRef values) {
    std::string text = "[";
    for (size_t i = 0; i < values.size(); ++i) {
        if (i) text += ", ";
        text += std::to_string(values[i]);
    }
    return text + "]";
}

int dtype_code(const at::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat: return 0;
        case at::kHalf: return 1;
        case at::kBFloat16: return 2;
        default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
    }
    return -1;
}

// KNOWN BUG (H200, torch 2.11+cu130, JIT build): calling an op straight through torch.ops with a non-contiguous CUDA
// tensor crashed the process (SIGSEGV) instead of raising the contiguity error below, whether the message streamed
// t.sizes() or these strings; a wrong dtype, a CPU tensor or a wrong shape raise as they should. Not yet found:
// minillm.kernels.ops rejects non-contiguous tensors in Python first, and the test that pins the crash is an xfail.
void check_cuda(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got shape ", dims(t.sizes()), " strides ", dims(t.strides()));
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
    check_cuda(t, name);
    TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have the dtype of ", ref_name, " (",
                ref.scalar_type(), "), got ", t.scalar_type());
    TORCH_CHECK(t.device() == ref.device(), name, " must be on ", ref_name, "'s device ", ref.device(), ", got ",
                t.device());
}

void check_shape(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
    TORCH_CHECK(t.sizes() == shape, name, " must have shape ", dims(shape), ", got ", dims(t.sizes()));
}

void check_version(int64_t version, int64_t num_versions, const char* op) {
    TORCH_CHECK(version >= 1 && version <= num_versions, op, ": version must be 1..", num_versions, ", got ", version);
}

void check_launch(cudaError_t err, const char* op) {
    TORCH_CHECK(err == cudaSuccess, "minillm_kernels.", op, " failed: ", cudaGetErrorString(err));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void softmax(const at::Tensor& x, const at::Tensor& out, int64_t version) {
    check_version(version, 4, "softmax");
    check_cuda(x, "x");
    const int dt = dtype_code(x, "x");
    TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, cols), got shape ", dims(x.sizes()));
    check_like(out, x, "out", "x");
    check_shape(out, x.sizes(), "out");
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(minillm::softmax_forward(static_cast<int>(version), dt, x.data_ptr(), out.data_ptr(), x.size(0),
                                          x.size(1), stream()), "softmax");
}

void layernorm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out,
               double eps, int64_t version) {
    check_version(version, 4, "layernorm");
    check_cuda(x, "x");
    const int dt = dtype_code(x, "x");
    TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, cols), got shape ", dims(x.sizes()));
    TORCH_CHECK(eps > 0, "eps must be positive, got ", eps);
    check_like(weight, x, "weight", "x");
    check_like(bias, x, "bias", "x");
    check_like(out, x, "out", "x");
    check_shape(weight, {x.size(1)}, "weight");
    check_shape(bias, {x.size(1)}, "bias");
    check_shape(out, x.sizes(), "out");
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(minillm::layernorm_forward(static_cast<int>(version), dt, x.data_ptr(), weight.data_ptr(),
                                            bias.data_ptr(), out.data_ptr(), x.size(0), x.size(1),
                                            static_cast<float>(eps), stream()), "layernorm");
}

void bias_gelu(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& out, int64_t version) {
    check_version(version, 2, "bias_gelu");
    check_cuda(x, "x");
    const int dt = dtype_code(x, "x");
    TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, cols), got shape ", dims(x.sizes()));
    check_like(bias, x, "bias", "x");
    check_like(out, x, "out", "x");
    check_shape(bias, {x.size(1)}, "bias");
    check_shape(out, x.sizes(), "out");
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(minillm::bias_gelu_forward(static_cast<int>(version), dt, x.data_ptr(), bias.data_ptr(),
                                            out.data_ptr(), x.size(0), x.size(1), stream()), "bias_gelu");
}

void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
               int64_t version) {
    check_version(version, 4, "attention");
    check_cuda(q, "q");
    const int dt = dtype_code(q, "q");
    TORCH_CHECK(q.dim() == 4, "q must be 4-D (B, nh, T, hs), got shape ", dims(q.sizes()));
    TORCH_CHECK(q.size(3) >= 1 && q.size(3) <= 128, "head size hs = q.size(3) must be 1..128, got ", q.size(3));
    check_like(k, q, "k", "q");
    check_like(v, q, "v", "q");
    check_like(out, q, "out", "q");
    check_shape(k, q.sizes(), "k");
    check_shape(v, q.sizes(), "v");
    check_shape(out, q.sizes(), "out");
    const c10::cuda::CUDAGuard guard(q.device());
    if (version >= 3) {  // v3 and v4 keep their tiles in dynamic shared memory: more than some GPUs give one block
        int device = 0, optin = 0, major = 0;
        cudaGetDevice(&device);
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
        const bool tensor_cores = version == 4 && dt != 0;  // v4 runs v3 on fp32 inputs
        TORCH_CHECK(!tensor_cores || major >= 8, "attention v4 needs bf16/fp16 tensor cores (compute capability 8.0 "
                    "or newer), this GPU is ", major, ".x; use version 3");
        const size_t need = tensor_cores ? minillm::attention_v4_smem_bytes(q.size(3))
                                         : minillm::attention_v3_smem_bytes(q.size(3));
        TORCH_CHECK(need <= static_cast<size_t>(optin), "attention v", version, " needs ", need,
                    " bytes of shared memory per block for head size ", q.size(3), ", this GPU allows ", optin,
                    "; use version 2");
    }
    check_launch(minillm::attention_forward(static_cast<int>(version), dt, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                            out.data_ptr(), q.size(0) * q.size(1), q.size(2), q.size(3), stream()),
                 "attention");
}

void paged_attention_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& out,
                            int64_t version) {
    check_version(version, 2, "paged_attention_decode");
    check_cuda(q, "q");
    const int dt = dtype_code(q, "q");
    TORCH_CHECK(q.dim() == 3, "q must be 3-D (S, nh, hs), one token per sequence, got shape ", dims(q.sizes()));
    TORCH_CHECK(q.size(2) >= 1 && q.size(2) <= 128, "head size hs = q.size(2) must be 1..128, got ", q.size(2));
    check_like(k_pool, q, "k_pool", "q");
    check_like(v_pool, q, "v_pool", "q");
    check_like(out, q, "out", "q");
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(2) == q.size(1) && k_pool.size(3) == q.size(2),
                "k_pool must be (nb, bs, nh=", q.size(1), ", hs=", q.size(2), "), got shape ", dims(k_pool.sizes()));
    TORCH_CHECK(k_pool.size(1) >= 1, "block size k_pool.size(1) must be >= 1, got ", k_pool.size(1));
    check_shape(v_pool, k_pool.sizes(), "v_pool");
    check_shape(out, q.sizes(), "out");
    check_cuda(block_tables, "block_tables");
    check_cuda(context_lens, "context_lens");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong, "block_tables must be int64, got ", block_tables.scalar_type());
    TORCH_CHECK(context_lens.scalar_type() == at::kLong, "context_lens must be int64, got ", context_lens.scalar_type());
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
                "block_tables must be (S=", q.size(0), ", max_nb), got shape ", dims(block_tables.sizes()));
    check_shape(context_lens, {q.size(0)}, "context_lens");
    TORCH_CHECK(block_tables.device() == q.device() && context_lens.device() == q.device(),
                "block_tables and context_lens must be on q's device ", q.device());
    const c10::cuda::CUDAGuard guard(q.device());
    check_launch(minillm::paged_attention_decode(static_cast<int>(version), dt, q.data_ptr(), k_pool.data_ptr(),
                                                 v_pool.data_ptr(), block_tables.data_ptr<int64_t>(),
                                                 context_lens.data_ptr<int64_t>(), out.data_ptr(), q.size(0),
                                                 q.size(1), q.size(2), k_pool.size(0), k_pool.size(1),
                                                 block_tables.size(1), stream()),
                 "paged_attention_decode");
}

void int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
               const at::Tensor& out, int64_t version) {
    check_version(version, 3, "int8_gemv");
    check_cuda(x, "x");
    const int dt = dtype_code(x, "x");
    TORCH_CHECK(x.dim() == 2, "x must be 2-D (M, K), got shape ", dims(x.sizes()));
    check_cuda(w, "w");
    TORCH_CHECK(w.scalar_type() == at::kChar, "w must be int8, got ", w.scalar_type());
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "w must be (N, K=", x.size(1), "), got shape ", dims(w.sizes()));
    TORCH_CHECK(w.device() == x.device(), "w must be on x's device ", x.device(), ", got ", w.device());
    check_like(scale, x, "scale", "x");
    check_shape(scale, {w.size(0)}, "scale");
    const void* bias_ptr = nullptr;
    if (bias.has_value()) {
        check_like(*bias, x, "bias", "x");
        check_shape(*bias, {w.size(0)}, "bias");
        bias_ptr = bias->data_ptr();
    }
    check_like(out, x, "out", "x");
    check_shape(out, {x.size(0), w.size(0)}, "out");
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(minillm::int8_gemv_forward(static_cast<int>(version), dt, x.data_ptr(), w.data_ptr<int8_t>(),
                                            scale.data_ptr(), bias_ptr, out.data_ptr(), x.size(0), w.size(0),
                                            x.size(1), stream()), "int8_gemv");
}

void kv_cache_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_pool,
                    const at::Tensor& v_pool, const at::Tensor& slot_mapping) {
    check_cuda(key, "key");
    const int dt = dtype_code(key, "key");
    TORCH_CHECK(key.dim() == 3, "key must be 3-D (T, nh, hs), got shape ", dims(key.sizes()));
    check_like(value, key, "value", "key");
    check_shape(value, key.sizes(), "value");
    check_like(k_pool, key, "k_pool", "key");
    check_like(v_pool, key, "v_pool", "key");
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(2) == key.size(1) && k_pool.size(3) == key.size(2),
                "k_pool must be (nb, bs, nh=", key.size(1), ", hs=", key.size(2), "), got shape ", dims(k_pool.sizes()));
    check_shape(v_pool, k_pool.sizes(), "v_pool");
    check_cuda(slot_mapping, "slot_mapping");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ", slot_mapping.scalar_type());
    check_shape(slot_mapping, {key.size(0)}, "slot_mapping");
    TORCH_CHECK(slot_mapping.device() == key.device(), "slot_mapping must be on key's device ", key.device());
    const c10::cuda::CUDAGuard guard(key.device());
    check_launch(minillm::kv_cache_write(dt, key.data_ptr(), value.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                                         slot_mapping.data_ptr<int64_t>(), key.size(0), key.size(1), key.size(2),
                                         k_pool.size(0) * k_pool.size(1), stream()), "kv_cache_write");
}

}  // namespace

TORCH_LIBRARY(minillm_kernels, m) {
    m.def("softmax(Tensor x, Tensor(a!) out, int version) -> ()");
    m.def("layernorm(Tensor x, Tensor weight, Tensor bias, Tensor(a!) out, float eps, int version) -> ()");
    m.def("bias_gelu(Tensor x, Tensor bias, Tensor(a!) out, int version) -> ()");
    m.def("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int version) -> ()");
    m.def("paged_attention_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
          "Tensor context_lens, Tensor(a!) out, int version) -> ()");
    m.def("int8_gemv(Tensor x, Tensor w, Tensor scale, Tensor? bias, Tensor(a!) out, int version) -> ()");
    m.def("kv_cache_write(Tensor key, Tensor value, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(minillm_kernels, CUDA, m) {
    m.impl("softmax", &softmax);
    m.impl("layernorm", &layernorm);
    m.impl("bias_gelu", &bias_gelu);
    m.impl("attention", &attention);
    m.impl("paged_attention_decode", &paged_attention_decode);
    m.impl("int8_gemv", &int8_gemv);
    m.impl("kv_cache_write", &kv_cache_write);
}

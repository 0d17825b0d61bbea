// The CPU emulator's scheduler (emu.h): runs every block of a grid as fibers, one block at a time, and the C entry
// points minillm.kernels.emulator calls through ctypes (one per kernel launcher in kernels.h).
#include <algorithm>
#include <cstdio>

#include "cuda_runtime.h"
#include "kernels.h"

namespace emu {

namespace {

constexpr size_t kStackBytes = 256 * 1024;   // per fiber: the kernels keep a few hundred floats in "registers"
constexpr unsigned kMaxThreads = 1024;        // per block, as on every CUDA GPU since Fermi
constexpr size_t kMaxDynamicSmem = 227 * 1024;  // an H100/H200's opt-in limit per block

[[noreturn]] void fiber_main() {
    State& s = state();
    s.body();
    Fiber& f = self();
    f.done = true;
    ++s.events;
    const unsigned tid = linear_thread_id();
    leave(s.block_barrier);
    leave(s.warp_barriers[tid / 32]);
    _longjmp(s.scheduler, 1);  // never return: uc_link would resume a stale scheduler context
}

}  // namespace

State& state() {
    static State s;
    return s;
}

int take_error() {
    const int err = state().error;
    state().error = 0;
    return err;
}

const char* error_string(int err) {
    switch (err) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorLaunchFailure: return "unspecified launch failure (emulator: threads wait at a barrier others never reach)";
        case cudaErrorInvalidConfiguration: return "invalid configuration argument";
        default: return "unknown error";
    }
}

void run_grid(dim3 grid, dim3 block, size_t dynamic_smem_bytes) {
    State& s = state();
    const unsigned nthreads = block.x * block.y * block.z;
    if (nthreads == 0 || nthreads > kMaxThreads || grid.x * grid.y * grid.z == 0 ||
        dynamic_smem_bytes > kMaxDynamicSmem) {
        s.error = cudaErrorInvalidConfiguration;
        return;
    }
    s.grid_dim = grid;
    s.block_dim = block;
    s.fibers.resize(nthreads);
    for (Fiber& f : s.fibers)
        if (!f.stack) f.stack.reset(new char[kStackBytes]);
    s.shuffle_slots.assign(nthreads, 0);
    const unsigned nwarps = (nthreads + 31) / 32;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                s.block_idx = dim3(bx, by, bz);
                s.dynamic_smem.assign(dynamic_smem_bytes + 128, 0xFF);  // unwritten shared memory reads as NaN
                                                                         // (+128: room to align the start)
                s.block_barrier = Barrier{static_cast<int>(nthreads), 0, 0};
                s.warp_barriers.assign(nwarps, Barrier{});
                for (unsigned w = 0; w < nwarps; ++w)
                    s.warp_barriers[w].expected = static_cast<int>(std::min(32u, nthreads - 32 * w));
                for (unsigned t = 0; t < nthreads; ++t) {
                    Fiber& f = s.fibers[t];
                    f.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                    f.done = false;
                    f.started = false;
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = f.stack.get();
                    f.context.uc_stack.ss_size = kStackBytes;
                    f.context.uc_link = nullptr;
                    makecontext(&f.context, reinterpret_cast<void (*)()>(fiber_main), 0);
                }
                unsigned live = nthreads;
                while (live > 0) {
                    const uint64_t events_before = s.events;
                    live = 0;
                    for (unsigned i = 0; i < nthreads; ++i) {
                        const unsigned t = s.reverse ? nthreads - 1 - i : i;
                        if (s.fibers[t].done) continue;
                        s.current = static_cast<int>(t);
                        Fiber& f = s.fibers[t];
                        if (!_setjmp(s.scheduler)) {  // returns again, with 1, when the fiber yields or finishes
                            if (!f.started) {
                                f.started = true;
                                setcontext(&f.context);
                            }
                            _longjmp(f.resume, 1);
                        }
                        live += f.done ? 0 : 1;
                    }
                    if (live > 0 && s.events == events_before) {  // everyone waits, nobody arrives: deadlock
                        s.error = cudaErrorLaunchFailure;
                        s.current = -1;
                        return;
                    }
                }
                s.current = -1;
            }
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------- C entry points
// Each returns the launcher's cudaError_t as an int (0 = success); stream arguments are null.
extern "C" {

void emu_set_reverse(int reverse) { emu::state().reverse = reverse != 0; }

const char* emu_error_string(int err) { return emu::error_string(err); }

int emu_softmax(int version, int dtype, const void* x, void* out, int64_t rows, int64_t cols) {
    return minillm::softmax_forward(version, dtype, x, out, rows, cols, nullptr);
}

int emu_layernorm(int version, int dtype, const void* x, const void* w, const void* b, void* out, int64_t rows,
                  int64_t cols, float eps) {
    return minillm::layernorm_forward(version, dtype, x, w, b, out, rows, cols, eps, nullptr);
}

int emu_bias_gelu(int version, int dtype, const void* x, const void* bias, void* out, int64_t rows, int64_t cols) {
    return minillm::bias_gelu_forward(version, dtype, x, bias, out, rows, cols, nullptr);
}

int emu_attention(int version, int dtype, const void* q, const void* k, const void* v, void* out,
                  int64_t batch_heads, int64_t seq_len, int64_t head_dim) {
    return minillm::attention_forward(version, dtype, q, k, v, out, batch_heads, seq_len, head_dim, nullptr);
}

int emu_paged_attention_decode(int version, int dtype, const void* q, const void* k_pool, const void* v_pool,
                               const int64_t* block_tables, const int64_t* context_lens, void* out, int64_t num_seqs,
                               int64_t num_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                               int64_t max_blocks_per_seq) {
    return minillm::paged_attention_decode(version, dtype, q, k_pool, v_pool, block_tables, context_lens, out, num_seqs,
                                           num_heads, head_dim, num_blocks, block_size, max_blocks_per_seq, nullptr);
}

int emu_int8_gemv(int version, int dtype, const void* x, const int8_t* w, const void* scale, const void* bias,
                  void* out, int64_t M, int64_t N, int64_t K) {
    return minillm::int8_gemv_forward(version, dtype, x, w, scale, bias, out, M, N, K, nullptr);
}

int emu_kv_cache_write(int dtype, const void* key, const void* value, void* k_pool, void* v_pool,
                       const int64_t* slot_mapping, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                       int64_t num_slots) {
    return minillm::kv_cache_write(dtype, key, value, k_pool, v_pool, slot_mapping, num_tokens, num_heads, head_dim,
                                   num_slots, nullptr);
}

}  // extern "C"

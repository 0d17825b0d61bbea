// CUDA's thread model on a CPU, for the chapter 12 kernels: every CUDA thread of a block is a fiber (a ucontext with
// its own stack, switched with _setjmp/_longjmp, which unlike swapcontext make no system call), and one OS thread
// runs them in turn. A fiber runs until it reaches a barrier (__syncthreads, or the
// exchange inside __shfl_xor_sync) and then yields to the next; a barrier opens when every thread of the block (or
// of the warp) still running has arrived, exactly the rule the kernels rely on. Blocks run one after another, so a
// __shared__ array (a static here) belongs to one block at a time, and dynamic shared memory starts as 0xFF bytes
// (NaN as floats) so that a read before a write shows.
// What it checks: each kernel's indexing, its tiles, its reductions and where it synchronizes. The fibers can run
// in forward or reverse order, so a missing barrier usually gives a wrong answer in one of the two; a barrier that
// some threads never reach is reported as a launch failure instead of hanging. What it leaves out: speed, real
// concurrency (data races that no ordering shows), warp-synchronous code without shuffles, and the memory model.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

// Threads still running must all arrive before a barrier opens; a thread that returns leaves every barrier it
// belonged to (on a GPU an exited thread no longer counts for __syncthreads either).
struct Barrier {
    int expected = 0;
    int arrived = 0;
    uint64_t generation = 0;
};

struct Fiber {
    ucontext_t context;  // only to start the fiber on its own stack
    jmp_buf resume;      // where it yielded
    std::unique_ptr<char[]> stack;
    dim3 thread_idx;
    bool started = false;
    bool done = false;
};

struct State {
    std::vector<Fiber> fibers;
    Barrier block_barrier;
    std::vector<Barrier> warp_barriers;
    std::vector<uint64_t> shuffle_slots;  // one per thread: the value it offers in a shuffle
    std::vector<unsigned char> dynamic_smem;
    jmp_buf scheduler;  // where a yielding (or finishing) fiber returns to
    int current = -1;
    uint64_t events = 0;  // arrivals and exits: a round of the scheduler without any is a deadlock
    bool reverse = false;
    int error = 0;
    std::function<void()> body;
    dim3 block_idx, block_dim, grid_dim;
};

State& state();  // one per process (emu_runtime.cpp)
int take_error();
const char* error_string(int err);

inline Fiber& self() { return state().fibers[state().current]; }
inline void yield() {
    if (!_setjmp(self().resume)) _longjmp(state().scheduler, 1);
}

inline void release(Barrier& b) {
    b.arrived = 0;
    ++b.generation;
}

// Arrive at b and wait until it opens.
inline void arrive(Barrier& b) {
    ++state().events;
    if (++b.arrived == b.expected) {
        release(b);
        return;
    }
    const uint64_t generation = b.generation;
    while (b.generation == generation) yield();
}

inline void leave(Barrier& b) {
    --b.expected;
    if (b.arrived > 0 && b.arrived == b.expected) release(b);
}

inline unsigned linear_thread_id() {
    const dim3& t = self().thread_idx;
    const dim3& d = state().block_dim;
    return t.x + d.x * (t.y + d.y * t.z);
}

// 128-byte aligned, as a GPU's dynamic shared memory is at least (wmma tiles need 32 bytes).
inline unsigned char* dynamic_shared_memory() {
    const uintptr_t base = reinterpret_cast<uintptr_t>(state().dynamic_smem.data());
    return reinterpret_cast<unsigned char*>((base + 127) & ~uintptr_t{127});
}

// Runs body once per thread for every block of the grid; errors go to take_error().
void run_grid(dim3 grid, dim3 block, size_t dynamic_smem_bytes);

struct LaunchConfig {  // what <<<grid, block, smem, stream>>> holds
    dim3 grid, block;
    size_t smem;
    LaunchConfig(dim3 g, dim3 b, size_t s = 0, void* = nullptr) : grid(g), block(b), smem(s) {}
};

// kernel<<<c>>>(args...): the arguments converted to the kernel's parameter types once, then every thread runs it.
template <typename... Params, typename... Args>
void launch(const LaunchConfig& c, void (*kernel)(Params...), Args&&... args) {
    std::tuple<Params...> bound(static_cast<Params>(std::forward<Args>(args))...);
    state().body = [&bound, kernel] { std::apply(kernel, bound); };
    run_grid(c.grid, c.block, c.smem);
    state().body = nullptr;
}

}  // namespace emu

#define threadIdx (::emu::self().thread_idx)
#define blockIdx (::emu::state().block_idx)
#define blockDim (::emu::state().block_dim)
#define gridDim (::emu::state().grid_dim)

inline void __syncthreads() { ::emu::arrive(::emu::state().block_barrier); }

// Every lane of the warp waits for the others (the mask is taken to be the whole warp, as the kernels use it).
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
    ::emu::arrive(::emu::state().warp_barriers[::emu::linear_thread_id() / 32]);
}

// lane i receives lane (i ^ offset)'s value; every lane of the warp must take part, as the kernels' full mask says.
template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T value, int offset) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a value wider than 64 bits");
    ::emu::State& s = ::emu::state();
    const unsigned tid = ::emu::linear_thread_id(), warp = tid / 32, lane = tid % 32;
    ::emu::Barrier& b = s.warp_barriers[warp];
    std::memcpy(&s.shuffle_slots[tid], &value, sizeof(T));
    ::emu::arrive(b);  // every lane has offered its value
    T out;
    std::memcpy(&out, &s.shuffle_slots[warp * 32 + (lane ^ static_cast<unsigned>(offset))], sizeof(T));
    ::emu::arrive(b);  // every lane has read before any slot is written again
    return out;
}

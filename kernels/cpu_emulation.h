// cpu_emulation.h: run minipaged's CUDA kernels on a CPU, one thread at a time.
//
// What TRITON_INTERPRET=1 is to the Triton kernels, this is to the CUDA ones: with
// MINIPAGED_CUDA_EMULATE=1, minipaged compiles kernels/*.cu with the host compiler
// against this header and runs them on CPU tensors, so that the tests check the very
// source the GPU runs, on machines that have no GPU.  minipaged/ops/cuda_build.py
// includes it first in each kernel file and rewrites every launch
// `kernel<<<grid, block, shared_bytes, stream>>>(args)` into
// `::emu::launch(kernel, grid, block, shared_bytes, stream, args)`.
//
// Each CUDA thread of a thread block runs as a fiber: one runs until it reaches a
// barrier, then the next.  A fiber starts on its own stack with ucontext, then switches
// with _setjmp/_longjmp: swapcontext makes a system call (the signal mask) per switch,
// and a kernel's shuffles and barriers switch millions of times.  __syncthreads() waits for the thread block, a warp
// shuffle for the warp, so the kernels' synchronisation is exercised for real: a thread
// reading shared memory another thread has not written yet sees it unwritten (dynamic
// shared memory starts as NaN), and threads that wait at different barriers are a
// reported deadlock rather than a hang.  Thread blocks run one after another, so a
// __shared__ variable (a static here) belongs to the running block.  What this cannot
// show: speed, races between thread blocks, and the GPU's memory model.
#pragma once

// glibc's fortified longjmp takes a jump to another stack (the next fiber's) for stack
// smashing and aborts; this header comes first in every emulated file, before features.h.
#undef _FORTIFY_SOURCE

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#define MINIPAGED_CPU_EMULATION 1
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#ifndef __device__
#define __device__
#endif
#ifndef __host__
#define __host__
#endif

using std::max;
using std::min;

// The CUDA headers bring the runtime's types (dim3, float4, cudaStream_t, cudaError_t and
// the attribute enums); the few runtime calls the launchers make are defined here.
constexpr int EMULATED_SHARED_MEMORY = 227 * 1024;  // an H100's opt-in limit per block
namespace emu {
// A thread's failure, which its launch reports (cudaGetLastError) as a GPU's launch
// reports a __trap(): the first one, until it is read.
struct Failure {
  const char* pending = nullptr;
  const char* reported = "no error";
};
inline Failure& failure() {
  static Failure f;
  return f;
}
}  // namespace emu
// A kernel thread fails its launch with message `what`, and goes on (a GPU's thread
// would stop).  Lesson 08's exercise stub says "not implemented" with it.
inline void emulated_trap(const char* what) {
  if (!::emu::failure().pending) ::emu::failure().pending = what;
}
inline cudaError_t cudaGetLastError() {
  ::emu::Failure& f = ::emu::failure();
  if (!f.pending) return cudaSuccess;
  f.reported = f.pending;
  f.pending = nullptr;
  return cudaErrorLaunchFailure;
}
inline const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : ::emu::failure().reported;
}
inline cudaError_t cudaGetDevice(int* device) { return *device = 0, cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  return *value = EMULATED_SHARED_MEMORY, cudaSuccess;
}
template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int) { return cudaSuccess; }

namespace emu {

constexpr int WARP = 32;
constexpr size_t STACK_BYTES = 256 * 1024;

struct Barrier {
  int arrived = 0;
  unsigned generation = 0;
};

struct Fiber {
  ucontext_t start;  // to enter run_fiber on the fiber's own stack, once
  jmp_buf resume;    // where it waits, once started
  dim3 thread_idx;
  bool started = false, done = false;
};

// Everything about the thread block being run.
struct Block {
  dim3 grid, block, block_idx;
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  int current = 0, num_threads = 0;
  jmp_buf scheduler;
  const std::function<void()>* body = nullptr;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<uint64_t> lanes;  // a slot per thread for the value a shuffle exchanges
  std::vector<float> shared;    // dynamic shared memory
  uint64_t events = 0;          // arrivals and exits: no new event in a round = deadlock
};

inline Block& block() {
  static Block state;
  return state;
}

inline int thread_rank() {
  const Block& b = block();
  const dim3& t = b.fibers[b.current].thread_idx;
  return t.x + b.block.x * (t.y + b.block.y * t.z);
}

inline void yield() {
  Block& b = block();
  if (!_setjmp(b.fibers[b.current].resume)) _longjmp(b.scheduler, 1);
}

// Wait until `count` threads have arrived at barrier `bar`.
inline void wait(Barrier& bar, int count) {
  Block& b = block();
  ++b.events;
  const unsigned generation = bar.generation;
  if (++bar.arrived == count) {
    bar.arrived = 0;
    ++bar.generation;
    return;
  }
  while (bar.generation == generation) yield();
}

inline int warp_threads(int warp) {
  return std::min(WARP, block().num_threads - warp * WARP);
}

inline void run_fiber() {
  Block& b = block();
  (*b.body)();
  b.fibers[b.current].done = true;
  ++b.events;
  _longjmp(b.scheduler, 1);  // never returns: there is no context to return to
}

// Run fiber i until it yields or ends.
inline void switch_to(int i) {
  Block& b = block();
  Fiber& f = b.fibers[i];
  b.current = i;
  if (_setjmp(b.scheduler)) return;  // back from the fiber
  if (f.started) _longjmp(f.resume, 1);
  f.started = true;
  setcontext(&f.start);
}

// Run every thread of the current block to completion.
inline void run_block() {
  Block& b = block();
  for (int i = 0; i < b.num_threads; ++i) {
    Fiber& f = b.fibers[i];
    f.started = f.done = false;
    f.thread_idx = dim3(i % b.block.x, i / b.block.x % b.block.y, i / (b.block.x * b.block.y));
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = b.stacks[i].get();
    f.start.uc_stack.ss_size = STACK_BYTES;
    f.start.uc_link = nullptr;
    makecontext(&f.start, run_fiber, 0);
  }
  for (int live = b.num_threads; live > 0;) {
    const uint64_t events = b.events;
    live = 0;
    for (int i = 0; i < b.num_threads; ++i) {
      if (b.fibers[i].done) continue;
      switch_to(i);
      live += !b.fibers[i].done;
    }
    if (live > 0 && b.events == events)
      throw std::runtime_error("emulated kernel deadlocked: its threads wait at different "
                               "barriers, or some exited while others wait at one");
  }
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 threads, size_t shared_bytes,
            cudaStream_t, const Args&... args) {
  Block& b = block();
  const std::function<void()> body = [&] { kernel(args...); };
  b.grid = grid;
  b.block = threads;
  b.body = &body;
  b.num_threads = threads.x * threads.y * threads.z;
  b.fibers.resize(b.num_threads);
  while (b.stacks.size() < size_t(b.num_threads))
    b.stacks.emplace_back(new char[STACK_BYTES]);
  b.warp_barriers.assign((b.num_threads + WARP - 1) / WARP, Barrier{});
  b.block_barrier = Barrier{};
  b.lanes.resize(b.num_threads);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.block_idx = dim3(x, y, z);
        b.shared.assign((shared_bytes + sizeof(float) - 1) / sizeof(float), NAN);
        run_block();
      }
}

// A value from lane `source(lane)` of the same warp, for every lane at once.
template <typename T, typename Source>
T exchange(T value, Source source) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffles move at most 8 bytes");
  Block& b = block();
  const int rank = thread_rank(), warp = rank / WARP, lane = rank % WARP;
  std::memcpy(&b.lanes[rank], &value, sizeof(T));
  wait(b.warp_barriers[warp], warp_threads(warp));
  T result;
  std::memcpy(&result, &b.lanes[warp * WARP + source(lane)], sizeof(T));
  wait(b.warp_barriers[warp], warp_threads(warp));  // nobody overwrites a slot unread
  return result;
}

}  // namespace emu

#define threadIdx (::emu::block().fibers[::emu::block().current].thread_idx)
#define blockIdx (::emu::block().block_idx)
#define blockDim (::emu::block().block)
#define gridDim (::emu::block().grid)

inline void __syncthreads() {
  emu::wait(emu::block().block_barrier, emu::block().num_threads);
}

inline int __ffs(int x) { return __builtin_ffs(x); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return emu::exchange(value, [&](int lane) { return lane ^ lane_mask; });
}

namespace minipaged {
inline float* dynamic_shared_floats() { return emu::block().shared.data(); }
}  // namespace minipaged

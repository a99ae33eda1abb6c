// common.cuh: what every minipaged kernel shares.
//
// - element types: fp32, fp16 and bf16, each read as float (all arithmetic is fp32);
//   a quantized cache's bytes (fp8 e4m3 / e5m2, int8) read as float too, to be scaled;
// - wide loads: a thread reads up to 16 bytes of consecutive elements at once;
// - reductions: across a few lanes, a warp, or a whole thread block;
// - dispatch: from a run-time dtype, head_dim and block_size to the template instance.
//
// Nothing here includes torch: `nvcc -c` compiles every kernel file on its own.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "minipaged_kernels.h"

namespace minipaged {

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// A quantized cache's byte as the number it stores, before its scale (kv_quant.py):
// cuda_fp8.h converts fp8 exactly (in hardware on sm_89+, bit arithmetic before).
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(int8_t x) { return static_cast<float>(x); }

// A cache element type of one byte is quantized: element x means x * its slot's scale.
template <typename C>
constexpr bool is_quantized = sizeof(C) == 1;

// The dequantization scale of KV head `kv_head` at slot `slot` of physical block
// `block`, read from `scale` as laid out in `cache` (strides 0 for fp8's one scale per
// layer); 1, and nothing read, for a cache in the query's dtype.
template <typename C>
__device__ __forceinline__ float slot_scale(const float* scale, const CacheView& cache,
                                            int block, int slot, int kv_head) {
  if constexpr (is_quantized<C>)
    return scale[block * cache.scale_block_stride + slot * cache.scale_slot_stride +
                 kv_head * cache.scale_head_stride];
  else
    return 1.f;
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The dynamic shared memory of the running thread block, its size set at launch.
// (The CPU emulator that runs these kernels in the tests brings its own.)
#ifndef MINIPAGED_CPU_EMULATION
__device__ __forceinline__ float* dynamic_shared_floats() {
  extern __shared__ float4 dynamic_shared[];  // float4: 16-byte aligned
  return reinterpret_cast<float*>(dynamic_shared);
}
#endif

// N consecutive elements as one aligned value, so that a single load instruction of
// N * sizeof(T) bytes (at most 16) fetches them all.
template <typename T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};

// Read N consecutive elements at `src` (aligned to N * sizeof(T) bytes) as floats.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* src, float (&dst)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = to_float(pack.v[i]);
}

// Sum over aligned groups of LANES consecutive lanes (a power of two, at most a warp):
// after log2(LANES) butterfly steps every lane of the group holds the group's total.
template <int LANES>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int mask = LANES / 2; mask >= 1; mask /= 2) x += __shfl_xor_sync(FULL_MASK, x, mask);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= 1; mask /= 2)
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, mask));
  return x;
}

// Reduce N values per thread over the whole thread block, for every thread to read.
// Shuffles reduce within each warp, then each warp's lane 0 leaves its result in
// `scratch` (NUM_WARPS * N floats of shared memory) for every thread to fold.
template <int NUM_WARPS, int N, bool IS_MAX>
__device__ __forceinline__ void block_reduce(float (&x)[N], float* scratch) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    x[i] = IS_MAX ? warp_max(x[i]) : group_sum<WARP_SIZE>(x[i]);
    if (lane == 0) scratch[warp * N + i] = x[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    x[i] = scratch[i];
    for (int w = 1; w < NUM_WARPS; ++w)
      x[i] = IS_MAX ? fmaxf(x[i], scratch[w * N + i]) : x[i] + scratch[w * N + i];
  }
  __syncthreads();  // scratch may be written again right after
}

// ---- dispatch: one template instance per supported (dtype, cache dtype, head_dim,
//      block_size) ----
//
// A build for one configuration (minipaged/ops/cuda_build.py builds what the engine
// launches, and the rest on demand) compiles only its instances: -DMINIPAGED_ONLY_DTYPE
// (a DType code), -DMINIPAGED_ONLY_CACHE_DTYPE, -DMINIPAGED_ONLY_HEAD_DIM and
// -DMINIPAGED_ONLY_BLOCK_SIZE leave every other case out of the switches below, and a
// launch that would need one is refused.  Left unset, every case is built.
#ifndef MINIPAGED_ONLY_DTYPE
#define MINIPAGED_ONLY_DTYPE -1
#endif
#ifndef MINIPAGED_ONLY_CACHE_DTYPE
#define MINIPAGED_ONLY_CACHE_DTYPE -1
#endif
#ifndef MINIPAGED_ONLY_HEAD_DIM
#define MINIPAGED_ONLY_HEAD_DIM -1
#endif
#ifndef MINIPAGED_ONLY_BLOCK_SIZE
#define MINIPAGED_ONLY_BLOCK_SIZE -1
#endif

// Whether value is built, where `only` is -1 (all) or the one value built.
constexpr bool built(int only, int value) { return only < 0 || only == value; }
constexpr bool built(int only, DType value) { return built(only, static_cast<int>(value)); }

[[noreturn]] inline void refuse(const std::string& what, int value, const char* supported) {
  throw std::invalid_argument(what + " must be " + supported + " for the CUDA kernels, and " +
                              "built into this module, got " + std::to_string(value));
}

template <typename T> struct TypeTag { using type = T; };
template <int N> struct IntTag { static constexpr int value = N; };

// Call fn(TypeTag<T>{}) with the element type that `dtype` names.  (A case's call sits
// in `if constexpr`: left out of the build, it is never instantiated.)
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  constexpr int only = MINIPAGED_ONLY_DTYPE;
  switch (dtype) {
    case DType::kFloat32:
      if constexpr (built(only, DType::kFloat32)) return fn(TypeTag<float>{});
      break;
    case DType::kFloat16:
      if constexpr (built(only, DType::kFloat16)) return fn(TypeTag<__half>{});
      break;
    case DType::kBFloat16:
      if constexpr (built(only, DType::kBFloat16)) return fn(TypeTag<__nv_bfloat16>{});
      break;
    default: break;
  }
  refuse("dtype code", static_cast<int>(dtype), "float32, float16 or bfloat16 (0, 1, 2)");
}

// Call fn(TypeTag<T>{}, TypeTag<C>{}): the query's element type and the cache's, which
// is the same or a quantized one.
template <typename Fn>
void dispatch_cache_dtype(DType dtype, DType cache_dtype, Fn&& fn) {
  constexpr int only = MINIPAGED_ONLY_CACHE_DTYPE;
  dispatch_dtype(dtype, [&](auto type) {
    if (cache_dtype == dtype) {
      if constexpr (only < 0 || only <= static_cast<int>(DType::kBFloat16)) return fn(type, type);
    }
#ifndef MINIPAGED_NATIVE_CACHE_ONLY  // a quarter of the instances (lesson 08's compile check)
    switch (cache_dtype) {
      case DType::kFloat8E4M3:
        if constexpr (built(only, DType::kFloat8E4M3)) return fn(type, TypeTag<__nv_fp8_e4m3>{});
        break;
      case DType::kFloat8E5M2:
        if constexpr (built(only, DType::kFloat8E5M2)) return fn(type, TypeTag<__nv_fp8_e5m2>{});
        break;
      case DType::kInt8:
        if constexpr (built(only, DType::kInt8)) return fn(type, TypeTag<int8_t>{});
        break;
      default: break;
    }
#endif
    refuse("the cache's dtype code", static_cast<int>(cache_dtype),
           "the query's dtype, fp8 or int8 (3, 4, 5)");
  });
}

// Call fn(IntTag<HEAD_DIM>{}): the head sizes the attention kernels are compiled for.
template <typename Fn>
void dispatch_head_dim(int head_dim, Fn&& fn) {
  constexpr int only = MINIPAGED_ONLY_HEAD_DIM;
  switch (head_dim) {
    case 64:
      if constexpr (built(only, 64)) return fn(IntTag<64>{});
      break;
    case 128:
      if constexpr (built(only, 128)) return fn(IntTag<128>{});
      break;
  }
  refuse("head_dim", head_dim, "64 or 128");
}

// Call fn(IntTag<HEAD_DIM>{}, IntTag<BLOCK_SIZE>{}): the shapes versions 1 and 2 are
// compiled for.  Both fix register arrays and loop trip counts, so they must be known
// at compile time; each pair costs one more instance of every kernel.
template <typename Fn>
void dispatch_shape(int head_dim, int block_size, Fn&& fn) {
  constexpr int only = MINIPAGED_ONLY_BLOCK_SIZE;
  dispatch_head_dim(head_dim, [&](auto d) {
    switch (block_size) {
      case 8:
        if constexpr (built(only, 8)) return fn(d, IntTag<8>{});
        break;
      case 16:
        if constexpr (built(only, 16)) return fn(d, IntTag<16>{});
        break;
      case 32:
        if constexpr (built(only, 32)) return fn(d, IntTag<32>{});
        break;
    }
    refuse("block_size", block_size, "8, 16 or 32");
  });
}

// ---- host side of a launch ----

// Raise what the last launch got wrong (a bad configuration, not yet a fault in a kernel).
inline void check_launch(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess)
    throw std::runtime_error(std::string(kernel) + " failed to launch: " +
                             cudaGetErrorString(error));
}

// A thread block may use more than 48 KiB of dynamic shared memory only if asked first.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(bytes));
}

}  // namespace minipaged

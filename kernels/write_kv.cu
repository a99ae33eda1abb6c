// write_kv.cu: store the new tokens' keys and values in their cache slots (paper §4.3).
//
// One thread block per token: slot_mapping gives the slot, slot / block_size the
// physical block and slot % block_size the row in it, where the token's num_kv_heads
// x head_dim keys (and values) go.  The threads copy them element by element, neighbours
// on neighbouring elements, so each warp's reads and writes coalesce.  A slot of -1
// marks a token whose K/V is not to be kept: its thread block returns at once.
//
// Validate (CPU emulator or GPU) and compile-check it:
//   pytest tests/test_ops_cuda.py -k write_kv
//   nvcc -c -std=c++17 -arch=sm_90 -Xptxas -v kernels/write_kv.cu -o /tmp/write_kv.o
#include "common.cuh"

namespace minipaged {

template <typename T>
__global__ void write_kv_kernel(const WriteKVParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const CacheView& cache = p.cache;
  const int64_t row = (slot / cache.block_size) * cache.block_stride +
                      (slot % cache.block_size) * cache.token_stride;
  T* key_cache = static_cast<T*>(const_cast<void*>(cache.key)) + row;
  T* value_cache = static_cast<T*>(const_cast<void*>(cache.value)) + row;
  const T* key = static_cast<const T*>(p.key) + token * p.key_token_stride;
  const T* value = static_cast<const T*>(p.value) + token * p.value_token_stride;
  for (int e = threadIdx.x; e < cache.num_kv_heads * cache.head_dim; e += blockDim.x) {
    const int h = e / cache.head_dim, d = e % cache.head_dim;
    key_cache[h * cache.head_stride + d] = key[h * p.key_head_stride + d];
    value_cache[h * cache.head_stride + d] = value[h * p.value_head_stride + d];
  }
}

void write_kv(const WriteKVParams& p, DType dtype, void* stream) {
  if (p.num_tokens == 0) return;
  const int elements = p.cache.num_kv_heads * p.cache.head_dim;
  const int threads = elements < 256 ? (elements + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE : 256;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(dtype, [&](auto type) {
    auto kernel = write_kv_kernel<typename decltype(type)::type>;
    kernel<<<p.num_tokens, threads, 0, s>>>(p);
  });
  check_launch("write_kv_kernel");
}

}  // namespace minipaged

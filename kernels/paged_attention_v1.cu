// paged_attention_v1.cu: decode attention, one thread block per (sequence, KV head).
//
// Version 1 is the paper's kernel (§5.1): the grid is (KV heads x group slices, batch),
// and each thread block walks its sequence's whole block table once (attend() in
// paged_attention.cuh), holding every logit in shared memory until the softmax is done.
//
// Why it is fast: a key or value row is read from memory once, by one thread group,
// with 16-byte loads, and serves every query head of its GQA group.  Why it is not
// always enough: a batch of 1-4 long sequences launches only batch x KV-heads thread
// blocks, far fewer than an H100's 132 multiprocessors can run, and shared memory
// (one float per token per query head) caps the context.  Version 2 lifts both.
//
// Validate (CPU emulator or GPU), time (GPU), and see registers and spills:
//   pytest tests/test_ops_cuda.py -k "version or v1"
//   minipaged bench attention --ops decode --backends cuda-v0 cuda-v1 cuda-v2
//   nvcc -c -std=c++17 -arch=sm_90 -Xptxas -v kernels/paged_attention_v1.cu -o /tmp/v1.o
#include "paged_attention.cuh"

namespace minipaged {

template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v1_kernel(const DecodeParams p) {
  const int seq = blockIdx.y;
  const QuerySlice qs = query_slice(p);
  T* out = static_cast<T*>(p.out) + (int64_t(seq) * p.num_heads + qs.first) * HEAD_DIM;
  float row_max[MAX_QUERIES], row_sum[MAX_QUERIES];
  attend<T, HEAD_DIM, BLOCK_SIZE>(
      p, seq, qs, 0, p.context_lens[seq], p.max_context_len, dynamic_shared_floats(), row_max,
      row_sum, [&](int i, int d, float x) { out[i * HEAD_DIM + d] = from_float<T>(x); });
}

// All of it: the logits (dynamic) and attend()'s own arrays (static).
size_t paged_attention_v1_shared_memory(int num_heads, int num_kv_heads, int head_dim,
                                        int max_context_len) {
  return sizeof(float) * attend_shared_floats(num_heads, num_kv_heads, head_dim,
                                              max_context_len) +
         attend_static_bytes(head_dim);
}

size_t max_shared_memory_per_block() {
  int device = 0, bytes = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return static_cast<size_t>(bytes);
}

void paged_attention_v1(const DecodeParams& p, DType dtype, void* stream) {
  if (p.batch == 0) return;  // a grid may not be empty
  const size_t needed = paged_attention_v1_shared_memory(
      p.num_heads, p.cache.num_kv_heads, p.cache.head_dim, p.max_context_len);
  if (needed > max_shared_memory_per_block())
    throw std::invalid_argument(
        "paged_attention_v1 keeps every logit in shared memory: max_context_len " +
        std::to_string(p.max_context_len) + " needs " + std::to_string(needed) +
        " bytes, more than this GPU's " + std::to_string(max_shared_memory_per_block()) +
        "; use version 2");
  const size_t shared = needed - attend_static_bytes(p.cache.head_dim);  // set at launch
  const dim3 grid(p.cache.num_kv_heads * slices_per_group(p.num_heads, p.cache.num_kv_heads),
                  p.batch);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(dtype, [&](auto type) {
    dispatch_shape(p.cache.head_dim, p.cache.block_size, [&](auto head_dim, auto block_size) {
      using T = typename decltype(type)::type;
      auto kernel = paged_attention_v1_kernel<T, decltype(head_dim)::value,
                                              decltype(block_size)::value>;
      allow_shared_memory(kernel, shared);
      kernel<<<grid, NUM_THREADS, shared, s>>>(p);
    });
  });
  check_launch("paged_attention_v1_kernel");
}

}  // namespace minipaged

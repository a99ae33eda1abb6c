// paged_attention_v0.cu: decode attention at its plainest, one thread per query head.
//
// Version 0 is where lesson 08 starts: the paper's PagedAttention (§4.1) with none of
// the GPU tricks of versions 1 and 2.  Thread h of the thread block of sequence b
// computes query head h alone, token after token, looking each token's key and value up
// through the block table:
//
//   block  = block_table[b][t / block_size]        (physical block of logical block t / bs)
//   k_t    = key_cache[block][t % block_size][h / group]     (group = query heads per KV head)
//   out    = sum_t softmax_t(q·k_t * scale) v_t
//
// in two passes over the context: the largest logit first, then exp(logit - max) with
// its sum and the weighted values (so no exp() can overflow, and no logit is stored).
// Every thread reads its own copy of every key and value row, element by element, and
// a GQA group reads the same rows once per query head: correct, and slow.  Version 1
// reads each row once per group with 16-byte loads, and splits the work of a token over
// a thread group.
//
// Validate (CPU emulator or GPU), time (GPU), and see registers and spills:
//   pytest tests/test_ops_cuda.py -k v0
//   minipaged bench attention --ops decode --backends cuda-v0 cuda-v1 cuda-v2
//   nvcc -c -std=c++17 -arch=sm_90 -Xptxas -v kernels/paged_attention_v0.cu -o /tmp/v0.o
#include "common.cuh"

namespace minipaged {

template <typename T, int HEAD_DIM>
__global__ void paged_attention_v0_kernel(const DecodeParams p) {
  const int seq = blockIdx.x, head = threadIdx.x;
  if (head >= p.num_heads) return;
  const CacheView& cache = p.cache;
  const int kv_head = head / (p.num_heads / cache.num_kv_heads);
  const int32_t* block_table = p.block_tables + seq * p.block_tables_stride;
  const int context_len = p.context_lens[seq];
  const T* query = static_cast<const T*>(p.query) + seq * p.query_seq_stride +
                   head * p.query_head_stride;
  float q[HEAD_DIM];
  for (int d = 0; d < HEAD_DIM; ++d) q[d] = p.scale * to_float(query[d]);

  // Where token t's key or value row of this KV head starts in its cache tensor.
  auto row = [&](int t) {
    return block_table[t / cache.block_size] * cache.block_stride +
           (t % cache.block_size) * cache.token_stride + kv_head * cache.head_stride;
  };
  const T* keys = static_cast<const T*>(cache.key);
  const T* values = static_cast<const T*>(cache.value);
  auto logit = [&](int t) {
    float dot = 0.f;
    for (int d = 0; d < HEAD_DIM; ++d) dot += q[d] * to_float(keys[row(t) + d]);
    return dot;
  };

  float max_logit = -INFINITY;
  for (int t = 0; t < context_len; ++t) max_logit = fmaxf(max_logit, logit(t));
  float sum = 0.f, acc[HEAD_DIM] = {};
  for (int t = 0; t < context_len; ++t) {
    const float weight = expf(logit(t) - max_logit);
    sum += weight;
    for (int d = 0; d < HEAD_DIM; ++d) acc[d] += weight * to_float(values[row(t) + d]);
  }
  T* out = static_cast<T*>(p.out) + (int64_t(seq) * p.num_heads + head) * HEAD_DIM;
  for (int d = 0; d < HEAD_DIM; ++d) out[d] = from_float<T>(acc[d] / sum);
}

void paged_attention_v0(const DecodeParams& p, DType dtype, void* stream) {
  if (p.batch == 0) return;  // a grid may not be empty
  if (p.num_heads > 1024)
    throw std::invalid_argument("paged_attention_v0 runs a thread per query head, at most "
                                "1024, got num_heads " + std::to_string(p.num_heads));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(dtype, [&](auto type) {
    // v0 reads any block size; the head_dim sizes its per-thread arrays.
    dispatch_shape(p.cache.head_dim, p.cache.block_size, [&](auto head_dim, auto) {
      using T = typename decltype(type)::type;
      auto kernel = paged_attention_v0_kernel<T, decltype(head_dim)::value>;
      kernel<<<p.batch, p.num_heads, 0, s>>>(p);
    });
  });
  check_launch("paged_attention_v0_kernel");
}

}  // namespace minipaged

// paged_attention_v2.cu: decode attention over partitions, merged by log-sum-exp.
//
// Version 2 cuts each context into partitions of PARTITION_SIZE (512) tokens and gives
// every (KV head x group slice, sequence, partition) its own thread block: version 1's
// thread block (attend() in paged_attention_v1.cu, included below), over one partition.
// A batch of one 32k-token sequence with 8 KV heads then launches 8 x 64 = 512 thread
// blocks instead of 8, enough to keep every multiprocessor busy, and shared memory holds
// 512 logits per query head at most.  What is this file's own: the partition kernel's
// grid and outputs, and the reduce kernel that merges them.
//
// Each partition p leaves its normalised output o_p and lse_p = max_p + log(sum_p), the
// log of its softmax denominator.  The reduce kernel merges them exactly:
//     out = sum_p w_p o_p,   w_p = exp(lse_p - M) / sum_q exp(lse_q - M),   M = max_p lse_p
// (subtracting M keeps every exp() in range, as in any softmax).  The price is a second
// launch and a float round trip of the partial outputs, which is why version 1 remains
// the better choice when the batch alone fills the GPU.
//
// Validate (CPU emulator or GPU), time (GPU), and see registers and spills:
//   pytest tests/test_ops_cuda.py -k v2
//   minipaged bench attention --ops decode --backends cuda-v1 cuda-v2
//   nvcc -c -std=c++17 -arch=sm_90 -Xptxas -v kernels/paged_attention_v2.cu -o /tmp/v2.o
#define MINIPAGED_V1_THREAD_BLOCK_ONLY  // version 1's device code, not its launcher
#include "paged_attention_v1.cu"

namespace minipaged {

static_assert(PARTITION_SIZE % WARP_SIZE == 0, "a partition must hold whole KV blocks");

template <typename T, typename C, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_kernel(const DecodeParams p) {
  const int seq = blockIdx.y, partition = blockIdx.z;
  const int context_len = p.context_lens[seq];
  const int begin = partition * PARTITION_SIZE;
  if (begin >= context_len) return;  // a shorter sequence has fewer partitions
  const int end = min(begin + PARTITION_SIZE, context_len);
  const QuerySlice qs = query_slice(p);
  // Partition results of head h: row (seq * num_heads + h) * max_num_partitions + partition.
  const int64_t first_row =
      (int64_t(seq) * p.num_heads + qs.first) * p.max_num_partitions + partition;
  float* out = p.partial_out + first_row * HEAD_DIM;
  float row_max[MAX_QUERIES], row_sum[MAX_QUERIES];
  attend<T, C, HEAD_DIM, BLOCK_SIZE>(
      p, seq, qs, begin, end, PARTITION_SIZE, dynamic_shared_floats(), row_max, row_sum,
      [&](int i, int d, float x) { out[i * p.max_num_partitions * HEAD_DIM + d] = x; });
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < MAX_QUERIES; ++i) {
      if (i >= qs.count) break;
      p.partial_lse[first_row + i * p.max_num_partitions] = row_max[i] + logf(row_sum[i]);
    }
  }
}

// One thread block per (head, sequence): weigh the partitions by their share of the
// softmax denominator and add them up.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(NUM_THREADS)
    paged_attention_v2_reduce_kernel(const DecodeParams p) {
  __shared__ float scratch[NUM_WARPS];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int num_partitions = (p.context_lens[seq] + PARTITION_SIZE - 1) / PARTITION_SIZE;
  const int64_t first_row = (int64_t(seq) * p.num_heads + head) * p.max_num_partitions;
  const float* lse = p.partial_lse + first_row;
  float* weights = dynamic_shared_floats();  // [num_partitions]

  float lse_max[1] = {-INFINITY};
  for (int j = threadIdx.x; j < num_partitions; j += NUM_THREADS)
    lse_max[0] = fmaxf(lse_max[0], lse[j]);
  block_reduce<NUM_WARPS, 1, true>(lse_max, scratch);
  float total[1] = {0.f};
  for (int j = threadIdx.x; j < num_partitions; j += NUM_THREADS) {
    weights[j] = expf(lse[j] - lse_max[0]);
    total[0] += weights[j];
  }
  block_reduce<NUM_WARPS, 1, false>(total, scratch);  // its barrier also publishes weights

  const float* partial = p.partial_out + first_row * HEAD_DIM;
  T* out = static_cast<T*>(p.out) + (int64_t(seq) * p.num_heads + head) * HEAD_DIM;
  for (int d = threadIdx.x; d < HEAD_DIM; d += NUM_THREADS) {
    float x = 0.f;
    for (int j = 0; j < num_partitions; ++j) x += weights[j] * partial[j * HEAD_DIM + d];
    out[d] = from_float<T>(x / total[0]);
  }
}

void paged_attention_v2(const DecodeParams& p, DType dtype, DType cache_dtype, void* stream) {
  if (p.batch == 0) return;  // a grid may not be empty
  const int num_kv_heads = p.cache.num_kv_heads;
  const size_t shared = sizeof(float) * attend_shared_floats(p.num_heads, num_kv_heads,
                                                             p.cache.head_dim, PARTITION_SIZE);
  const size_t reduce_shared = sizeof(float) * p.max_num_partitions;
  const dim3 grid(num_kv_heads * slices_per_group(p.num_heads, num_kv_heads), p.batch,
                  p.max_num_partitions);
  const dim3 reduce_grid(p.num_heads, p.batch);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_cache_dtype(dtype, cache_dtype, [&](auto type, auto cache_type) {
    dispatch_shape(p.cache.head_dim, p.cache.block_size, [&](auto head_dim, auto block_size) {
      using T = typename decltype(type)::type;
      using C = typename decltype(cache_type)::type;
      constexpr int D = decltype(head_dim)::value;
      auto kernel = paged_attention_v2_kernel<T, C, D, decltype(block_size)::value>;
      allow_shared_memory(kernel, shared);
      kernel<<<grid, NUM_THREADS, shared, s>>>(p);
      auto reduce = paged_attention_v2_reduce_kernel<T, D>;
      allow_shared_memory(reduce, reduce_shared);
      reduce<<<reduce_grid, NUM_THREADS, reduce_shared, s>>>(p);
    });
  });
  check_launch("paged_attention_v2_kernel");
}

}  // namespace minipaged

// paged_attention_v1.cu: decode attention, one thread block per (sequence, KV head).
//
// Version 1 is the paper's kernel (§4.1, §5.1).  The grid is (KV heads x group slices,
// batch); a thread block serves one sequence, one KV head and the query heads that share
// it (a GQA group, or up to MAX_QUERIES_PER_BLOCK of a bigger one), and walks the
// sequence's whole block table once, holding every logit in shared memory until the
// softmax is done.  128 threads, 4 warps:
//
//   block table ─ warp w takes logical blocks w, w+4, w+8, ... of the range
//   KV block    ─ the warp's 32 lanes split into BLOCK_SIZE thread groups, one token each
//   token       ─ the threads of a group read 16 bytes each of the token's key row and
//                 add up their parts of its dot products with a few lane shuffles
//
// Three phases (the paper's §4.1, one device function each, each ending at a barrier),
// called in order by attend() at the end of the thread block's code:
//   1. qk_logits      q·k for every token and query head, kept in shared memory;
//   2. block_softmax  max and sum over the range, reduced with warp shuffles, then
//                     across warps through shared memory; logits become exp(logit - max);
//   3. ValueSums      each warp sums weight x value row over its blocks, lanes of a
//                     warp split a row's head_dim; warps then add up through shared
//                     memory, and the sum is divided by the softmax's.
//
// A quantized cache (fp8 or int8, minipaged/ops/kv_quant.py) is read the same way, a
// byte per element and so 16 elements per 16-byte load, each widened to float; its
// scale, one float per (slot, KV head), multiplies a token's q·k once (phase 1) and a
// token's softmax weight once (phase 3), not every element: q·(s k) = s (q·k).
//
// Why it is fast: a key or value row is read from memory once, by one thread group,
// with 16-byte loads, and serves every query head of its GQA group.  Why it is not
// always enough: a batch of 1-4 long sequences launches only batch x KV-heads thread
// blocks, far fewer than an H100's 132 multiprocessors can run, and shared memory
// (one float per token per query head) caps the context.  Version 2 lifts both, running
// this file's thread block (everything above the host side) over each partition.
//
// Validate (CPU emulator or GPU), time (GPU), and see registers and spills:
//   pytest tests/test_ops_cuda.py -k v1
//   minipaged bench attention --ops decode --backends cuda-v1
//   nvcc -c -std=c++17 -arch=sm_90 -Xptxas -v kernels/paged_attention_v1.cu -o /tmp/v1.o
#include "common.cuh"

namespace minipaged {

constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
constexpr int MAX_QUERIES = MAX_QUERIES_PER_BLOCK;

// Query heads per KV head, and how many thread blocks split one such group.
__host__ __device__ inline int group_size(int num_heads, int num_kv_heads) {
  return num_heads / num_kv_heads;
}
__host__ __device__ inline int slices_per_group(int num_heads, int num_kv_heads) {
  return (group_size(num_heads, num_kv_heads) + MAX_QUERIES - 1) / MAX_QUERIES;
}

// The query heads [first, first + count) of KV head kv_head, which this block serves:
// blockIdx.x enumerates (KV head, slice of its group) pairs.
struct QuerySlice {
  int kv_head, first, count;
};

__device__ inline QuerySlice query_slice(const DecodeParams& p) {
  const int group = group_size(p.num_heads, p.cache.num_kv_heads);
  const int slices = slices_per_group(p.num_heads, p.cache.num_kv_heads);
  const int kv_head = blockIdx.x / slices, slice = blockIdx.x % slices;
  return {kv_head, kv_head * group + slice * MAX_QUERIES,
          min(MAX_QUERIES, group - slice * MAX_QUERIES)};
}

// Shared memory `attend` needs: the logits of `tokens` tokens for each query head, then
// (reusing the space) the value sums of warps 1..3 for warp 0 to add.
__host__ __device__ inline size_t attend_shared_floats(int num_heads, int num_kv_heads,
                                                       int head_dim, int tokens) {
  const int group = group_size(num_heads, num_kv_heads);
  const size_t queries = group < MAX_QUERIES ? group : MAX_QUERIES;
  const size_t logits = queries * tokens;
  const size_t warp_sums = size_t(NUM_WARPS - 1) * MAX_QUERIES * head_dim;
  return logits > warp_sums ? logits : warp_sums;
}

// Bytes of the __shared__ arrays attend() declares (query heads, reduction scratch):
// a thread block's dynamic shared memory must fit beside them.
__host__ __device__ inline size_t attend_static_bytes(int head_dim) {
  return sizeof(float) * (size_t(MAX_QUERIES) * head_dim + NUM_WARPS * MAX_QUERIES);
}

// The tokens [begin, end) of one sequence that a thread block attends to, end > begin,
// begin a multiple of BLOCK_SIZE, and where their keys and values live: the logical
// blocks [first_block, end_block) of the sequence's block table, KV head `kv_head`.
struct TokenRange {
  const int32_t* block_table;
  int begin, end, first_block, end_block, kv_head;
  int64_t head_offset;  // elements from a cache row's start to KV head kv_head's slice
};

template <int BLOCK_SIZE>
__device__ inline TokenRange token_range(const DecodeParams& p, int seq, const QuerySlice& qs,
                                         int begin, int end) {
  return {p.block_tables + seq * p.block_tables_stride, begin, end, begin / BLOCK_SIZE,
          (end + BLOCK_SIZE - 1) / BLOCK_SIZE, qs.kv_head, qs.kv_head * p.cache.head_stride};
}

// The query heads of `qs`, pre-scaled, into shared memory: every thread group reads
// all of them in phase 1.  Ends at a barrier.
template <typename T, int HEAD_DIM>
__device__ void load_query(const DecodeParams& p, int seq, const QuerySlice& qs,
                           float (&q)[MAX_QUERIES][HEAD_DIM]) {
  const T* query = static_cast<const T*>(p.query) + seq * p.query_seq_stride;
  for (int e = threadIdx.x; e < qs.count * HEAD_DIM; e += NUM_THREADS) {
    const int i = e / HEAD_DIM, d = e % HEAD_DIM;
    q[i][d] = p.scale * to_float(query[(qs.first + i) * p.query_head_stride + d]);
  }
  __syncthreads();
}

// Phase 1, logits: q·k for every token of the range and query head, into `logits`
// (a row of `logits_stride` floats per query head).  Warp w takes logical blocks w,
// w + NUM_WARPS, ...; in it, a thread group of GROUP_THREADS lanes shares each token,
// and per round each thread reads K_VEC elements (16 bytes) of the key row, next to its
// neighbours'; C is the cache's element type (T's, or a quantized byte).  Each thread
// leaves in row_max the largest logit it wrote (or -inf).
#ifdef MINIPAGED_QK_LOGITS_EXERCISE
// Lesson 08's exercise build (cuda_build.build_with_qk_logits): phase 1 is the
// learner's, from exercises/cuda_qk_logits.cu, included by the header that build writes.
#include "qk_logits_exercise.h"
#else
template <typename C, int HEAD_DIM, int BLOCK_SIZE>
__device__ void qk_logits(const DecodeParams& p, const TokenRange& r, const QuerySlice& qs,
                          const float (&q)[MAX_QUERIES][HEAD_DIM], float* logits,
                          int logits_stride, float (&row_max)[MAX_QUERIES]) {
  static_assert(WARP_SIZE % BLOCK_SIZE == 0, "a warp must cover whole KV blocks");
  constexpr int GROUP_THREADS = WARP_SIZE / BLOCK_SIZE;
  constexpr int K_VEC = 16 / sizeof(C);
  constexpr int K_ROUNDS = HEAD_DIM / (GROUP_THREADS * K_VEC);
  static_assert(K_ROUNDS * GROUP_THREADS * K_VEC == HEAD_DIM, "head_dim too small");
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int token_in_block = lane / GROUP_THREADS, thread_in_group = lane % GROUP_THREADS;
  const CacheView& cache = p.cache;
  const C* keys = static_cast<const C*>(cache.key);

#pragma unroll
  for (int i = 0; i < MAX_QUERIES; ++i) row_max[i] = -INFINITY;
  for (int b = r.first_block + warp; b < r.end_block; b += NUM_WARPS) {
    const int token = b * BLOCK_SIZE + token_in_block;
    float dot[MAX_QUERIES] = {};
    float k_scale = 1.f;
    if (token < r.end) {  // the last block's tail holds no token of this sequence
      k_scale = slot_scale<C>(cache.k_scale, cache, r.block_table[b], token_in_block, r.kv_head);
      const C* k = keys + r.block_table[b] * cache.block_stride +
                   token_in_block * cache.token_stride + r.head_offset;
      // Fully unrolled, fp32's 32 rounds (block 32) would keep more loads in flight than
      // there are registers and spill kilobytes; 8 rounds at a time spill a few bytes at
      // most in fp32, none in fp16/bf16 (nvcc -Xptxas -v).
#pragma unroll 8
      for (int round = 0; round < K_ROUNDS; ++round) {
        const int d0 = (round * GROUP_THREADS + thread_in_group) * K_VEC;
        float kf[K_VEC];
        load_floats<C, K_VEC>(k + d0, kf);
#pragma unroll
        for (int i = 0; i < MAX_QUERIES; ++i) {
          if (i >= qs.count) break;
#pragma unroll
          for (int e = 0; e < K_VEC; ++e) dot[i] += q[i][d0 + e] * kf[e];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < MAX_QUERIES; ++i) {
      if (i >= qs.count) break;  // the same for every lane: the shuffles stay in step
      dot[i] = group_sum<GROUP_THREADS>(dot[i]) * k_scale;
      if (token < r.end && thread_in_group == 0) {
        logits[i * logits_stride + token - r.begin] = dot[i];
        row_max[i] = fmaxf(row_max[i], dot[i]);
      }
    }
  }
}
#endif  // MINIPAGED_QK_LOGITS_EXERCISE

// Phase 2, the block-wise softmax: the range's max logit per query head (reduced over
// the thread block), then every logit becomes exp(logit - max), and row_sum their sum.
// Every thread leaves with the same row_max and row_sum; the weights are left
// unnormalised, for phase 3 to divide once per output element instead of per token.
__device__ inline void block_softmax(const QuerySlice& qs, int num_tokens, float* logits,
                                     int logits_stride, float (&row_max)[MAX_QUERIES],
                                     float (&row_sum)[MAX_QUERIES], float* scratch) {
  block_reduce<NUM_WARPS, MAX_QUERIES, true>(row_max, scratch);
#pragma unroll
  for (int i = 0; i < MAX_QUERIES; ++i) {
    row_sum[i] = 0.f;
    if (i >= qs.count) continue;
    for (int t = threadIdx.x; t < num_tokens; t += NUM_THREADS) {
      const float weight = expf(logits[i * logits_stride + t] - row_max[i]);
      logits[i * logits_stride + t] = weight;
      row_sum[i] += weight;
    }
  }
  block_reduce<NUM_WARPS, MAX_QUERIES, false>(row_sum, scratch);
}

// Phase 3, weighted values: sum_t weight_t x v_t per query head.  ROW_LANES lanes split
// a value row into 16-byte pieces, so a warp reads ROWS rows (tokens) at once; each lane
// keeps the sums of its pieces in registers, then the lanes and warps that hold the
// same dimensions add theirs up.  C is the cache's element type, as in phase 1.
template <typename C, int HEAD_DIM>
struct ValueSums {
  static constexpr int V_VEC = 16 / sizeof(C);
  static constexpr int V_PIECES = HEAD_DIM / V_VEC;
  static constexpr int ROW_LANES = V_PIECES < WARP_SIZE ? V_PIECES : WARP_SIZE;
  static constexpr int ROWS = WARP_SIZE / ROW_LANES;
  static constexpr int LANE_PIECES = V_PIECES / ROW_LANES;
  float acc[MAX_QUERIES][LANE_PIECES][V_VEC] = {};
  int warp = threadIdx.x / WARP_SIZE, row = threadIdx.x % WARP_SIZE / ROW_LANES,
      col = threadIdx.x % ROW_LANES;

  // Add weight x value for this lane's rows of the warp's blocks (as in phase 1).
  template <int BLOCK_SIZE>
  __device__ void accumulate(const DecodeParams& p, const TokenRange& r, const QuerySlice& qs,
                             const float* weights, int weights_stride) {
    static_assert(ROWS <= BLOCK_SIZE, "head_dim too small for this block size");
    const C* values = static_cast<const C*>(p.cache.value);
    for (int b = r.first_block + warp; b < r.end_block; b += NUM_WARPS) {
      const C* block = values + r.block_table[b] * p.cache.block_stride + r.head_offset;
      for (int t = row; t < BLOCK_SIZE && b * BLOCK_SIZE + t < r.end; t += ROWS) {
        const float* weight = weights + b * BLOCK_SIZE + t - r.begin;
        const float v_scale = slot_scale<C>(p.cache.v_scale, p.cache, r.block_table[b], t,
                                            r.kv_head);
#pragma unroll
        for (int c = 0; c < LANE_PIECES; ++c) {
          float vf[V_VEC];
          load_floats<C, V_VEC>(block + t * p.cache.token_stride + (c * ROW_LANES + col) * V_VEC,
                                vf);
#pragma unroll
          for (int i = 0; i < MAX_QUERIES; ++i) {
            if (i >= qs.count) break;
            const float w = weight[i * weights_stride] * v_scale;
#pragma unroll
            for (int e = 0; e < V_VEC; ++e) acc[i][c][e] += w * vf[e];
          }
        }
      }
    }
  }

  // f(query head i, dimension d, sum) for each of this lane's sums.
  template <typename F>
  __device__ void for_each(const QuerySlice& qs, F f) {
#pragma unroll
    for (int i = 0; i < MAX_QUERIES; ++i) {
      if (i >= qs.count) break;
#pragma unroll
      for (int c = 0; c < LANE_PIECES; ++c)
#pragma unroll
        for (int e = 0; e < V_VEC; ++e) f(i, (c * ROW_LANES + col) * V_VEC + e, acc[i][c][e]);
    }
  }

  // Add up every lane's and warp's sums and store(i, d, sum / row_sum[i]) each once.
  // `spare` is shared memory phase 3 no longer reads: NUM_WARPS - 1 warps' sums.
  template <typename Store>
  __device__ void reduce_and_store(const QuerySlice& qs, float* spare,
                                   const float (&row_sum)[MAX_QUERIES], Store store) {
    // Lanes with the same col hold the same dimensions: fold the rows into row 0...
    for_each(qs, [&](int, int, float& sum) {
#pragma unroll
      for (int mask = ROW_LANES; mask < WARP_SIZE; mask *= 2)
        sum += __shfl_xor_sync(FULL_MASK, sum, mask);
    });
    // ...then warps 1..3 hand their sums to warp 0 through shared memory.
    __syncthreads();  // every warp is done reading the weights `spare` held
    auto warp_sum = [&](int w, int i, int d) -> float& {
      return spare[((w - 1) * MAX_QUERIES + i) * HEAD_DIM + d];
    };
    if (warp > 0 && row == 0)
      for_each(qs, [&](int i, int d, float& sum) { warp_sum(warp, i, d) = sum; });
    __syncthreads();
    if (warp == 0 && row == 0) {
      for_each(qs, [&](int i, int d, float& sum) {
        for (int w = 1; w < NUM_WARPS; ++w) sum += warp_sum(w, i, d);
        store(i, d, sum / row_sum[i]);
      });
    }
  }
};

// Attention of the query heads of `qs` of sequence `seq` over its tokens [begin, end),
// end > begin, begin a multiple of BLOCK_SIZE: the three phases of §4.1 in order.
// `logits` (shared, attend_shared_floats) holds a row of `logits_stride` >= end - begin
// floats per query head.
//
// Every thread leaves the range's max logit and sum of exp(logit - max) per query
// head in row_max / row_sum.  The normalised output, sum_t softmax_t * v_t, goes out
// through store(i, d, x) for query head qs.first + i and dimension d, called once per
// (i, d) by some thread of warp 0.  T is the query's element type, C the cache's.
template <typename T, typename C, int HEAD_DIM, int BLOCK_SIZE, typename Store>
__device__ void attend(const DecodeParams& p, int seq, const QuerySlice& qs, int begin,
                       int end, int logits_stride, float* logits,
                       float (&row_max)[MAX_QUERIES], float (&row_sum)[MAX_QUERIES],
                       Store store) {
  __shared__ float q[MAX_QUERIES][HEAD_DIM];
  __shared__ float scratch[NUM_WARPS * MAX_QUERIES];
  const TokenRange r = token_range<BLOCK_SIZE>(p, seq, qs, begin, end);
  load_query<T, HEAD_DIM>(p, seq, qs, q);
  qk_logits<C, HEAD_DIM, BLOCK_SIZE>(p, r, qs, q, logits, logits_stride, row_max);
  block_softmax(qs, end - begin, logits, logits_stride, row_max, row_sum, scratch);
  ValueSums<C, HEAD_DIM> values;
  values.template accumulate<BLOCK_SIZE>(p, r, qs, logits, logits_stride);
  values.reduce_and_store(qs, logits, row_sum, store);
}

// ---- version 1's kernel: attend() over the whole context ----

template <typename T, typename C, int HEAD_DIM, int BLOCK_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v1_kernel(const DecodeParams p) {
  const int seq = blockIdx.y;
  const QuerySlice qs = query_slice(p);
  T* out = static_cast<T*>(p.out) + (int64_t(seq) * p.num_heads + qs.first) * HEAD_DIM;
  float row_max[MAX_QUERIES], row_sum[MAX_QUERIES];
  attend<T, C, HEAD_DIM, BLOCK_SIZE>(
      p, seq, qs, 0, p.context_lens[seq], p.max_context_len, dynamic_shared_floats(), row_max,
      row_sum, [&](int i, int d, float x) { out[i * HEAD_DIM + d] = from_float<T>(x); });
}

// The host side, left out where paged_attention_v2.cu includes this file for its
// thread block.
#ifndef MINIPAGED_V1_THREAD_BLOCK_ONLY

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

void paged_attention_v1(const DecodeParams& p, DType dtype, DType cache_dtype, void* stream) {
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
  dispatch_cache_dtype(dtype, cache_dtype, [&](auto type, auto cache_type) {
    dispatch_shape(p.cache.head_dim, p.cache.block_size, [&](auto head_dim, auto block_size) {
      using T = typename decltype(type)::type;
      using C = typename decltype(cache_type)::type;
      auto kernel = paged_attention_v1_kernel<T, C, decltype(head_dim)::value,
                                              decltype(block_size)::value>;
      allow_shared_memory(kernel, shared);
      kernel<<<grid, NUM_THREADS, shared, s>>>(p);
    });
  });
  check_launch("paged_attention_v1_kernel");
}

#endif  // MINIPAGED_V1_THREAD_BLOCK_ONLY

}  // namespace minipaged

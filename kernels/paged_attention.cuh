// paged_attention.cuh: what one thread block of decode attention does (paper §4.1, §5.1).
//
// A thread block serves one sequence, one KV head and the query heads that share it (a
// GQA group, or up to MAX_QUERIES_PER_BLOCK of a bigger one), over a range of the
// sequence's tokens: all of them in v1, one partition in v2.  128 threads, 4 warps:
//
//   block table ─ warp w takes logical blocks w, w+4, w+8, ... of the range
//   KV block    ─ the warp's 32 lanes split into BLOCK_SIZE thread groups, one token each
//   token       ─ the threads of a group read 16 bytes each of the token's key row and
//                 add up their parts of its dot products with a few lane shuffles
//
// Three phases, each ending at a barrier:
//   1. logits  q·k for every token and query head, kept in shared memory;
//   2. softmax max and sum over the range, reduced with warp shuffles, then across
//              warps through shared memory; logits become exp(logit - max);
//   3. values  each warp sums weight x value row over its blocks, lanes of a warp
//              split a row's head_dim; warps then add up through shared memory.
//
// Keys and values are read once per thread block, whatever the number of query heads
// that use them: for GQA, that is the point of covering a whole group in one block.
#pragma once

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

// Attention of the query heads of `qs` of sequence `seq` over its tokens [begin, end),
// end > begin, begin a multiple of BLOCK_SIZE.  `logits` (shared, attend_shared_floats)
// holds a row of `logits_stride` >= end - begin floats per query head.
//
// Every thread leaves the range's max logit and sum of exp(logit - max) per query
// head in row_max / row_sum.  The normalised output, sum_t softmax_t * v_t, goes out
// through store(i, d, x) for query head qs.first + i and dimension d, called once per
// (i, d) by some thread of warp 0.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, typename Store>
__device__ void attend(const DecodeParams& p, int seq, const QuerySlice& qs, int begin,
                       int end, int logits_stride, float* logits,
                       float (&row_max)[MAX_QUERIES], float (&row_sum)[MAX_QUERIES],
                       Store store) {
  static_assert(WARP_SIZE % BLOCK_SIZE == 0, "a warp must cover whole KV blocks");
  __shared__ float q[MAX_QUERIES][HEAD_DIM];
  __shared__ float scratch[NUM_WARPS * MAX_QUERIES];
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const CacheView& cache = p.cache;
  const int32_t* block_table = p.block_tables + seq * p.block_tables_stride;
  const int first_block = begin / BLOCK_SIZE;
  const int end_block = (end + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int64_t head_offset = qs.kv_head * cache.head_stride;

  // The query heads, pre-scaled, in shared memory: every thread group reads all of them.
  const T* query = static_cast<const T*>(p.query) + seq * p.query_seq_stride;
  for (int e = threadIdx.x; e < qs.count * HEAD_DIM; e += NUM_THREADS) {
    const int i = e / HEAD_DIM, d = e % HEAD_DIM;
    q[i][d] = p.scale * to_float(query[(qs.first + i) * p.query_head_stride + d]);
  }
  __syncthreads();

  // 1. Logits.  A thread group of GROUP_THREADS lanes shares each token; per round, each
  // thread reads K_VEC elements (16 bytes) of the key row, next to its neighbours'.
  constexpr int GROUP_THREADS = WARP_SIZE / BLOCK_SIZE;
  constexpr int K_VEC = 16 / sizeof(T);
  constexpr int K_ROUNDS = HEAD_DIM / (GROUP_THREADS * K_VEC);
  static_assert(K_ROUNDS * GROUP_THREADS * K_VEC == HEAD_DIM, "head_dim too small");
  const int token_in_block = lane / GROUP_THREADS, thread_in_group = lane % GROUP_THREADS;
  const T* keys = static_cast<const T*>(cache.key);

#pragma unroll
  for (int i = 0; i < MAX_QUERIES; ++i) row_max[i] = -INFINITY;
  for (int b = first_block + warp; b < end_block; b += NUM_WARPS) {
    const int token = b * BLOCK_SIZE + token_in_block;
    float dot[MAX_QUERIES] = {};
    if (token < end) {  // the last block's tail holds no token of this sequence
      const T* k = keys + block_table[b] * cache.block_stride +
                   token_in_block * cache.token_stride + head_offset;
      // Fully unrolled, fp32's 32 rounds (block 32) would keep more loads in flight than
      // there are registers and spill kilobytes; 8 rounds at a time spill a few bytes at
      // most in fp32, none in fp16/bf16 (nvcc -Xptxas -v).
#pragma unroll 8
      for (int r = 0; r < K_ROUNDS; ++r) {
        const int d0 = (r * GROUP_THREADS + thread_in_group) * K_VEC;
        float kf[K_VEC];
        load_floats<T, K_VEC>(k + d0, kf);
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
      dot[i] = group_sum<GROUP_THREADS>(dot[i]);
      if (token < end && thread_in_group == 0) {
        logits[i * logits_stride + token - begin] = dot[i];
        row_max[i] = fmaxf(row_max[i], dot[i]);
      }
    }
  }

  // 2. Softmax over the range: the max, then exp(logit - max) and its sum.
  block_reduce<NUM_WARPS, MAX_QUERIES, true>(row_max, scratch);
#pragma unroll
  for (int i = 0; i < MAX_QUERIES; ++i) {
    row_sum[i] = 0.f;
    if (i >= qs.count) continue;
    for (int t = threadIdx.x; t < end - begin; t += NUM_THREADS) {
      const float weight = expf(logits[i * logits_stride + t] - row_max[i]);
      logits[i * logits_stride + t] = weight;
      row_sum[i] += weight;
    }
  }
  block_reduce<NUM_WARPS, MAX_QUERIES, false>(row_sum, scratch);

  // 3. Values.  ROW_LANES lanes split a value row into 16-byte pieces; the warp reads
  // ROWS rows (tokens) at once.  Each lane sums weight x value over its rows.
  constexpr int V_VEC = 16 / sizeof(T);
  constexpr int V_PIECES = HEAD_DIM / V_VEC;
  constexpr int ROW_LANES = V_PIECES < WARP_SIZE ? V_PIECES : WARP_SIZE;
  constexpr int ROWS = WARP_SIZE / ROW_LANES;
  constexpr int LANE_PIECES = V_PIECES / ROW_LANES;
  static_assert(ROWS <= BLOCK_SIZE, "head_dim too small for this block size");
  const int row = lane / ROW_LANES, col = lane % ROW_LANES;
  const T* values = static_cast<const T*>(cache.value);
  float acc[MAX_QUERIES][LANE_PIECES][V_VEC] = {};

  for (int b = first_block + warp; b < end_block; b += NUM_WARPS) {
    const T* block = values + block_table[b] * cache.block_stride + head_offset;
    for (int t = row; t < BLOCK_SIZE && b * BLOCK_SIZE + t < end; t += ROWS) {
      const float* weight = logits + b * BLOCK_SIZE + t - begin;
#pragma unroll
      for (int c = 0; c < LANE_PIECES; ++c) {
        float vf[V_VEC];
        load_floats<T, V_VEC>(block + t * cache.token_stride + (c * ROW_LANES + col) * V_VEC, vf);
#pragma unroll
        for (int i = 0; i < MAX_QUERIES; ++i) {
          if (i >= qs.count) break;
          const float w = weight[i * logits_stride];
#pragma unroll
          for (int e = 0; e < V_VEC; ++e) acc[i][c][e] += w * vf[e];
        }
      }
    }
  }

  // What follows visits each of this lane's sums: f(query head i, dimension d, sum).
  auto for_each_sum = [&](auto f) {
#pragma unroll
    for (int i = 0; i < MAX_QUERIES; ++i) {
      if (i >= qs.count) break;
#pragma unroll
      for (int c = 0; c < LANE_PIECES; ++c)
#pragma unroll
        for (int e = 0; e < V_VEC; ++e) f(i, (c * ROW_LANES + col) * V_VEC + e, acc[i][c][e]);
    }
  };
  // Lanes with the same col hold the same dimensions: fold the rows into row 0...
  for_each_sum([&](int, int, float& sum) {
#pragma unroll
    for (int mask = ROW_LANES; mask < WARP_SIZE; mask *= 2)
      sum += __shfl_xor_sync(FULL_MASK, sum, mask);
  });
  // ...then warps 1..3 hand their sums to warp 0 through the logits' space, now free.
  __syncthreads();
  float* warp_sums = logits;  // [NUM_WARPS - 1][MAX_QUERIES][HEAD_DIM]
  auto warp_sum = [&](int w, int i, int d) -> float& {
    return warp_sums[((w - 1) * MAX_QUERIES + i) * HEAD_DIM + d];
  };
  if (warp > 0 && row == 0)
    for_each_sum([&](int i, int d, float& sum) { warp_sum(warp, i, d) = sum; });
  __syncthreads();
  if (warp == 0 && row == 0) {
    for_each_sum([&](int i, int d, float& sum) {
      for (int w = 1; w < NUM_WARPS; ++w) sum += warp_sum(w, i, d);
      store(i, d, sum / row_sum[i]);
    });
  }
}

}  // namespace minipaged

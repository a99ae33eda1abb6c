// paged_attention_v3.cu: flash-decoding, an online softmax over K/V tiles.
//
// Version 3 is the engine's decode kernel (minipaged/ops/cuda_ops.py launches it unless
// asked for another).  It computes what versions 1 and 2 compute, organised the way
// FlashAttention and FlashDecoding organise it, so that the GPU's memory never waits on
// its arithmetic:
//
//   split   ─ a sequence's context is cut into splits (how many: from the SM count and
//             the batch, cuda_ops.split_kv), a thread block per (KV head x group slice,
//             sequence, split), and one reduce kernel merges the splits by log-sum-exp
//             (none when there is one split);
//   tile    ─ a thread block walks its split TILE (32) tokens at a time: each tile's key
//             and value rows are copied into shared memory with cp.async, the next tile
//             in flight while this one is computed (double buffering); a tile's softmax
//             is folded into a running one (max m, sum l, weighted values acc), so the
//             context is read once, in one pass, with no logits kept;
//   threads  ─ 128 threads: 8 token rows of 16 lanes; lane x of a row holds dimensions
//             [x * HEAD_DIM/16, (x + 1) * HEAD_DIM/16) of every query head of the group
//             (q lives in registers) and of the row's running output; row z takes tokens
//             z, z + 8, ... of each tile, and keeps its own running softmax, merged with
//             the other rows' once, at the end.
//
// GROUP, the query heads a thread block serves, is a template parameter: the GQA group
// rounded up to a power of two (at most 8; a wider group is sliced over thread blocks),
// so every register array has its exact size and every loop is unrolled.
//
// What it does differently from versions 1 and 2 (kernels/README.md says why it matters):
// no second pass and no shared-memory softmax between barriers; every thread keeps two
// tiles' worth of 16-byte copies in flight instead of one block per warp behind a
// block-table load; a key row is read by 16 neighbouring lanes, not by two lanes of
// rows 2 KB apart; q is read from registers, not shared memory.
//
// Logits are kept in base 2: q is scaled by softmax_scale * log2(e) once, so that every
// exponential is an exp2 (one instruction on a GPU), and a split's lse is log2-based.
//
// A quantized cache (fp8 or int8, minipaged/ops/kv_quant.py) is copied as bytes, and
// its scales with it; a token's scale multiplies its q·k and its softmax weight.
//
// Validate (CPU emulator or GPU), time (GPU), and see registers and spills:
//   pytest tests/test_ops_cuda.py -k v3
//   minipaged bench attention --ops decode --backends cuda-v3 cuda-v2 triton
//   nvcc -c -std=c++17 -arch=sm_90 -Xptxas -v kernels/paged_attention_v3.cu -o /tmp/v3.o
#include "common.cuh"

namespace minipaged {
namespace v3 {

constexpr int NUM_THREADS = 128;
constexpr int ROW_LANES = 16;                     // lanes sharing a token's row
constexpr int ROWS = NUM_THREADS / ROW_LANES;     // token rows of a thread block
constexpr int TILE = V3_TILE_SIZE;                // tokens per tile
constexpr int TOKENS_PER_ROW = TILE / ROWS;       // of each tile, per token row
constexpr int MAX_GROUP = V3_MAX_QUERIES_PER_BLOCK;
constexpr float LOG2E = 1.4426950408889634f;
static_assert(TILE % ROWS == 0, "every row takes as many tokens of a tile");

// ---- asynchronous copies (sm_80+); a plain copy elsewhere and in the CPU emulator ----

// Start copying BYTES (4 or 16) from global memory to shared memory, without waiting.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  if constexpr (BYTES == 16)  // .cg: cached in L2 only, as streamed data should be
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(address), "l"(global),
                 "n"(BYTES));
#else
  struct alignas(BYTES) Bytes { char b[BYTES]; };
  *static_cast<Bytes*>(shared) = *static_cast<const Bytes*>(global);
#endif
}

// Close the group of copies started since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most PENDING groups of this thread's copies are still in flight.  Other
// threads' copies are seen only after a __syncthreads() that follows.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
#endif
}

// ---- shared memory: two stages, each a tile of keys, values (and their scales) ----

template <typename C, int HEAD_DIM>
struct Stage {
  static constexpr int ROW_BYTES = HEAD_DIM * sizeof(C);
  static constexpr int CHUNKS = ROW_BYTES / 16;  // 16-byte copies per row
  static constexpr int ROWS_PER_PASS = NUM_THREADS / CHUNKS;
  static constexpr int PASSES = TILE / ROWS_PER_PASS;
  static constexpr int TILE_BYTES = TILE * ROW_BYTES;
  static constexpr int SCALE_BYTES = is_quantized<C> ? TILE * sizeof(float) : 0;
  static constexpr int BYTES = 2 * TILE_BYTES + 2 * SCALE_BYTES;
  static_assert(NUM_THREADS % CHUNKS == 0 && TILE % ROWS_PER_PASS == 0,
                "the threads copy a tile in whole passes");

  char* base;
  __device__ const C* key(int row) const {
    return reinterpret_cast<const C*>(base + row * ROW_BYTES);
  }
  __device__ const C* value(int row) const {
    return reinterpret_cast<const C*>(base + TILE_BYTES + row * ROW_BYTES);
  }
  __device__ float* k_scale() const { return reinterpret_cast<float*>(base + 2 * TILE_BYTES); }
  __device__ float* v_scale() const { return k_scale() + TILE; }
};

// The running state of one token row: the softmax so far of each query head (max m and
// sum l of 2^(logit - m)) and its weighted value sum over this lane's dimensions.
template <int GROUP, int VEC>
struct Running {
  float m[GROUP], l[GROUP], acc[GROUP][VEC];
};

// Where a thread block reads: one sequence's tokens [begin, end), one KV head.
struct Split {
  const int32_t* block_table;
  int begin, end, block_shift;
  int64_t head_offset;  // elements from a cache row's start to the KV head's slice
};

// Start copying tile `first`..`first + TILE` of the split into `stage`: every thread
// copies 16-byte chunks (the same chunk of PASSES rows), neighbouring threads
// neighbouring chunks of a row, so a row is read whole and contiguous.  Rows past the
// split's end are not copied.
template <typename C, int HEAD_DIM>
__device__ void load_tile(const DecodeParams& p, const Split& s, int first,
                          const Stage<C, HEAD_DIM>& stage, int kv_head) {
  using S = Stage<C, HEAD_DIM>;
  const CacheView& cache = p.cache;
  const int chunk = threadIdx.x % S::CHUNKS, first_row = threadIdx.x / S::CHUNKS;
  const char* keys = static_cast<const char*>(cache.key);
  const char* values = static_cast<const char*>(cache.value);
#pragma unroll
  for (int pass = 0; pass < S::PASSES; ++pass) {
    const int row = first_row + pass * S::ROWS_PER_PASS, token = first + row;
    if (token >= s.end) break;
    const int block = s.block_table[token >> s.block_shift];
    const int slot = token & (cache.block_size - 1);
    const int64_t element = block * cache.block_stride + slot * cache.token_stride + s.head_offset;
    const int64_t byte = element * int64_t(sizeof(C)) + chunk * 16;
    cp_async<16>(stage.base + row * S::ROW_BYTES + chunk * 16, keys + byte);
    cp_async<16>(stage.base + S::TILE_BYTES + row * S::ROW_BYTES + chunk * 16, values + byte);
    if constexpr (is_quantized<C>) {
      if (chunk == 0) {
        const int64_t at = block * cache.scale_block_stride + slot * cache.scale_slot_stride +
                           kv_head * cache.scale_head_stride;
        cp_async<4>(stage.k_scale() + row, cache.k_scale + at);
        cp_async<4>(stage.v_scale() + row, cache.v_scale + at);
      }
    }
  }
}

// VEC consecutive elements of a row in shared memory as floats, in loads of 16 bytes at most.
template <typename C, int VEC>
__device__ __forceinline__ void read_row(const C* src, float (&dst)[VEC]) {
  constexpr int PIECE = VEC * sizeof(C) <= 16 ? VEC : 16 / sizeof(C);
#pragma unroll
  for (int i = 0; i < VEC; i += PIECE) {
    float piece[PIECE];
    load_floats<C, PIECE>(src + i, piece);
#pragma unroll
    for (int e = 0; e < PIECE; ++e) dst[i + e] = piece[e];
  }
}

// Fold one tile, in `stage`, into this thread's running state: the logits of the row's
// TOKENS_PER_ROW tokens for every query head, the tile's max, then the weighted values.
template <typename C, int HEAD_DIM, int GROUP>
__device__ void attend_tile(const Stage<C, HEAD_DIM>& stage, int first, int end,
                            const float (&q)[GROUP][HEAD_DIM / ROW_LANES],
                            Running<GROUP, HEAD_DIM / ROW_LANES>& r) {
  constexpr int VEC = HEAD_DIM / ROW_LANES;
  const int lane = threadIdx.x % ROW_LANES, z = threadIdx.x / ROW_LANES;
  float logit[GROUP][TOKENS_PER_ROW];
#pragma unroll
  for (int j = 0; j < TOKENS_PER_ROW; ++j) {
    float k[VEC];
    read_row<C, VEC>(stage.key(z + j * ROWS) + lane * VEC, k);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot += q[g][e] * k[e];
      logit[g][j] = dot;
    }
  }
  // The row's lanes add up their parts; a token past the end (its row in shared memory
  // was not copied) gets -inf.  All lanes of the warp take part in every shuffle.
#pragma unroll
  for (int j = 0; j < TOKENS_PER_ROW; ++j) {
    const int row = z + j * ROWS;
    const bool valid = first + row < end;
    const float k_scale = is_quantized<C> && valid ? stage.k_scale()[row] : 1.f;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float dot = group_sum<ROW_LANES>(logit[g][j]) * k_scale;
      logit[g][j] = valid ? dot : -INFINITY;
    }
  }
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    float m = r.m[g];
#pragma unroll
    for (int j = 0; j < TOKENS_PER_ROW; ++j) m = fmaxf(m, logit[g][j]);
    if (m == -INFINITY) continue;  // no token of this row yet: nothing to fold
    const float rescale = exp2f(r.m[g] - m);  // 0 on the row's first token
    r.m[g] = m;
    r.l[g] *= rescale;
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.acc[g][e] *= rescale;
#pragma unroll
    for (int j = 0; j < TOKENS_PER_ROW; ++j) {
      logit[g][j] = exp2f(logit[g][j] - m);  // 0 past the end
      r.l[g] += logit[g][j];
    }
  }
#pragma unroll
  for (int j = 0; j < TOKENS_PER_ROW; ++j) {
    const int row = z + j * ROWS;
    if (first + row >= end) break;  // the same for the row's lanes; rows increase with j
    float v[VEC];
    read_row<C, VEC>(stage.value(row) + lane * VEC, v);
    const float v_scale = is_quantized<C> ? stage.v_scale()[row] : 1.f;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float w = logit[g][j] * v_scale;
#pragma unroll
      for (int e = 0; e < VEC; ++e) r.acc[g][e] += w * v[e];
    }
  }
}

// Bytes of dynamic shared memory a thread block uses: two stages, reused at the end to
// merge the rows' running states (ROWS x GROUP x (HEAD_DIM + 2) floats).
template <typename C, int HEAD_DIM, int GROUP>
constexpr size_t shared_bytes() {
  const size_t stages = 2 * size_t(Stage<C, HEAD_DIM>::BYTES);
  const size_t merge = sizeof(float) * ROWS * GROUP * (HEAD_DIM + 2);
  return stages > merge ? stages : merge;
}

// Query heads a thread block serves for a GQA group of `group`, and the thread blocks
// one group takes.
__host__ __device__ inline int queries_per_block(int group) {
  int queries = 1;
  while (queries < group && queries < MAX_GROUP) queries *= 2;
  return queries;
}
__host__ __device__ inline int slices_per_group(int group) {
  const int queries = queries_per_block(group);
  return (group + queries - 1) / queries;
}

template <typename T, typename C, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v3_kernel(const DecodeParams p) {
  constexpr int VEC = HEAD_DIM / ROW_LANES;
  using S = Stage<C, HEAD_DIM>;
  const int lane = threadIdx.x % ROW_LANES, z = threadIdx.x / ROW_LANES;
  const int seq = blockIdx.y, split = blockIdx.z;
  const int context_len = p.context_lens[seq];
  const int begin = split * p.split_size;
  if (begin >= context_len) return;  // a shorter sequence has fewer splits
  const int group = p.num_heads / p.cache.num_kv_heads, slices = slices_per_group(group);
  const int kv_head = blockIdx.x / slices, first_query = blockIdx.x % slices * GROUP;
  const int first_head = kv_head * group + first_query;
  const int block_shift = __ffs(p.cache.block_size) - 1;  // block sizes are powers of two
  const Split s{p.block_tables + seq * p.block_tables_stride, begin,
                min(begin + p.split_size, context_len), block_shift,
                kv_head * p.cache.head_stride};

  char* shared = reinterpret_cast<char*>(dynamic_shared_floats());
  auto stage = [&](int tile) { return S{shared + tile % 2 * S::BYTES}; };
  const int num_tiles = (s.end - s.begin + TILE - 1) / TILE;
  load_tile<C, HEAD_DIM>(p, s, s.begin, stage(0), kv_head);
  cp_async_commit();

  // This lane's slice of every query head of the slice, pre-scaled (0 for the heads
  // that pad the group to GROUP: computed, never stored).
  float q[GROUP][VEC];
  const T* query = static_cast<const T*>(p.query) + seq * p.query_seq_stride;
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      q[g][e] = first_query + g < group
                    ? to_float(query[(first_head + g) * p.query_head_stride + lane * VEC + e]) *
                          p.scale * LOG2E
                    : 0.f;
  Running<GROUP, VEC> r;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    r.m[g] = -INFINITY;
    r.l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.acc[g][e] = 0.f;
  }

  for (int t = 0; t < num_tiles; ++t) {
    // Tile t + 1 goes into the stage tile t - 1 used, which every thread has left
    // (the barrier at the end of the last iteration), while tile t lands.
    if (t + 1 < num_tiles)
      load_tile<C, HEAD_DIM>(p, s, s.begin + (t + 1) * TILE, stage(t + 1), kv_head);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of tile t are done...
    __syncthreads();     // ...and every other thread's
    attend_tile<C, HEAD_DIM, GROUP>(stage(t), s.begin + t * TILE, s.end, q, r);
    __syncthreads();  // tile t's stage is free again
  }

  // Merge the rows' running states through shared memory (the stages are done with).
  float* merge = dynamic_shared_floats();
  auto at = [&](int row, int g) { return merge + (row * GROUP + g) * (HEAD_DIM + 2); };
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) at(z, g)[lane * VEC + e] = r.acc[g][e];
    if (lane == 0) {
      at(z, g)[HEAD_DIM] = r.m[g];
      at(z, g)[HEAD_DIM + 1] = r.l[g];
    }
  }
  __syncthreads();
  const bool single = p.max_num_partitions == 1;
  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    if (first_query + g >= group) break;  // padding: later i are padding too
    float m = -INFINITY;
    for (int row = 0; row < ROWS; ++row) m = fmaxf(m, at(row, g)[HEAD_DIM]);
    float l = 0.f, acc = 0.f;
    for (int row = 0; row < ROWS; ++row) {
      const float w = exp2f(at(row, g)[HEAD_DIM] - m);  // 0 for a row that saw no token
      l += w * at(row, g)[HEAD_DIM + 1];
      acc += w * at(row, g)[d];
    }
    const int64_t head = int64_t(seq) * p.num_heads + first_head + g;
    if (single) {
      static_cast<T*>(p.out)[head * HEAD_DIM + d] = from_float<T>(acc / l);
    } else {
      const int64_t partial = head * p.max_num_partitions + split;
      p.partial_out[partial * HEAD_DIM + d] = acc / l;
      if (d == 0) p.partial_lse[partial] = m + log2f(l);
    }
  }
}

// One thread block per (head, sequence), a thread per dimension: weigh the splits by
// their share of the softmax's denominator, 2^(lse - max lse), and add them up.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(HEAD_DIM) paged_attention_v3_reduce_kernel(const DecodeParams p) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int splits = (p.context_lens[seq] + p.split_size - 1) / p.split_size;
  const int64_t first = (int64_t(seq) * p.num_heads + head) * p.max_num_partitions;
  const float* lse = p.partial_lse + first;
  float max_lse = -INFINITY;
  for (int j = 0; j < splits; ++j) max_lse = fmaxf(max_lse, lse[j]);
  float total = 0.f, acc = 0.f;
  for (int j = 0; j < splits; ++j) {
    const float w = exp2f(lse[j] - max_lse);
    total += w;
    acc += w * p.partial_out[(first + j) * HEAD_DIM + d];
  }
  static_cast<T*>(p.out)[(int64_t(seq) * p.num_heads + head) * HEAD_DIM + d] =
      from_float<T>(acc / total);
}

// Call fn(IntTag<GROUP>{}) for the thread block's query heads.
template <typename Fn>
void dispatch_group(int group, Fn&& fn) {
  switch (queries_per_block(group)) {
    case 1: return fn(IntTag<1>{});
    case 2: return fn(IntTag<2>{});
    case 4: return fn(IntTag<4>{});
    case 8: return fn(IntTag<8>{});
  }
}

}  // namespace v3

void paged_attention_v3(const DecodeParams& p, DType dtype, DType cache_dtype, void* stream) {
  if (p.batch == 0) return;  // a grid may not be empty
  const int block_size = p.cache.block_size;
  if (block_size <= 0 || (block_size & (block_size - 1)) || p.split_size <= 0 ||
      p.split_size % V3_TILE_SIZE ||
      int64_t(p.split_size) * p.max_num_partitions < p.max_context_len)
    throw std::invalid_argument(
        "paged_attention_v3 needs a power-of-two block_size and splits of a multiple of " +
        std::to_string(V3_TILE_SIZE) + " tokens covering max_context_len, got block_size " +
        std::to_string(block_size) + ", " + std::to_string(p.max_num_partitions) +
        " splits of " + std::to_string(p.split_size));
  const int group = p.num_heads / p.cache.num_kv_heads;
  const dim3 grid(p.cache.num_kv_heads * v3::slices_per_group(group), p.batch,
                  p.max_num_partitions);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_cache_dtype(dtype, cache_dtype, [&](auto type, auto cache_type) {
    dispatch_head_dim(p.cache.head_dim, [&](auto head_dim) {
      using T = typename decltype(type)::type;
      using C = typename decltype(cache_type)::type;
      constexpr int D = decltype(head_dim)::value;
      v3::dispatch_group(group, [&](auto queries) {
        constexpr int GROUP = decltype(queries)::value;
        auto kernel = v3::paged_attention_v3_kernel<T, C, D, GROUP>;
        const size_t shared = v3::shared_bytes<C, D, GROUP>();
        allow_shared_memory(kernel, shared);
        kernel<<<grid, v3::NUM_THREADS, shared, s>>>(p);
      });
      if (p.max_num_partitions > 1) {
        auto reduce = v3::paged_attention_v3_reduce_kernel<T, D>;
        reduce<<<dim3(p.num_heads, p.batch), D, 0, s>>>(p);
      }
    });
  });
  check_launch("paged_attention_v3_kernel");
}

}  // namespace minipaged

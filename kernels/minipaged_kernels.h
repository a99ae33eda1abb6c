// minipaged_kernels.h: the host-side entry points of the CUDA kernels, in plain C++.
//
// The torch binding (torch_binding.cpp) fills these structs from tensors and calls the
// launchers; the .cu files define them.  Nothing here needs torch or the CUDA headers:
// pointers are untyped (the DType says what they hold), strides are in elements, and
// the CUDA stream travels as a void*.
//
// The cache layout is minipaged's contract: per layer, key_cache and value_cache are each
// [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous; slot s is block
// s / block_size, offset s % block_size.
#pragma once

#include <cstddef>
#include <cstdint>

namespace minipaged {

// The dtypes the kernels accept, numbered as the torch binding passes them: the first
// three for queries and caches, the last three for a quantized cache (kv_quant.py).
enum class DType : int {
  kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3, kFloat8E5M2 = 4, kInt8 = 5
};

// Where the kernels find one layer's paged cache.  Keys and values share the strides.
// A quantized cache's element means element * scale[block, slot, kv_head], the scales
// float32 at k_scale / v_scale with the scale strides (all 0 for fp8's one per layer); a cache
// in the query's dtype has none (nullptr).
struct CacheView {
  const void* key;
  const void* value;
  int64_t block_stride, token_stride, head_stride;
  int block_size, num_kv_heads, head_dim;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_block_stride = 0, scale_slot_stride = 0, scale_head_stride = 0;
};

// write_kv: token t's key and value rows go to slot slot_mapping[t] (-1: skip the token).
struct WriteKVParams {
  const void* key;    // [num_tokens, num_kv_heads, head_dim]
  const void* value;  // same shape
  int64_t key_token_stride, key_head_stride, value_token_stride, value_head_stride;
  const int64_t* slot_mapping;  // [num_tokens]
  int num_tokens;
  CacheView cache;  // written through const_cast: the one kernel that stores into it
};

// Decode: one new query token per sequence attends to the context_lens[b] tokens of
// its sequence in the cache.
struct DecodeParams {
  void* out;           // [batch, num_heads, head_dim], contiguous, the query's dtype
  const void* query;   // [batch, num_heads, head_dim], head_dim contiguous
  int64_t query_seq_stride, query_head_stride;
  CacheView cache;
  const int32_t* block_tables;  // [batch, max_blocks_per_seq], rows contiguous
  int64_t block_tables_stride;
  const int32_t* context_lens;  // [batch]
  float scale;
  int batch, num_heads;
  int max_context_len;  // >= every context_lens[b], known on the host without a sync
  // v2 and v3: one result per (sequence, head, partition), merged by the reduce kernel.
  // v3's partitions are its splits, of split_size tokens each (v2's: PARTITION_SIZE).
  float* partial_out;   // [batch, num_heads, max_num_partitions, head_dim]
  float* partial_lse;   // [batch, num_heads, max_num_partitions]
  int max_num_partitions;
  int split_size = 0;
};

// Query heads one thread block serves: a whole GQA group, or a slice of a bigger one.
constexpr int MAX_QUERIES_PER_BLOCK = 8;
// Tokens per v2 partition: a multiple of every block size.
constexpr int PARTITION_SIZE = 512;
// v3: tokens per tile (a split is a multiple of it), and the most query heads a thread
// block serves (the GQA group rounded up to a power of two, or a slice of it).
constexpr int V3_TILE_SIZE = 32;
constexpr int V3_MAX_QUERIES_PER_BLOCK = 8;

void write_kv(const WriteKVParams& params, DType dtype, void* stream);
void paged_attention_v0(const DecodeParams& params, DType dtype, void* stream);
// Versions 1 and 2 also read a quantized cache (cache_dtype fp8 or int8, with scales).
void paged_attention_v1(const DecodeParams& params, DType dtype, DType cache_dtype,
                        void* stream);
void paged_attention_v2(const DecodeParams& params, DType dtype, DType cache_dtype,
                        void* stream);
// Version 3 splits the context in params.max_num_partitions splits of params.split_size
// tokens; with more than one, params.partial_out and partial_lse hold their results.
void paged_attention_v3(const DecodeParams& params, DType dtype, DType cache_dtype,
                        void* stream);

// Shared memory one v1 thread block needs, static and dynamic (it holds every logit of
// its context), and the most the current device grants one block: v1 runs only where
// the first fits.
size_t paged_attention_v1_shared_memory(int num_heads, int num_kv_heads, int head_dim,
                                        int max_context_len);
size_t max_shared_memory_per_block();

}  // namespace minipaged

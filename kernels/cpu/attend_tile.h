// The inner loop of the CPU kernel as one small scalar function, `attend_tile`: lesson
// 07's exercise (exercises/cpu_attend_tile.cpp), whose reference is attend_tile.cpp.
//
// paged_attention.cpp calls it only when built with -DMINIPAGED_ATTEND_TILE, which
// `cpu_ops.build_with_attend_tile` alone sets: the package's own build keeps its
// vectorized two passes (scores, then exponentials weighting the values) and never
// reads this file.  attend_tile does the same work as the Triton kernel's _attend_tile,
// for one query row, one position and one float at a time, with the online softmax
// (Milakov & Gimelshein 2018; FlashAttention): one pass over the keys and values.
//
// The kernel and attend_tile are two translation units: the kernel, with all of
// torch's headers, compiles once per build folder, and attend_tile, over c10's few,
// again in seconds each time it changes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

// Where one sequence's keys and values for one KV head lie in the paged cache
// ([num_blocks, block_size, num_kv_heads, head_dim], contiguous): position pos is in
// physical block block_table[pos / block_size], at slot pos % block_size (§4.1).
template <typename cache_t>
struct PagedKV {
  const cache_t* key_cache;
  const cache_t* value_cache;
  const int32_t* block_table;  // the sequence's row of the block tables
  int64_t block_size, num_kv_heads, kv_head, head_dim;
};

// One query row's softmax so far: its largest score, the sum of exp(score - max) over
// the positions seen, and the values weighted by those exps (head_dim floats).
struct RunningSoftmax {
  float max;
  float sum;
  float* acc;
};

// Fold positions [first, last) of the sequence into `state`: for each, the score
// scale * (q . key), then the online softmax's update.  q is head_dim floats.
template <typename cache_t>
void attend_tile(const float* q, const PagedKV<cache_t>& kv, int64_t first, int64_t last,
                 float scale, RunningSoftmax& state);

// The cache dtypes the kernel reads through attend_tile (a cache of the query's dtype:
// float32, float64, fp16, bf16), instantiated after its definition by the translation
// unit `cpu_ops.build_with_attend_tile` writes.
#define ATTEND_TILE_INSTANCE(cache_t)                                                  \
  template void attend_tile<cache_t>(const float*, const PagedKV<cache_t>&, int64_t, \
                                     int64_t, float, RunningSoftmax&);

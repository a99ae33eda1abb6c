// Lesson 07: the CPU kernel's inner loop, in C++: the block-table walk and the online
// softmax, one query row at a time (§4.1; FlashAttention's recurrence, section 3).
//
// Write `attend_tile`.  kernels/cpu/paged_attention.cpp calls it, when built for this
// exercise, for every query row (one query head of one new token) and every partition
// of up to 256 positions of its sequence, with `state` holding what the row has seen so
// far.  For each position pos in [first, last):
//   1. find its key and value: position pos is in physical block
//      kv.block_table[pos / kv.block_size] at slot pos % kv.block_size, and the cache is
//      [num_blocks, block_size, num_kv_heads, head_dim]: the row starts at
//      ((block * block_size + slot) * num_kv_heads + kv_head) * head_dim;
//   2. its score: scale times the dot product of q and the key (static_cast<float>
//      widens each cache element, whatever its dtype);
//   3. fold it in: a score above state.max rescales state.sum and state.acc by
//      exp(old max - score) and becomes the max; then add exp(score - max) to state.sum
//      and that weight times the value to state.acc.
// Do not read positions outside [first, last): the slots nobody owns hold NaN.
//
// This build (cpu_ops.build_with_attend_tile) replaces the kernel's vectorized passes
// with your function; the package's own kernel is not changed.  A compile error is
// reported in one line.  Check with `make check LESSON=07`.
#include <c10/util/Exception.h>  // TORCH_CHECK_NOT_IMPLEMENTED: the stub's "not implemented"

#include "attend_tile.h"  // PagedKV, RunningSoftmax (kernels/cpu/attend_tile.h)

#include <cmath>

template <typename cache_t>
void attend_tile(const float* q, const PagedKV<cache_t>& kv, int64_t first, int64_t last,
                 float scale, RunningSoftmax& state) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "write attend_tile() in exercises/cpu_attend_tile.cpp");
}

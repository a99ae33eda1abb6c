// Lesson 08: the CUDA kernel's inner loop, version 1's phase 1 (the paper's §4.1 and
// §5.1): q·k for every token of the range and every query head of the thread block.
//
// Write `qk_logits`.  Every one of the thread block's NUM_THREADS (128) threads runs it,
// as WARP_SIZE-lane warps; the thread's own numbers are threadIdx.x, its warp
// threadIdx.x / WARP_SIZE and its lane threadIdx.x % WARP_SIZE.  Split the work as
// section 4 of the lesson draws it:
//   1. warp w takes the logical blocks b = r.first_block + w, + NUM_WARPS, ... while
//      b < r.end_block; its 32 lanes split into BLOCK_SIZE thread groups of
//      GROUP_THREADS = WARP_SIZE / BLOCK_SIZE lanes, group g on token b * BLOCK_SIZE + g;
//   2. a token's key row, KV head r.kv_head, starts at element
//      r.block_table[b] * p.cache.block_stride + g * p.cache.token_stride + r.head_offset
//      of (const C*) p.cache.key; the lanes of a group read it in 16-byte pieces of
//      K_VEC = 16 / sizeof(C) elements, lane j of the group on pieces j, j +
//      GROUP_THREADS, ... (load_floats<C, K_VEC>(src, dst) widens one piece to floats);
//   3. each lane adds up q[i][d] x key[d] over its pieces, for each query head
//      i < qs.count (q is already scaled); group_sum<GROUP_THREADS>(x) then gives every
//      lane of the group the group's total (a shuffle: every lane must call it, the same
//      number of times); multiply it by
//      slot_scale<C>(p.cache.k_scale, p.cache, r.block_table[b], g, r.kv_head), a
//      quantized cache's scale (lesson 14; it is 1 for a cache of the query's dtype, the
//      only kind this exercise's build reads);
//   4. one lane of the group writes logit i of token t to logits[i * logits_stride +
//      t - r.begin], and every thread leaves in row_max[i] the largest logit it wrote
//      (-INFINITY if none; set all MAX_QUERIES of them).
// A token t >= r.end (the tail of the last block) is no token of the sequence: its slot
// holds NaN, so read nothing there and write no logit, but still take part in the
// shuffles.  The emulator runs every thread as a fiber, so a thread that skips a shuffle
// its group takes is a reported deadlock.
//
// This file is included inside `namespace minipaged` of kernels/paged_attention_v1.cu,
// after everything the function uses (common.cuh's helpers, QuerySlice, TokenRange);
// cuda_build.build_with_qk_logits builds version 2 (which runs v1's thread block on
// each 512-token partition) in the CPU emulator with it, for head_dim 64; the package's
// own kernel is not changed.  Check with `make check LESSON=08` (it needs
// the CUDA toolkit's headers, not a GPU).
template <typename C, int HEAD_DIM, int BLOCK_SIZE>
__device__ void qk_logits(const DecodeParams& p, const TokenRange& r, const QuerySlice& qs,
                          const float (&q)[MAX_QUERIES][HEAD_DIM], float* logits,
                          int logits_stride, float (&row_max)[MAX_QUERIES]) {
  emulated_trap("NotImplementedError: write qk_logits() in exercises/cuda_qk_logits.cu");
}

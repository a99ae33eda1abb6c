// The reference `attend_tile` (declared in attend_tile.h): the CPU kernel's inner loop,
// scalar, with the online softmax.  Lesson 07's exercise exercises/cpu_attend_tile.cpp
// asks for this function; `minipaged check 07` builds the kernel with that file in
// place of this one.
#include "attend_tile.h"

#include <cmath>

template <typename cache_t>
void attend_tile(const float* q, const PagedKV<cache_t>& kv, int64_t first, int64_t last,
                 float scale, RunningSoftmax& state) {
  for (int64_t pos = first; pos < last; ++pos) {
    // The block table turns the position into a physical block and a slot (§4.1).
    const int64_t block = kv.block_table[pos / kv.block_size];
    const int64_t slot = block * kv.block_size + pos % kv.block_size;
    const int64_t offset = (slot * kv.num_kv_heads + kv.kv_head) * kv.head_dim;
    const cache_t* k = kv.key_cache + offset;
    const cache_t* v = kv.value_cache + offset;
    float score = 0.f;
    for (int64_t d = 0; d < kv.head_dim; ++d) score += q[d] * static_cast<float>(k[d]);
    score *= scale;
    // A new largest score: what came before was weighted by exp(score' - old max), and
    // is rescaled to the new max (the first position rescales nothing: exp(-inf) = 0).
    if (score > state.max) {
      const float rescale = std::exp(state.max - score);
      state.sum *= rescale;
      for (int64_t d = 0; d < kv.head_dim; ++d) state.acc[d] *= rescale;
      state.max = score;
    }
    const float weight = std::exp(score - state.max);
    state.sum += weight;
    for (int64_t d = 0; d < kv.head_dim; ++d) state.acc[d] += weight * static_cast<float>(v[d]);
  }
}

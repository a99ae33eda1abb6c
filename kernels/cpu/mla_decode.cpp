// Multi-head latent attention's absorbed decode on the CPU (DeepSeek-V2 §2.1;
// minipaged/ops/mla.py explains the absorbed form).  Every query head of a sequence
// attends to the same latent rows [c_kv (rank values), k_pe (rope values)] of the paged
// latent cache [num_blocks, block_size, rank + rope]: the score is the query row
// [q_latent, q_pe] dotted with the whole latent row, the output the weighted sum of its
// c_kv part.  So one task takes a sequence and a chunk of its heads, and reads each
// latent row once, through the block table, for all of them: a head's key and value are
// the same bytes.  (The paged_attention kernel, given the latent cache as one KV head of
// keys and again as values, reads each row twice.)
//
// The softmax is online (a running max, sum and weighted sum per head), in float32; an
// fp8 cache's bytes are widened and times its one scale.  The split into tasks depends
// on the shapes only, so the result does not depend on the number of threads.
//
// Validate against the naive oracle: pytest tests/test_mla.py
// ATen's and the dispatcher's headers, not <torch/extension.h>: that one brings pybind11
// and torch's C++ frontend, whose headers alone compile about four times as long as these.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kHeadsPerTask = 8;  // a chunk's accumulators stay in the L1 cache
constexpr int64_t kLanes = 64;        // partial sums of a dot product: four AVX-512 vectors

// a . b over n floats, in kLanes independent partial sums the compiler turns into vector
// multiply-adds (one running sum would be a chain of dependent scalar adds, as float
// addition may not be reordered), then added up in a fixed order.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) part[k] += a[d + k] * b[d + k];
  }
  float total = 0.f;
  for (; d < n; ++d) total += a[d] * b[d];
  for (int64_t k = 0; k < kLanes; ++k) total += part[k];
  return total;
}

template <typename query_t, typename cache_t>
void attend(const query_t* query, const cache_t* cache, const int32_t* tables,
            const int32_t* lens, float* out, int64_t batch, int64_t heads, int64_t rank,
            int64_t width, int64_t table_width, int64_t block_size, float scale,
            float kv_scale) {
  const int64_t chunks = (heads + kHeadsPerTask - 1) / kHeadsPerTask;
  at::parallel_for(0, batch * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(kHeadsPerTask * width), acc(kHeadsPerTask * rank), row(width);
    float max[kHeadsPerTask], sum[kHeadsPerTask];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / chunks, first = (task % chunks) * kHeadsPerTask;
      const int64_t count = std::min(kHeadsPerTask, heads - first);
      for (int64_t h = 0; h < count; ++h) {
        const query_t* src = query + (b * heads + first + h) * width;
        for (int64_t d = 0; d < width; ++d) q[h * width + d] = static_cast<float>(src[d]) * scale;
        max[h] = -std::numeric_limits<float>::infinity();
        sum[h] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t* table = tables + b * table_width;
      for (int64_t pos = 0; pos < lens[b]; ++pos) {
        const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size +
                             pos % block_size;
        const cache_t* latent = cache + slot * width;
        for (int64_t d = 0; d < width; ++d) row[d] = static_cast<float>(latent[d]) * kv_scale;
        for (int64_t h = 0; h < count; ++h) {
          const float score = dot(q.data() + h * width, row.data(), width);
          float* ah = acc.data() + h * rank;
          if (score > max[h]) {  // a new maximum: rescale what was summed under the old
            const float rescale = std::exp(max[h] - score);
            sum[h] *= rescale;
            for (int64_t d = 0; d < rank; ++d) ah[d] *= rescale;
            max[h] = score;
          }
          const float weight = std::exp(score - max[h]);
          sum[h] += weight;
          for (int64_t d = 0; d < rank; ++d) ah[d] += weight * row[d];
        }
      }
      for (int64_t h = 0; h < count; ++h) {
        float* dst = out + (b * heads + first + h) * rank;
        for (int64_t d = 0; d < rank; ++d) dst[d] = acc[h * rank + d] / sum[h];
      }
    }
  });
}

template <typename query_t>
void dispatch_cache(const at::Tensor& query, const at::Tensor& cache,
                    const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                    int64_t rank, float scale, float kv_scale) {
  auto run = [&](const auto* cache_ptr) {
    attend(query.data_ptr<query_t>(), cache_ptr, tables.data_ptr<int32_t>(),
           lens.data_ptr<int32_t>(), out.data_ptr<float>(), query.size(0), query.size(1), rank,
           query.size(2), tables.size(1), cache.size(1), scale, kv_scale);
  };
  switch (cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return run(static_cast<const c10::Float8_e4m3fn*>(cache.data_ptr()));
    case at::kFloat8_e5m2:
      return run(static_cast<const c10::Float8_e5m2*>(cache.data_ptr()));
    default:
      TORCH_CHECK(cache.scalar_type() == query.scalar_type(),
                  "mla_decode reads a cache of the query's dtype or fp8");
      return run(static_cast<const query_t*>(cache.data_ptr()));
  }
}

}  // namespace

// query [B, H, rank + rope] (q_latent, then q_pe) contiguous; cache [num_blocks,
// block_size, rank + rope] contiguous; block_tables [B, W] and context_lens [B] int32;
// kv_scale a float32 number for an fp8 cache -> [B, H, rank] float32.
at::Tensor mla_decode(at::Tensor query, at::Tensor cache, at::Tensor block_tables,
                         at::Tensor context_lens, int64_t rank, double scale,
                         std::optional<at::Tensor> kv_scale) {
  TORCH_CHECK(query.dim() == 3 && cache.dim() == 3 && query.size(2) == cache.size(2),
              "mla_decode takes query [B, H, L] and a latent cache [blocks, block_size, L]");
  query = query.contiguous();
  TORCH_CHECK(cache.is_contiguous(), "mla_decode reads a contiguous latent cache");
  block_tables = block_tables.to(at::kInt).contiguous();
  context_lens = context_lens.to(at::kInt).contiguous();
  const float factor = kv_scale ? kv_scale->item<float>() : 1.f;
  auto out = at::empty({query.size(0), query.size(1), rank}, query.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "mla_decode", [&] {
    dispatch_cache<scalar_t>(query, cache, block_tables, context_lens, out, rank,
                             static_cast<float>(scale), factor);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("mla_decode(Tensor query, Tensor cache, Tensor block_tables, Tensor context_lens, "
        "int rank, float scale, Tensor? kv_scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) { m.impl("mla_decode", &mla_decode); }

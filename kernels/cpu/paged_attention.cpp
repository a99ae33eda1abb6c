// PagedAttention on the CPU, in C++ (paper §4.1): every query row reads its sequence's
// keys and values block by block through the block table, straight from the paged
// cache.  Nothing is gathered into a dense copy first, which is what the torch
// reference backend does and what makes it slow at long contexts: at 96 sequences of
// 250 tokens a decode step's keys and values are a gigabyte, read once here instead of
// copied and read again.
//
// One function serves decode and prefill: query row t belongs to the sequence whose
// block table is row_table[t] and sees the first row_len[t] positions of it (decode:
// the whole context; prefill: the cached prefix and the new tokens up to itself).
// Each (row, KV head) is one task over at::parallel_for, so the result does not depend
// on the number of threads: every output element is summed by one thread, in order.
//
// Built on first use by minipaged/ops/cpu_ops.py.  Validate (against the contiguous
// oracle) and time (against the torch backend's gather, on this machine's cores):
//   pytest tests/test_ops_cpu.py
//   minipaged bench attention --preset cpu --backends torch cpu
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
float dot(const float* q, const scalar_t* k, int64_t head_dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename scalar_t>
void axpy(float p, const scalar_t* v, float* acc, int64_t head_dim) {
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// The first `len` positions of a sequence, block by block: f(pos, offset of the
// position's row for `kv_head` in the cache).  Position pos is in physical block
// table[pos / block_size] at slot pos % block_size (§4.1); walking whole blocks spares
// a division per position.
template <typename F>
void for_each_position(const int32_t* table, int64_t len, int64_t kv_head, int64_t num_kv_heads,
                       int64_t block_size, int64_t head_dim, F f) {
  for (int64_t first = 0, b = 0; first < len; first += block_size, ++b) {
    int64_t row = static_cast<int64_t>(table[b]) * block_size * num_kv_heads + kv_head;
    for (int64_t pos = first; pos < std::min(len, first + block_size); ++pos) {
      f(pos, row * head_dim);
      row += num_kv_heads;
    }
  }
}

// One query row's `group` heads (those sharing KV head `kv_head`, GQA) against the first
// `len` positions of one sequence: scores, softmax, weighted sum of values.
template <typename scalar_t>
void attend(const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
            const int32_t* table, int64_t len, int64_t kv_head, int64_t group,
            int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
            scalar_t* out, std::vector<float>& buffer) {
  buffer.assign(group * (2 * head_dim + len + 1), 0.f);
  float* q = buffer.data();              // [group, head_dim], widened to float
  float* acc = q + group * head_dim;     // [group, head_dim]
  float* scores = acc + group * head_dim;  // [group, len]
  float* total = scores + group * len;   // [group]
  for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(query[i]);
  for_each_position(table, len, kv_head, num_kv_heads, block_size, head_dim,
                    [&](int64_t pos, int64_t at) {
                      for (int64_t g = 0; g < group; ++g)
                        scores[g * len + pos] = scale * dot(q + g * head_dim, key_cache + at, head_dim);
                    });
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float max = *std::max_element(s, s + len);
    for (int64_t pos = 0; pos < len; ++pos) total[g] += (s[pos] = std::exp(s[pos] - max));
  }
  for_each_position(table, len, kv_head, num_kv_heads, block_size, head_dim,
                    [&](int64_t pos, int64_t at) {
                      for (int64_t g = 0; g < group; ++g)
                        axpy(scores[g * len + pos], value_cache + at, acc + g * head_dim, head_dim);
                    });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d)
      out[g * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d] / total[g]);
}

}  // namespace

// query [T, num_heads, head_dim]; key_cache, value_cache [num_blocks, block_size,
// num_kv_heads, head_dim]; block_tables [S, W] int32; row_table, row_len [T] int32.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache,
                              torch::Tensor value_cache, torch::Tensor block_tables,
                              torch::Tensor row_table, torch::Tensor row_len, double scale) {
  // The pool is indexed as one contiguous array; the small tensors are made so.
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the CPU kernel reads contiguous key and value caches");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  row_table = row_table.contiguous();
  row_len = row_len.contiguous();
  auto out = torch::empty_like(query);
  const int64_t rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* which = row_table.data_ptr<int32_t>();
  const int32_t* lens = row_len.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_cpu", [&] {
        const scalar_t* q = query.data_ptr<scalar_t>();
        const scalar_t* k = key_cache.data_ptr<scalar_t>();
        const scalar_t* v = value_cache.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        at::parallel_for(0, rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> buffer;  // reused by this thread's tasks
          for (int64_t task = begin; task < end; ++task) {
            int64_t t = task / num_kv_heads, kv_head = task % num_kv_heads;
            int64_t offset = (t * num_heads + kv_head * group) * head_dim;
            attend(q + offset, k, v, tables + which[t] * width, lens[t], kv_head, group,
                   num_kv_heads, block_size, head_dim, static_cast<float>(scale), o + offset,
                   buffer);
          }
        });
      });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "PagedAttention over the paged KV cache, each query row through its block table");
}

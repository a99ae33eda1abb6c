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
// A quantized cache (fp8 or int8, minipaged/ops/kv_quant.py) stores a byte per element
// that means byte * scale, the scale one float per (slot, KV head): widen() turns the
// byte into a float (fp8: a lookup in a 256-entry table), and the scale multiplies a
// whole dot product or value row at once, since it is the same for a position's
// head_dim elements.
//
// Built on first use by minipaged/ops/cpu_ops.py.  Validate (against the contiguous
// oracle) and time (against the torch backend's gather, on this machine's cores):
//   pytest tests/test_ops_cpu.py
//   minipaged bench attention --preset cpu --backends torch cpu
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Every fp8 byte's value, computed once by c10's conversion: a load per element in the
// dot products instead of unpacking sign, exponent and mantissa.
template <typename fp8_t>
std::array<float, 256> fp8_table() {
  std::array<float, 256> table;
  for (int bits = 0; bits < 256; ++bits)
    table[bits] = static_cast<float>(fp8_t(static_cast<uint8_t>(bits), fp8_t::from_bits()));
  return table;
}
const std::array<float, 256> kE4M3 = fp8_table<c10::Float8_e4m3fn>();
const std::array<float, 256> kE5M2 = fp8_table<c10::Float8_e5m2>();

template <typename cache_t>
inline float widen(cache_t x) { return static_cast<float>(x); }  // the model's dtype, int8
inline float widen(c10::Float8_e4m3fn x) { return kE4M3[x.x]; }
inline float widen(c10::Float8_e5m2 x) { return kE5M2[x.x]; }

template <typename cache_t>
float dot(const float* q, const cache_t* k, int64_t head_dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * widen(k[d]);
  return sum;
}

template <typename cache_t>
void axpy(float p, const cache_t* v, float* acc, int64_t head_dim) {
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * widen(v[d]);
}

// A cache's dequantization scales, scale[block, slot, kv_head] = data[block *
// block_stride + slot * slot_stride + kv_head * head_stride]; strides 0 for one scale
// per layer (fp8), and for a cache that is not quantized, whose scale is 1.
struct Scales {
  const float* data;
  int64_t block_stride, slot_stride, head_stride;
  float at(int64_t block, int64_t slot, int64_t kv_head) const {
    return data[block * block_stride + slot * slot_stride + kv_head * head_stride];
  }
};

const float kOne = 1.f;

Scales scales_of(const c10::optional<torch::Tensor>& scale) {
  if (!scale) return {&kOne, 0, 0, 0};
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->dim() == 3,
              "the CPU kernel reads scales as float32 [num_blocks, block_size, num_kv_heads]");
  return {scale->data_ptr<float>(), scale->stride(0), scale->stride(1), scale->stride(2)};
}

// The first `len` positions of a sequence, block by block: f(pos, offset of the
// position's row for `kv_head` in the cache, physical block).  Position pos is in
// physical block table[pos / block_size] at slot pos % block_size (§4.1); walking whole
// blocks spares a division per position.
template <typename F>
void for_each_position(const int32_t* table, int64_t len, int64_t kv_head, int64_t num_kv_heads,
                       int64_t block_size, int64_t head_dim, F f) {
  for (int64_t first = 0, b = 0; first < len; first += block_size, ++b) {
    int64_t block = table[b];
    int64_t row = block * block_size * num_kv_heads + kv_head;
    for (int64_t pos = first; pos < std::min(len, first + block_size); ++pos) {
      f(pos, row * head_dim, block);
      row += num_kv_heads;
    }
  }
}

// One query row's `group` heads (those sharing KV head `kv_head`, GQA) against the first
// `len` positions of one sequence: scores, softmax, weighted sum of values.
template <typename scalar_t, typename cache_t>
void attend(const scalar_t* query, const cache_t* key_cache, const cache_t* value_cache,
            const Scales& k_scale, const Scales& v_scale, const int32_t* table, int64_t len,
            int64_t kv_head, int64_t group, int64_t num_kv_heads, int64_t block_size,
            int64_t head_dim, float scale, scalar_t* out, std::vector<float>& buffer) {
  buffer.assign(group * (2 * head_dim + len + 1), 0.f);
  float* q = buffer.data();              // [group, head_dim], widened to float
  float* acc = q + group * head_dim;     // [group, head_dim]
  float* scores = acc + group * head_dim;  // [group, len]
  float* total = scores + group * len;   // [group]
  for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(query[i]);
  for_each_position(table, len, kv_head, num_kv_heads, block_size, head_dim,
                    [&](int64_t pos, int64_t at, int64_t block) {
                      float s = scale * k_scale.at(block, pos % block_size, kv_head);
                      for (int64_t g = 0; g < group; ++g)
                        scores[g * len + pos] = s * dot(q + g * head_dim, key_cache + at, head_dim);
                    });
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float max = *std::max_element(s, s + len);
    for (int64_t pos = 0; pos < len; ++pos) total[g] += (s[pos] = std::exp(s[pos] - max));
  }
  for_each_position(table, len, kv_head, num_kv_heads, block_size, head_dim,
                    [&](int64_t pos, int64_t at, int64_t block) {
                      float s = v_scale.at(block, pos % block_size, kv_head);
                      for (int64_t g = 0; g < group; ++g)
                        axpy(s * scores[g * len + pos], value_cache + at, acc + g * head_dim,
                             head_dim);
                    });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d)
      out[g * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d] / total[g]);
}

// Every (query row, KV head) task of one call, for one query and one cache dtype.
template <typename scalar_t, typename cache_t>
void run(const torch::Tensor& query, const torch::Tensor& key_cache,
         const torch::Tensor& value_cache, const Scales& k_scale, const Scales& v_scale,
         const torch::Tensor& block_tables, const int32_t* which, const int32_t* lens,
         float scale, torch::Tensor& out) {
  const int64_t rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const scalar_t* q = query.data_ptr<scalar_t>();
  const cache_t* k = static_cast<const cache_t*>(key_cache.data_ptr());
  const cache_t* v = static_cast<const cache_t*>(value_cache.data_ptr());
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;  // reused by this thread's tasks
    for (int64_t task = begin; task < end; ++task) {
      int64_t t = task / num_kv_heads, kv_head = task % num_kv_heads;
      int64_t offset = (t * num_heads + kv_head * group) * head_dim;
      attend(q + offset, k, v, k_scale, v_scale, tables + which[t] * width, lens[t], kv_head,
             group, num_kv_heads, block_size, head_dim, scale, o + offset, buffer);
    }
  });
}

}  // namespace

// query [T, num_heads, head_dim]; key_cache, value_cache [num_blocks, block_size,
// num_kv_heads, head_dim], of query's dtype, or fp8 / int8 with k_scale, v_scale
// [num_blocks, block_size, num_kv_heads] float32 (any strides); block_tables [S, W] int32;
// row_table, row_len [T] int32.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache,
                              torch::Tensor value_cache, torch::Tensor block_tables,
                              torch::Tensor row_table, torch::Tensor row_len, double scale,
                              c10::optional<torch::Tensor> k_scale,
                              c10::optional<torch::Tensor> v_scale) {
  // The pool is indexed as one contiguous array; the small tensors are made so.
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the CPU kernel reads contiguous key and value caches");
  const auto cache_type = key_cache.scalar_type();
  const bool quantized = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2 ||
                         cache_type == at::kChar;
  TORCH_CHECK(quantized ? k_scale && v_scale : cache_type == query.scalar_type(),
              "the CPU kernel reads a cache of the query's dtype, or fp8 / int8 with scales");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  row_table = row_table.contiguous();
  row_len = row_len.contiguous();
  auto out = torch::empty_like(query);
  const Scales ks = scales_of(k_scale), vs = scales_of(v_scale);
  const int32_t* which = row_table.data_ptr<int32_t>();
  const int32_t* lens = row_len.data_ptr<int32_t>();
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_cpu", [&] {
        switch (cache_type) {
          case at::kFloat8_e4m3fn:
            return run<scalar_t, c10::Float8_e4m3fn>(query, key_cache, value_cache, ks, vs,
                                                     block_tables, which, lens, s, out);
          case at::kFloat8_e5m2:
            return run<scalar_t, c10::Float8_e5m2>(query, key_cache, value_cache, ks, vs,
                                                   block_tables, which, lens, s, out);
          case at::kChar:
            return run<scalar_t, int8_t>(query, key_cache, value_cache, ks, vs, block_tables,
                                         which, lens, s, out);
          default:
            return run<scalar_t, scalar_t>(query, key_cache, value_cache, ks, vs, block_tables,
                                           which, lens, s, out);
        }
      });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "PagedAttention over the paged KV cache, each query row through its block table");
}

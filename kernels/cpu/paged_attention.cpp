// PagedAttention on the CPU, in C++ (paper §4.1): every query row reads its sequence's
// keys and values block by block through the block table, straight from the paged
// cache.  Nothing is gathered into a dense copy first, which is what the torch
// reference backend does and what makes it slow at long contexts: at 96 sequences of
// 250 tokens a decode step's keys and values are a gigabyte, read once here instead of
// copied and read again.  Decode reads every byte once for about one multiply-add, so
// the goal is the memory's read bandwidth (`minipaged bench attention --preset cpu-serving`).
//
// One function serves decode and prefill: sequence b's query rows are
// query_start_loc[b] .. query_start_loc[b+1], its last positions, and row j of them sees
// seq_lens[b] - n_new + j + 1 positions (decode: one row, the whole context).  The work
// is split three ways (`Tile`, `plan`):
// - by KV head: the GQA group's query heads share each key and value read;
// - by tiles of up to kTileRows consecutive query rows of one sequence (prefill,
//   chunked prefill, speculative verification): each key and value is read once per
//   tile, not once per row;
// - by partitions of kPartitionSize positions (vLLM's paged_attention_v2): one long
//   sequence keeps every core busy, each partition's softmax is kept as (max, sum,
//   weighted values) and `reduce` merges them.
// The split depends on the shapes only, and every output is summed by one thread in a
// fixed order, so the result does not depend on the number of threads.
//
// Each key or value row is widened to float32 once (`widen`) and every query of the
// tile uses it; all arithmetic is float32 (fp32 accumulation for bf16 and fp16 caches,
// read natively).  A quantized cache (fp8 or int8, minipaged/ops/kv_quant.py) stores a
// byte per element that means byte * scale, the scale one float per (slot, KV head):
// the byte is widened with a few vector instructions (fp8 through fp16's bit layout),
// and the scale multiplies a whole dot product or value row at once.  The vector width
// is the build's: AVX-512 (16 floats) or AVX2 (8), chosen by minipaged/ops/cpu_ops.py
// from the CPU's flags, or one float at a time elsewhere.
//
// `write_kv_quantized` is the quantizing store of new keys and values, the rules of
// kv_quant.write_kv in one pass over the tokens instead of a dozen torch operations.
//
// Validate (against the contiguous oracle) and time (against the torch backend's
// gather, and the machine's read bandwidth):
//   pytest tests/test_ops_cpu.py tests/test_kv_quant.py
//   minipaged bench attention --preset cpu-serving --backends torch cpu
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef MINIPAGED_ATTEND_TILE
#include "attend_tile.h"
#endif

namespace {

// -- W floats at a time ----------------------------------------------------------------
// load_floats(p) reads W elements of any cache or query dtype as W floats, exactly.

// fp8 e4m3 (sign, 4 exponent bits of bias 7, 3 mantissa bits) as fp16 bits (bias 15):
// the same fields shifted into place give the value times 2^-8, for normal and
// subnormal bytes alike; 0x7F (NaN, e4m3fn has no infinity) becomes fp16's NaN.  The
// caller multiplies by 2^8.  e5m2 is fp16's upper byte: a shift alone.
template <typename u16v>
inline u16v e4m3_as_half_bits(u16v byte) {
  u16v magnitude = byte & 0x7F;
  return ((byte & 0x80) << 8) | (magnitude << 7) | (u16v)(magnitude == 0x7F);
}
constexpr float kE4M3HalfScale = 256.f;

#if defined(__AVX512F__)
constexpr int64_t W = 16;
using fvec = __m512;
typedef uint16_t u16x16 __attribute__((vector_size(32)));
inline fvec splat(float x) { return _mm512_set1_ps(x); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline float hsum(fvec a) { return _mm512_reduce_add_ps(a); }
inline void store(float* p, fvec a) { _mm512_storeu_ps(p, a); }
inline fvec load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline fvec load_floats(const double* p) {  // float64 (a test's dtype): one at a time
  float f[W];
  for (int64_t i = 0; i < W; ++i) f[i] = static_cast<float>(p[i]);
  return load_floats(static_cast<const float*>(f));
}
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline fvec load_floats(const c10::Half* p) { return _mm512_cvtph_ps(load256(p)); }
inline fvec load_floats(const c10::BFloat16* p) {
  // A bf16 is a float32's upper half: widen each to 32 bits and shift it there.
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(p)), 16));
}
inline fvec load_floats(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p))); }
inline u16x16 bytes_as_u16(const void* p) { return (u16x16)_mm256_cvtepu8_epi16(load128(p)); }
inline fvec load_floats(const c10::Float8_e5m2* p) { return _mm512_cvtph_ps((__m256i)(bytes_as_u16(p) << 8)); }
inline fvec load_floats(const c10::Float8_e4m3fn* p) {
  fvec scaled = _mm512_cvtph_ps((__m256i)e4m3_as_half_bits(bytes_as_u16(p)));
  return mul(scaled, splat(kE4M3HalfScale));
}
#elif defined(__AVX2__)
constexpr int64_t W = 8;
using fvec = __m256;
typedef uint16_t u16x8 __attribute__((vector_size(16)));
inline fvec splat(float x) { return _mm256_set1_ps(x); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec add(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline float hsum(fvec a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline void store(float* p, fvec a) { _mm256_storeu_ps(p, a); }
inline fvec load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline fvec load_floats(const double* p) {  // float64 (a test's dtype): one at a time
  float f[W];
  for (int64_t i = 0; i < W; ++i) f[i] = static_cast<float>(p[i]);
  return load_floats(static_cast<const float*>(f));
}
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m128i load64(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
inline fvec load_floats(const c10::Half* p) { return _mm256_cvtph_ps(load128(p)); }
inline fvec load_floats(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(p)), 16));
}
inline fvec load_floats(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load64(p))); }
inline u16x8 bytes_as_u16(const void* p) { return (u16x8)_mm_cvtepu8_epi16(load64(p)); }
inline fvec load_floats(const c10::Float8_e5m2* p) { return _mm256_cvtph_ps((__m128i)(bytes_as_u16(p) << 8)); }
inline fvec load_floats(const c10::Float8_e4m3fn* p) {
  fvec scaled = _mm256_cvtph_ps((__m128i)e4m3_as_half_bits(bytes_as_u16(p)));
  return mul(scaled, splat(kE4M3HalfScale));
}
#else
constexpr int64_t W = 1;  // no vector unit we know: c10's conversions, one at a time
using fvec = float;
inline fvec splat(float x) { return x; }
inline fvec fmadd(fvec a, fvec b, fvec c) { return a * b + c; }
inline fvec add(fvec a, fvec b) { return a + b; }
inline float hsum(fvec a) { return a; }
inline void store(float* p, fvec a) { *p = a; }
template <typename T>
inline fvec load_floats(const T* p) { return static_cast<float>(*p); }
#endif

// A key or value row of `n` elements as float32: the cache itself when it holds floats,
// else `buffer`, filled once for all the queries that read the row.
template <typename T>
const float* widen_any(const T* x, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    int64_t d = 0;
    for (; d + W <= n; d += W) store(buffer + d, load_floats(x + d));
    for (; d < n; ++d) buffer[d] = static_cast<float>(x[d]);  // c10's exact conversion
    return buffer;
  }
}

// The common head sizes as constants, unrolled (as `dot` below).
template <typename T>
const float* widen(const T* x, int64_t n, float* buffer) {
  if (n == 64) return widen_any(x, 64, buffer);
  if (n == 128) return widen_any(x, 128, buffer);
  return widen_any(x, n, buffer);
}

// Two partial sums in flight: an FMA's latency is longer than its issue interval.
inline float dot_any(const float* a, const float* b, int64_t n) {
  fvec s0 = splat(0.f), s1 = splat(0.f);
  int64_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    s0 = fmadd(load_floats(a + d), load_floats(b + d), s0);
    s1 = fmadd(load_floats(a + d + W), load_floats(b + d + W), s1);
  }
  for (; d + W <= n; d += W) s0 = fmadd(load_floats(a + d), load_floats(b + d), s0);
  float sum = hsum(add(s0, s1));
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy_any(float w, const float* x, float* y, int64_t n) {
  const fvec ws = splat(w);
  int64_t d = 0;
  for (; d + W <= n; d += W) store(y + d, fmadd(ws, load_floats(x + d), load_floats(y + d)));
  for (; d < n; ++d) y[d] += w * x[d];
}

// The common head sizes get loops of a constant length, which the compiler unrolls
// completely: in these innermost loops, the loop's own counting cost a fifth of the time.
inline float dot(const float* a, const float* b, int64_t n) {
  if (n == 64) return dot_any(a, b, 64);
  if (n == 128) return dot_any(a, b, 128);
  return dot_any(a, b, n);
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  if (n == 64) return axpy_any(w, x, y, 64);
  if (n == 128) return axpy_any(w, x, y, 128);
  axpy_any(w, x, y, n);
}

// -- the cache's layout ----------------------------------------------------------------

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

// Positions [first, last) of a sequence, in order: f(pos, offset of the position's
// row for `kv_head` in the cache, physical block).  Position pos is in physical block
// table[pos / block_size] at slot pos % block_size (§4.1); walking whole blocks spares
// a division per position.
template <typename F>
void for_each_position(const int32_t* table, int64_t first, int64_t last, int64_t kv_head,
                       int64_t num_kv_heads, int64_t block_size, int64_t head_dim, F f) {
  for (int64_t pos = first; pos < last;) {
    const int64_t block = table[pos / block_size];
    const int64_t end = std::min(last, (pos / block_size + 1) * block_size);
    int64_t row = (block * block_size + pos % block_size) * num_kv_heads + kv_head;
    for (; pos < end; ++pos, row += num_kv_heads) f(pos, row * head_dim, block);
  }
}

// -- the split of the work -------------------------------------------------------------

constexpr int64_t kTileRows = 16;        // query rows that share a pass over the keys
constexpr int64_t kPartitionSize = 256;  // positions per task; its scores stay in L1

// Query rows row .. row + rows - 1, of sequence seq; row i sees first_len + i positions.
// With more than one partition, its partial softmaxes start at `partial` in the
// partials buffer.
struct Tile {
  int64_t seq, row, rows, first_len, partitions, partial;
  int64_t last_len() const { return first_len + rows - 1; }
};

struct Task {
  int64_t tile, partition, kv_head;
};

// One partition's softmax for one query head: its largest score, the sum of exp(score
// - max), and the values weighted by those exps, followed by head_dim floats.
constexpr int64_t kPartialHeader = 2;

struct Plan {
  std::vector<Tile> tiles;
  std::vector<Task> tasks;
  std::vector<int64_t> split;  // the tiles with more than one partition
  int64_t num_partials = 0;
};

Plan plan(const int32_t* starts, const int32_t* seq_lens, int64_t num_seqs, int64_t num_kv_heads,
          int64_t num_heads) {
  Plan p;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = starts ? starts[seq] : seq, end = starts ? starts[seq + 1] : seq + 1;
    const int64_t first_len = seq_lens[seq] - (end - begin) + 1;
    for (int64_t row = begin; row < end; row += kTileRows) {
      const int64_t rows = std::min(kTileRows, end - row);
      Tile tile{seq, row, rows, first_len + row - begin, 0, p.num_partials};
      tile.partitions = (tile.last_len() + kPartitionSize - 1) / kPartitionSize;
      if (tile.partitions > 1) {
        p.split.push_back(p.tiles.size());
        p.num_partials += rows * num_heads * tile.partitions;
      }
      for (int64_t part = 0; part < tile.partitions; ++part)
        for (int64_t h = 0; h < num_kv_heads; ++h)
          p.tasks.push_back({static_cast<int64_t>(p.tiles.size()), part, h});
      p.tiles.push_back(tile);
    }
  }
  return p;
}

// Run f(i) for i in [0, n) on torch's threads, each taking the next i as it finishes
// (tiles of a causal prefill differ in cost); which thread runs i changes nothing.
template <typename F>
void parallel_tasks(int64_t n, F f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buffer;  // reused by this thread's tasks
    for (int64_t i; (i = next.fetch_add(1)) < n;) f(i, buffer);
  });
}

// -- attention -------------------------------------------------------------------------

template <typename scalar_t, typename cache_t>
struct Attention {
  const scalar_t* query;
  const cache_t* key_cache;
  const cache_t* value_cache;
  Scales k_scale, v_scale;
  const int32_t* tables;
  int64_t width, num_heads, num_kv_heads, group, head_dim, block_size;
  float scale;
  scalar_t* out;
  float* partials;

  // The (row i, head g) query of `tile` whose KV head is kv_head, as an offset.
  int64_t at(const Tile& tile, int64_t i, int64_t kv_head, int64_t g) const {
    return ((tile.row + i) * num_heads + kv_head * group + g) * head_dim;
  }

  float* partial(const Tile& tile, int64_t i, int64_t kv_head, int64_t g, int64_t part) const {
    const int64_t slot = ((i * num_kv_heads + kv_head) * group + g) * tile.partitions + part;
    return partials + (tile.partial + slot) * (kPartialHeader + head_dim);
  }

  // One task: the tile's rows × the group's heads against one partition of positions:
  // scores, softmax, weighted sum of values; the output, or a partial for `reduce`.
  void attend(const Task& task, const Tile& tile, std::vector<float>& buffer) const {
    const int64_t n = tile.rows * group, kv_head = task.kv_head;
    const int64_t first = task.partition * kPartitionSize;
    const int64_t last = std::min(first + kPartitionSize, tile.last_len()), len = last - first;
    buffer.resize(n * (2 * head_dim + len + 2) + head_dim);
    float* q = buffer.data();        // [n, head_dim], widened
    float* acc = q + n * head_dim;   // [n, head_dim]
    float* scores = acc + n * head_dim;  // [n, len]
    float* max = scores + n * len;   // [n]
    float* total = max + n;          // [n]
    float* row = total + n;          // [head_dim]: the key or value row being read
    std::fill(acc, acc + n * head_dim, 0.f);
    std::fill(scores, scores + n * len, -std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = query + at(tile, i, kv_head, g);
        float* dst = q + (i * group + g) * head_dim;
        const float* wide = widen(src, head_dim, dst);
        if (wide != dst) std::copy(wide, wide + head_dim, dst);
      }
    const int32_t* table = tables + tile.seq * width;
    // Row i sees position pos when pos < first_len + i: the rows from `visible` on.
    auto visible = [&](int64_t pos) { return std::max<int64_t>(0, pos - tile.first_len + 1); };
    for_each_position(table, first, last, kv_head, num_kv_heads, block_size, head_dim,
                      [&](int64_t pos, int64_t offset, int64_t block) {
                        const float* k = widen(key_cache + offset, head_dim, row);
                        const float s = scale * k_scale.at(block, pos % block_size, kv_head);
                        for (int64_t v = visible(pos) * group; v < n; ++v)
                          scores[v * len + pos - first] = s * dot(q + v * head_dim, k, head_dim);
                      });
    for (int64_t v = 0; v < n; ++v) {
      float* s = scores + v * len;
      max[v] = *std::max_element(s, s + len);
      total[v] = 0.f;
      if (max[v] == -std::numeric_limits<float>::infinity()) continue;  // sees none of them
      for (int64_t p = 0; p < len; ++p) total[v] += (s[p] = std::exp(s[p] - max[v]));
    }
    for_each_position(table, first, last, kv_head, num_kv_heads, block_size, head_dim,
                      [&](int64_t pos, int64_t offset, int64_t block) {
                        const float* x = widen(value_cache + offset, head_dim, row);
                        const float s = v_scale.at(block, pos % block_size, kv_head);
                        for (int64_t v = visible(pos) * group; v < n; ++v)
                          axpy(s * scores[v * len + pos - first], x, acc + v * head_dim, head_dim);
                      });
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t v = i * group + g;
        if (tile.partitions == 1) {
          scalar_t* o = out + at(tile, i, kv_head, g);
          for (int64_t d = 0; d < head_dim; ++d)
            o[d] = static_cast<scalar_t>(acc[v * head_dim + d] / total[v]);
        } else {
          float* p = partial(tile, i, kv_head, g, task.partition);
          p[0] = max[v];
          p[1] = total[v];
          std::copy(acc + v * head_dim, acc + (v + 1) * head_dim, p + kPartialHeader);
        }
      }
  }

  // Merge a split tile's partitions for one KV head (paged_attention_v2's reduce): each
  // partition's sum and values rescaled from its own max to the largest.
  void reduce(const Tile& tile, int64_t kv_head, std::vector<float>& buffer) const {
    buffer.resize(head_dim);
    float* acc = buffer.data();
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t g = 0; g < group; ++g) {
        float max = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t part = 0; part < tile.partitions; ++part) {
          const float* p = partial(tile, i, kv_head, g, part);
          if (p[1] > 0.f) max = std::max(max, p[0]);
        }
        std::fill(acc, acc + head_dim, 0.f);
        for (int64_t part = 0; part < tile.partitions; ++part) {
          const float* p = partial(tile, i, kv_head, g, part);
          if (p[1] == 0.f) continue;  // positions this row does not see
          const float w = std::exp(p[0] - max);
          total += w * p[1];
          axpy(w, p + kPartialHeader, acc, head_dim);
        }
        scalar_t* o = out + at(tile, i, kv_head, g);
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[d] / total);
      }
  }
};

#ifdef MINIPAGED_ATTEND_TILE
// Lesson 07's exercise build (attend_tile.h): `attend` done by attend_tile, one query
// row at a time, each row folding the partition's positions it sees into its own
// running softmax, then written as `attend` writes it (the output, or a partial).
template <typename scalar_t, typename cache_t>
void attend_rows(const Attention<scalar_t, cache_t>& a, const Task& task, const Tile& tile,
                 std::vector<float>& buffer) {
  if constexpr (!std::is_same_v<scalar_t, cache_t>) {
    TORCH_CHECK(false, "attend_tile reads a cache of the query's dtype, not fp8 or int8");
  } else {
    const int64_t kv_head = task.kv_head, first = task.partition * kPartitionSize;
    const int64_t last = std::min(first + kPartitionSize, tile.last_len());
    const PagedKV<cache_t> kv{a.key_cache,  a.value_cache, a.tables + tile.seq * a.width,
                              a.block_size, a.num_kv_heads, kv_head, a.head_dim};
    buffer.resize(2 * a.head_dim);
    float* q = buffer.data();
    float* acc = q + a.head_dim;
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t g = 0; g < a.group; ++g) {
        const scalar_t* src = a.query + a.at(tile, i, kv_head, g);
        for (int64_t d = 0; d < a.head_dim; ++d) q[d] = static_cast<float>(src[d]);
        std::fill(acc, acc + a.head_dim, 0.f);
        RunningSoftmax state{-std::numeric_limits<float>::infinity(), 0.f, acc};
        // Row i sees the positions before first_len + i: maybe none of this partition's.
        attend_tile(q, kv, first, std::min(last, tile.first_len + i), a.scale, state);
        if (tile.partitions == 1) {
          scalar_t* o = a.out + a.at(tile, i, kv_head, g);
          for (int64_t d = 0; d < a.head_dim; ++d) o[d] = static_cast<scalar_t>(acc[d] / state.sum);
        } else {
          float* p = a.partial(tile, i, kv_head, g, task.partition);
          p[0] = state.max;
          p[1] = state.sum;
          std::copy(acc, acc + a.head_dim, p + kPartialHeader);
        }
      }
  }
}
#endif

template <typename scalar_t, typename cache_t>
void run(const torch::Tensor& query, const torch::Tensor& key_cache,
         const torch::Tensor& value_cache, const Scales& k_scale, const Scales& v_scale,
         const torch::Tensor& block_tables, const Plan& plan, float scale, torch::Tensor& out) {
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  std::vector<float> partials(plan.num_partials * (kPartialHeader + query.size(2)));
  const Attention<scalar_t, cache_t> attention{
      query.data_ptr<scalar_t>(),
      static_cast<const cache_t*>(key_cache.data_ptr()),
      static_cast<const cache_t*>(value_cache.data_ptr()),
      k_scale,
      v_scale,
      block_tables.data_ptr<int32_t>(),
      block_tables.size(1),
      num_heads,
      num_kv_heads,
      num_heads / num_kv_heads,
      query.size(2),
      key_cache.size(1),
      scale,
      out.data_ptr<scalar_t>(),
      partials.data()};
  parallel_tasks(plan.tasks.size(), [&](int64_t i, std::vector<float>& buffer) {
    const Task& task = plan.tasks[i];
#ifdef MINIPAGED_ATTEND_TILE
    attend_rows(attention, task, plan.tiles[task.tile], buffer);
#else
    attention.attend(task, plan.tiles[task.tile], buffer);
#endif
  });
  parallel_tasks(plan.split.size() * num_kv_heads, [&](int64_t i, std::vector<float>& buffer) {
    attention.reduce(plan.tiles[plan.split[i / num_kv_heads]], i % num_kv_heads, buffer);
  });
}

}  // namespace

// query [T, num_heads, head_dim]; key_cache, value_cache [num_blocks, block_size,
// num_kv_heads, head_dim], of query's dtype, or fp8 / int8 with k_scale, v_scale
// [num_blocks, num_kv_heads] float32 (any strides); block_tables [S, W] int32;
// query_start_loc [S + 1] int32 (None: one row per sequence, decode); seq_lens [S] int32.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache,
                              torch::Tensor value_cache, torch::Tensor block_tables,
                              c10::optional<torch::Tensor> query_start_loc, torch::Tensor seq_lens,
                              double scale, c10::optional<torch::Tensor> k_scale,
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
  seq_lens = seq_lens.contiguous();
  torch::Tensor starts;
  if (query_start_loc) starts = query_start_loc->contiguous();
  auto out = torch::empty_like(query);
  const Plan work = plan(query_start_loc ? starts.data_ptr<int32_t>() : nullptr,
                         seq_lens.data_ptr<int32_t>(), seq_lens.size(0), key_cache.size(2),
                         query.size(1));
  const Scales ks = scales_of(k_scale), vs = scales_of(v_scale);
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_cpu", [&] {
        switch (cache_type) {
          case at::kFloat8_e4m3fn:
            return run<scalar_t, c10::Float8_e4m3fn>(query, key_cache, value_cache, ks, vs,
                                                     block_tables, work, s, out);
          case at::kFloat8_e5m2:
            return run<scalar_t, c10::Float8_e5m2>(query, key_cache, value_cache, ks, vs,
                                                   block_tables, work, s, out);
          case at::kChar:
            return run<scalar_t, int8_t>(query, key_cache, value_cache, ks, vs, block_tables,
                                         work, s, out);
          default:
            return run<scalar_t, scalar_t>(query, key_cache, value_cache, ks, vs, block_tables,
                                           work, s, out);
        }
      });
  return out;
}

// -- the quantizing store ---------------------------------------------------------------

namespace {

constexpr float kInt8Max = 127.f;

template <typename scalar_t, typename cache_t>
void store_fp8(const scalar_t* x, cache_t* cache, const int64_t* slots, int64_t tokens,
               int64_t row, float scale) {
  const float top = static_cast<float>(std::numeric_limits<cache_t>::max());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t e = 0; e < row; ++e) {
      const float v = static_cast<float>(x[t * row + e]) / scale;
      // Clamped, so a large value saturates instead of becoming NaN; NaN stays NaN.
      cache[slots[t] * row + e] = cache_t(v > top ? top : (v < -top ? -top : v));
    }
  }
}

inline int8_t round_int8(float v) {
  const float r = std::nearbyint(v);  // to nearest even, as torch.round
  return static_cast<int8_t>(r > kInt8Max ? kInt8Max : (r < -kInt8Max ? -kInt8Max : r));
}

// kv_quant._write_int8's rule: each token's head is stored over its own scale, its
// largest magnitude over 127, kept at scale[slot, head] (a function of the token alone).
template <typename scalar_t>
void store_int8(const scalar_t* x, int8_t* cache, const int64_t* slots, int64_t tokens,
                int64_t heads, int64_t head_dim, float* scale) {
  const float tiny = std::numeric_limits<float>::min();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* src = x + (t * heads + h) * head_dim;
      float amax = 0.f;
      for (int64_t d = 0; d < head_dim; ++d)
        amax = std::max(amax, std::abs(static_cast<float>(src[d])));
      scale[slots[t] * heads + h] = amax / kInt8Max;
      const float step = std::max(amax / kInt8Max, tiny);
      int8_t* dst = cache + (slots[t] * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = round_int8(static_cast<float>(src[d]) / step);
    }
  }
}

void store_quantized(const torch::Tensor& x, torch::Tensor& cache, const int64_t* slots,
                     torch::Tensor& scale) {
  const int64_t tokens = x.size(0), heads = cache.size(2), head_dim = cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "write_kv_cpu", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    switch (cache.scalar_type()) {
      case at::kFloat8_e4m3fn:
        return store_fp8(src, static_cast<c10::Float8_e4m3fn*>(cache.data_ptr()), slots, tokens,
                         heads * head_dim, scale.item<float>());
      case at::kFloat8_e5m2:
        return store_fp8(src, static_cast<c10::Float8_e5m2*>(cache.data_ptr()), slots, tokens,
                         heads * head_dim, scale.item<float>());
      case at::kChar:
        TORCH_CHECK(scale.dim() == 3 && scale.is_contiguous(),
                    "an int8 cache's scale is contiguous [num_blocks, block_size, num_kv_heads]");
        return store_int8(src, cache.data_ptr<int8_t>(), slots, tokens, heads, head_dim,
                          scale.data_ptr<float>());
      default:
        TORCH_CHECK(false, "write_kv_quantized stores into an fp8 or int8 cache");
    }
  });
}

}  // namespace

// key, value [T, num_kv_heads, head_dim] (float32, float16 or bfloat16); key_cache,
// value_cache contiguous fp8 or int8 [num_blocks, block_size, num_kv_heads, head_dim];
// slot_mapping [T] int64 (-1: skip); k_scale, v_scale as kv_quant.new_scales makes them.
void write_kv_quantized(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                        torch::Tensor value_cache, torch::Tensor slot_mapping,
                        torch::Tensor k_scale, torch::Tensor v_scale) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "write_kv_quantized stores into contiguous caches");
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  store_quantized(key.contiguous(), key_cache, slots, k_scale);
  store_quantized(value.contiguous(), value_cache, slots, v_scale);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "PagedAttention over the paged KV cache, each query row through its block table");
  m.def("write_kv_quantized", &write_kv_quantized,
        "Quantize new keys and values into their slots of an fp8 or int8 cache");
  m.attr("VECTOR_WIDTH") = W;
}

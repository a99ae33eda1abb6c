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
// is split two ways into tasks (`Tile`, `plan`), and a task takes the KV heads in turn:
// - by tiles of up to kTileRows consecutive query rows of one sequence (prefill,
//   chunked prefill, speculative verification): each key and value is read once per
//   tile, not once per row;
// - by partitions of kPartitionSize positions (vLLM's paged_attention_v2), smaller when
//   the batch has too few tasks for the cores: one long sequence keeps every core busy,
//   each partition's softmax is kept as (max, sum, weighted values) and `reduce` merges
//   them.
// The split depends on the shapes only, and every output is summed by one thread in a
// fixed order, so the result does not depend on the number of threads.
//
// Inside a task, for one KV head (`Attention::attend`), the positions go W at a time (a
// vector's width): `dots` gives the scores of W positions for one query as one vector
// (a multiply-add per W elements of each key, the W sums reduced together), the
// softmax's exponentials are W at a time (`exp_nonpositive`), and `weighted_sum` adds
// the weighted value rows into sums held in registers.  The GQA group's query heads,
// and the tile's rows, share each key and value read.  Keys and values are read in the
// cache's dtype straight into the arithmetic, all float32 (fp32 accumulation for bf16
// and fp16 caches).  A quantized cache (fp8 or int8, minipaged/ops/kv_quant.py) stores a
// byte per element that means byte * scale, the scale one float per (slot, KV head):
// the byte is widened with a few vector instructions (fp8 through fp16's bit layout),
// a key's scale multiplies its score and a value's scale its weight.  The vector width
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
// ATen's and the dispatcher's headers, not <torch/extension.h>: that one brings pybind11
// and torch's C++ frontend, whose headers alone compile about four times as long as these.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
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
inline fvec max(fvec a, fvec b) { return _mm512_max_ps(a, b); }
inline float hmax(fvec a) { return _mm512_reduce_max_ps(a); }
inline fvec round_nearest(fvec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec times_pow2(fvec a, fvec n) { return _mm512_scalef_ps(a, n); }
inline fvec zero_below(fvec a, fvec x, fvec low) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), a); }
// Lanes [0, n) of a, the others `fill`.
inline fvec first_lanes(fvec a, int64_t n, float fill) {
  const __mmask16 keep = n >= W ? 0xFFFF : (1u << n) - 1;
  return _mm512_mask_blend_ps(keep, splat(fill), a);
}
// Lane j: the sum of a[j]'s lanes.  Pairs of vectors are interleaved and added, halving
// the lanes each holds per vector: 15 steps of two shuffles and an add, where 16
// separate horizontal sums take 4 dependent steps each.
inline fvec transpose_sum(const fvec* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128 bits: a[2i]'s, a[2i+1]'s, a[2i]'s, a[2i+1]'s pair sums
    b[i] = add(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: the sums of a[4i], ..., a[4i+3] over it
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // the 128-bit quarters of two vectors, added in pairs
    d[i] = add(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
               _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return add(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
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
inline fvec max(fvec a, fvec b) { return _mm256_max_ps(a, b); }
inline float hmax(fvec a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline fvec round_nearest(fvec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec times_pow2(fvec a, fvec n) {  // n in [-126, 0]: added to a's exponent bits
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), bits));
}
inline fvec zero_below(fvec a, fvec x, fvec low) { return _mm256_and_ps(_mm256_cmp_ps(x, low, _CMP_GE_OQ), a); }
inline fvec first_lanes(fvec a, int64_t n, float fill) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, W))), lane));
  return _mm256_blendv_ps(splat(fill), a, keep);
}
// Lane j: the sum of a[j]'s lanes, as AVX-512's (7 steps of two shuffles and an add).
inline fvec transpose_sum(const fvec* a) {
  __m256 b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = add(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
    c[i] = add(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return add(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
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
inline fvec mul(fvec a, fvec b) { return a * b; }
inline float hsum(fvec a) { return a; }
inline fvec max(fvec a, fvec b) { return std::max(a, b); }
inline float hmax(fvec a) { return a; }
inline fvec round_nearest(fvec a) { return std::nearbyint(a); }
inline fvec times_pow2(fvec a, fvec n) { return std::ldexp(a, static_cast<int>(n)); }
inline fvec zero_below(fvec a, fvec x, fvec low) { return x >= low ? a : 0.f; }
inline fvec first_lanes(fvec a, int64_t n, float fill) { return n >= 1 ? a : fill; }
inline fvec transpose_sum(const fvec* a) { return a[0]; }
inline void store(float* p, fvec a) { *p = a; }
template <typename T>
inline fvec load_floats(const T* p) { return static_cast<float>(*p); }
#endif

// The query row as float32, copied into `q` once per task.
template <typename T>
void widen(const T* x, int64_t n, float* q) {
  int64_t d = 0;
  for (; d + W <= n; d += W) store(q + d, load_floats(x + d));
  for (; d < n; ++d) q[d] = static_cast<float>(x[d]);  // c10's exact conversion
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  const fvec ws = splat(w);
  int64_t d = 0;
  for (; d + W <= n; d += W) store(y + d, fmadd(ws, load_floats(x + d), load_floats(y + d)));
  for (; d < n; ++d) y[d] += w * x[d];
}

// e^x for x <= 0 (a score minus its row's largest), W at once, within float32's
// rounding: x = n ln2 + r with |r| <= ln2 / 2, e^r by the degree-6 polynomial of Cephes'
// expf, times 2^n.  Below -87.33 (e^x under float32's smallest normal) it is 0, exactly:
// a masked score (-inf) weighs nothing.
inline fvec exp_nonpositive(fvec x) {
  const fvec low = splat(-87.33654f);
  const fvec clamped = max(x, low);
  const fvec n = round_nearest(mul(clamped, splat(1.44269504f)));
  fvec r = fmadd(n, splat(-0.693359375f), clamped);  // ln2 in two parts, exact products
  r = fmadd(n, splat(2.12194440e-4f), r);
  fvec p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(mul(p, r), r, add(r, splat(1.f)));
  return zero_below(times_pow2(p, n), x, low);
}

// -- scores and weighted values, W positions at a time ----------------------------------

// The head sizes the inner loops are compiled for (0: any other, counted at run time):
// loops of a constant length unroll completely, and a query's sums stay in registers.
template <typename F>
void with_head_dim(int64_t head_dim, F f) {
  if (head_dim == 64) return f(std::integral_constant<int64_t, 64>{});
  if (head_dim == 128) return f(std::integral_constant<int64_t, 128>{});
  f(std::integral_constant<int64_t, 0>{});
}

// Lane j: query q's dot product with the key at cache + rows[j], for W keys.  Each key
// has its own accumulator (no chain of dependent adds), and the W sums are reduced
// together at the end (`transpose_sum`) instead of one horizontal sum per key.  A key is
// read in its cache's dtype straight into the multiply-add.
template <int64_t D, typename cache_t>
inline fvec dots(const float* q, const cache_t* cache, const int64_t* rows, int64_t head_dim) {
  const int64_t dim = D ? D : head_dim;
  fvec acc[W];
  for (int64_t j = 0; j < W; ++j) acc[j] = splat(0.f);
  int64_t d = 0;
  for (; d + W <= dim; d += W) {
    const fvec qd = load_floats(q + d);
    for (int64_t j = 0; j < W; ++j) acc[j] = fmadd(qd, load_floats(cache + rows[j] + d), acc[j]);
  }
  fvec sums = transpose_sum(acc);
  if (d < dim) {  // a head size that is not a multiple of W
    float tail[W];
    for (int64_t j = 0; j < W; ++j) {
      tail[j] = 0.f;
      for (int64_t e = d; e < dim; ++e) tail[j] += q[e] * static_cast<float>(cache[rows[j] + e]);
    }
    sums = add(sums, load_floats(static_cast<const float*>(tail)));
  }
  return sums;
}

// Asks for a key or value row ahead of its use: the next block is anywhere in the pool,
// where the CPU's own prefetcher cannot guess it.
template <typename cache_t>
inline void prefetch(const cache_t* row, int64_t head_dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < head_dim * static_cast<int64_t>(sizeof(cache_t)); b += 64)
    __builtin_prefetch(bytes + b);
}

// How many query rows' value sums fit in registers at once (16 vectors of W floats).
template <int64_t D>
constexpr int64_t kRowsInRegisters = D ? std::max<int64_t>(1, 16 * W / D) : 1;

// out[r] = sum over p < count of w[r * stride + p] * value(p), for R query rows: the
// R × D sums stay in registers while each value row is read once, in its dtype.
template <int64_t D, int64_t R, typename cache_t>
void weighted_sum(const float* w, int64_t stride, const cache_t* cache, const int64_t* rows,
                  int64_t count, float* out) {
  constexpr int64_t V = D / W;
  fvec acc[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < V; ++k) acc[r][k] = splat(0.f);
  for (int64_t p = 0; p < count; ++p) {
    if (p + W < count) prefetch(cache + rows[p + W], D);
    fvec weight[R];
    for (int64_t r = 0; r < R; ++r) weight[r] = splat(w[r * stride + p]);
    const cache_t* x = cache + rows[p];
    for (int64_t k = 0; k < V; ++k) {
      const fvec xk = load_floats(x + k * W);
      for (int64_t r = 0; r < R; ++r) acc[r][k] = fmadd(weight[r], xk, acc[r][k]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < V; ++k) store(out + r * D + k * W, acc[r][k]);
}

// The same for `n` <= R rows (R is a constant, so n picks one of R loops), or for a head
// size of no constant (D = 0), row by row through memory.
template <int64_t D, int64_t R, typename cache_t>
void weighted_sums(int64_t n, const float* w, int64_t stride, const cache_t* cache,
                   const int64_t* rows, int64_t count, int64_t head_dim, float* out) {
  if constexpr (D == 0) {
    std::vector<float> x(head_dim);
    std::fill(out, out + n * head_dim, 0.f);
    for (int64_t p = 0; p < count; ++p) {
      widen(cache + rows[p], head_dim, x.data());
      for (int64_t r = 0; r < n; ++r) axpy(w[r * stride + p], x.data(), out + r * head_dim, head_dim);
    }
  } else if constexpr (R > 1) {
    if (n < R) return weighted_sums<D, R - 1>(n, w, stride, cache, rows, count, head_dim, out);
    weighted_sum<D, R>(w, stride, cache, rows, count, out);
  } else {
    weighted_sum<D, 1>(w, stride, cache, rows, count, out);
  }
}

// -- the cache's layout ----------------------------------------------------------------

// A cache's dequantization scales, scale[block, slot, kv_head] = data[block *
// block_stride + slot * slot_stride + kv_head * head_stride]; strides 0 for one scale
// per layer (fp8); none (nullptr) for a cache that is not quantized.
struct Scales {
  const float* data;
  int64_t block_stride, slot_stride, head_stride;
  float at(int64_t block, int64_t slot, int64_t kv_head) const {
    return data[block * block_stride + slot * slot_stride + kv_head * head_stride];
  }
};

Scales scales_of(const c10::optional<at::Tensor>& scale) {
  if (!scale) return {nullptr, 0, 0, 0};
  TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->dim() == 3,
              "the CPU kernel reads scales as float32 [num_blocks, block_size, num_kv_heads]");
  return {scale->data_ptr<float>(), scale->stride(0), scale->stride(1), scale->stride(2)};
}

// -- the split of the work -------------------------------------------------------------

constexpr int64_t kTileRows = 16;        // query rows that share a pass over the keys
constexpr int64_t kPartitionSize = 256;  // positions per task; its scores stay in L1
// Fewer tasks than this (a batch of one or two sequences) leave cores idle: the
// partitions are halved, down to kMinPartitionSize positions, until there are as many.
constexpr int64_t kMinTasks = 8;
constexpr int64_t kMinPartitionSize = 64;

// Query rows row .. row + rows - 1, of sequence seq; row i sees first_len + i positions.
// With more than one partition, its partial softmaxes start at `partial` in the
// partials buffer.
struct Tile {
  int64_t seq, row, rows, first_len, partitions, partial;
  int64_t last_len() const { return first_len + rows - 1; }
};

struct Task {
  int64_t tile, partition;
};

// One partition's softmax for one query head: its largest score, the sum of exp(score
// - max), and the values weighted by those exps, followed by head_dim floats.
constexpr int64_t kPartialHeader = 2;

struct Plan {
  int64_t partition_size = kPartitionSize;
  std::vector<Tile> tiles;
  std::vector<Task> tasks;
  std::vector<int64_t> split;  // the tiles with more than one partition
  int64_t num_partials = 0;
};

// The tiles and tasks for partitions of `size` positions.
Plan plan(const int32_t* starts, const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads,
          int64_t size) {
  Plan p;
  p.partition_size = size;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = starts ? starts[seq] : seq, end = starts ? starts[seq + 1] : seq + 1;
    const int64_t first_len = seq_lens[seq] - (end - begin) + 1;
    for (int64_t row = begin; row < end; row += kTileRows) {
      const int64_t rows = std::min(kTileRows, end - row);
      Tile tile{seq, row, rows, first_len + row - begin, 0, p.num_partials};
      tile.partitions = (tile.last_len() + size - 1) / size;
      if (tile.partitions > 1) {
        p.split.push_back(p.tiles.size());
        p.num_partials += rows * num_heads * tile.partitions;
      }
      for (int64_t part = 0; part < tile.partitions; ++part)
        p.tasks.push_back({static_cast<int64_t>(p.tiles.size()), part});
      p.tiles.push_back(tile);
    }
  }
  return p;
}

// kPartitionSize, or smaller for a batch too small to give every core work.
Plan plan(const int32_t* starts, const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads) {
  Plan p = plan(starts, seq_lens, num_seqs, num_heads, kPartitionSize);
  while (static_cast<int64_t>(p.tasks.size()) < kMinTasks && p.partition_size > kMinPartitionSize)
    p = plan(starts, seq_lens, num_seqs, num_heads, p.partition_size / 2);
  return p;
}

// A thread's working memory, reused by its tasks.
struct Scratch {
  std::vector<float> floats;
  std::vector<int64_t> rows;
};

// g() once on each of torch's threads.  at::parallel_for is OpenMP code inlined from
// ATen's headers: it runs on torch's threads only in a build with -fopenmp
// (minipaged/ops/cpu_ops.py), and on the calling thread alone without.
template <typename G>
void on_each_thread(G g) {
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { g(); });
}

// Run f(i) for i in [0, n) on torch's threads, each taking the next i as it finishes
// (tiles of a causal prefill differ in cost); which thread runs i changes nothing.
template <typename F>
void parallel_tasks(int64_t n, F f) {
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  on_each_thread([&] {
    Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1)) < n;) f(i, scratch);
  });
}

// How many threads `parallel_tasks` runs its tasks on (what the tests check).
int64_t task_threads() {
  std::atomic<int64_t> threads{0};
  on_each_thread([&] { threads.fetch_add(1); });
  return threads.load();
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

  // Where positions [first, first + len) of the sequence lie in the cache, for kv_head:
  // rows[p], the offset of position first + p's row.  Position pos is in physical block
  // table[pos / block_size] at slot pos % block_size (§4.1); walking whole blocks spares
  // a division per position.  The rows up to `padded` repeat the last one, so a vector of
  // W positions never reads a slot past the sequence (NaN for all we know); their lanes
  // are masked.  A quantized cache's scales are looked up on the same walk.
  void locate(const int32_t* table, int64_t first, int64_t len, int64_t padded, int64_t kv_head,
              int64_t* rows, float* k_scales, float* v_scales) const {
    for (int64_t p = 0; p < len;) {
      const int64_t pos = first + p, block = table[pos / block_size];
      const int64_t slot = pos % block_size, end = std::min(len, p + block_size - slot);
      int64_t row = ((block * block_size + slot) * num_kv_heads + kv_head) * head_dim;
      for (int64_t s = slot; p < end; ++p, ++s, row += num_kv_heads * head_dim) {
        rows[p] = row;
        if (k_scale.data) {
          k_scales[p] = scale * k_scale.at(block, s, kv_head);
          v_scales[p] = v_scale.at(block, s, kv_head);
        }
      }
    }
    std::fill(rows + len, rows + padded, rows[len - 1]);
    if (k_scale.data) {
      std::fill(k_scales + len, k_scales + padded, 0.f);
      std::fill(v_scales + len, v_scales + padded, 0.f);
    }
  }

  // One task: the tile's rows against one partition of positions, one KV head after
  // another.  The heads of a slot lie side by side in the cache, in the same pages and
  // often the same lines, which the CPU fetches for all of them at once: the same core
  // reads them while they are in its caches.
  void attend(const Task& task, const Tile& tile, int64_t partition_size, Scratch& scratch) const {
    with_head_dim(head_dim, [&](auto D) {
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
        attend<D>(task.partition, partition_size, kv_head, tile, scratch);
    });
  }

  // The tile's rows × the GQA group's heads of kv_head against one partition: scores,
  // softmax, weighted sum of values; the output, or a partial for `reduce`.
  template <int64_t D>
  void attend(int64_t partition, int64_t partition_size, int64_t kv_head, const Tile& tile,
              Scratch& scratch) const {
    const float inf = std::numeric_limits<float>::infinity();
    const int64_t n = tile.rows * group;
    const int64_t first = partition * partition_size;
    const int64_t last = std::min(first + partition_size, tile.last_len()), len = last - first;
    const int64_t padded = (len + W - 1) / W * W;
    scratch.floats.resize(2 * n * head_dim + n * padded + 2 * padded + 2 * n);
    scratch.rows.resize(padded);
    float* q = scratch.floats.data();    // [n, head_dim], widened
    float* acc = q + n * head_dim;       // [n, head_dim]
    float* scores = acc + n * head_dim;  // [n, padded], then the weights
    float* k_scales = scores + n * padded;  // [padded]: scale * each key's scale
    float* v_scales = k_scales + padded;    // [padded]
    float* max = v_scales + padded;         // [n]
    float* total = max + n;                 // [n]
    int64_t* rows = scratch.rows.data();
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t g = 0; g < group; ++g)
        widen(query + at(tile, i, kv_head, g), head_dim, q + (i * group + g) * head_dim);
    locate(tables + tile.seq * width, first, len, padded, kv_head, rows, k_scales, v_scales);
    // Row v (query row v / group) sees the positions before first_len + v / group.
    auto seen = [&](int64_t v) { return std::min(last, tile.first_len + v / group) - first; };
    // Scores, W positions at a time; the keys of those positions stay in L1 for every
    // query of the tile.
    for (int64_t c = 0; c < padded; c += W) {
      for (int64_t j = c + W; j < std::min(c + 2 * W, padded); ++j) prefetch(key_cache + rows[j], head_dim);
      const fvec key_scale = k_scale.data ? load_floats(k_scales + c) : splat(scale);
      for (int64_t v = 0; v < n; ++v) {
        fvec s = splat(-inf);
        if (c < seen(v))
          s = first_lanes(mul(key_scale, dots<D>(q + v * head_dim, key_cache, rows + c, head_dim)),
                          seen(v) - c, -inf);
        store(scores + v * padded + c, s);
      }
    }
    // Softmax numerators and their sums, in a fixed order.
    for (int64_t v = 0; v < n; ++v) {
      float* s = scores + v * padded;
      fvec m = splat(-inf);
      for (int64_t c = 0; c < padded; c += W) m = ::max(m, load_floats(s + c));
      max[v] = hmax(m);
      fvec sum = splat(0.f);
      for (int64_t c = 0; c < padded; c += W) {
        const fvec e = max[v] == -inf ? splat(0.f)  // a row that sees none of them
                                      : exp_nonpositive(add(load_floats(s + c), splat(-max[v])));
        sum = add(sum, e);
        store(s + c, v_scale.data ? mul(e, load_floats(v_scales + c)) : e);
      }
      total[v] = hsum(sum);
    }
    // The weighted values, kRowsInRegisters query rows at a time; the last of them sees
    // the most positions, and the others' weights there are 0.
    constexpr int64_t R = kRowsInRegisters<D>;
    for (int64_t v = 0; v < n; v += R) {
      const int64_t r = std::min(R, n - v), count = std::max<int64_t>(0, seen(v + r - 1));
      weighted_sums<D, R>(r, scores + v * padded, padded, value_cache, rows, count, head_dim,
                          acc + v * head_dim);
    }
    for (int64_t i = 0; i < tile.rows; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t v = i * group + g;
        if (tile.partitions == 1) {
          scalar_t* o = out + at(tile, i, kv_head, g);
          for (int64_t d = 0; d < head_dim; ++d)
            o[d] = static_cast<scalar_t>(acc[v * head_dim + d] / total[v]);
        } else {
          float* p = partial(tile, i, kv_head, g, partition);
          p[0] = max[v];
          p[1] = total[v];
          std::copy(acc + v * head_dim, acc + (v + 1) * head_dim, p + kPartialHeader);
        }
      }
  }

  // Merge a split tile's partitions for one KV head (paged_attention_v2's reduce): each
  // partition's sum and values rescaled from its own max to the largest.
  void reduce(const Tile& tile, int64_t kv_head, Scratch& scratch) const {
    scratch.floats.resize(head_dim);
    float* acc = scratch.floats.data();
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
                 int64_t partition_size, Scratch& scratch) {
  if constexpr (!std::is_same_v<scalar_t, cache_t>) {
    TORCH_CHECK(false, "attend_tile reads a cache of the query's dtype, not fp8 or int8");
  } else {
    const int64_t first = task.partition * partition_size;
    const int64_t last = std::min(first + partition_size, tile.last_len());
    scratch.floats.resize(2 * a.head_dim);
    float* q = scratch.floats.data();
    float* acc = q + a.head_dim;
    for (int64_t kv_head = 0; kv_head < a.num_kv_heads; ++kv_head) {
      const PagedKV<cache_t> kv{a.key_cache,  a.value_cache, a.tables + tile.seq * a.width,
                                a.block_size, a.num_kv_heads, kv_head, a.head_dim};
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
            for (int64_t d = 0; d < a.head_dim; ++d)
              o[d] = static_cast<scalar_t>(acc[d] / state.sum);
          } else {
            float* p = a.partial(tile, i, kv_head, g, task.partition);
            p[0] = state.max;
            p[1] = state.sum;
            std::copy(acc, acc + a.head_dim, p + kPartialHeader);
          }
        }
    }
  }
}
#endif

template <typename scalar_t, typename cache_t>
void run(const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const Scales& k_scale, const Scales& v_scale,
         const at::Tensor& block_tables, const Plan& plan, float scale, at::Tensor& out) {
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
  parallel_tasks(plan.tasks.size(), [&](int64_t i, Scratch& scratch) {
    const Task& task = plan.tasks[i];
#ifdef MINIPAGED_ATTEND_TILE
    attend_rows(attention, task, plan.tiles[task.tile], plan.partition_size, scratch);
#else
    attention.attend(task, plan.tiles[task.tile], plan.partition_size, scratch);
#endif
  });
  parallel_tasks(plan.split.size() * num_kv_heads, [&](int64_t i, Scratch& scratch) {
    attention.reduce(plan.tiles[plan.split[i / num_kv_heads]], i % num_kv_heads, scratch);
  });
}

}  // namespace

// query [T, num_heads, head_dim]; key_cache, value_cache [num_blocks, block_size,
// num_kv_heads, head_dim], of query's dtype, or fp8 / int8 with k_scale, v_scale
// [num_blocks, num_kv_heads] float32 (any strides); block_tables [S, W] int32;
// query_start_loc [S + 1] int32 (None: one row per sequence, decode); seq_lens [S] int32.
at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache,
                              at::Tensor value_cache, at::Tensor block_tables,
                              c10::optional<at::Tensor> query_start_loc, at::Tensor seq_lens,
                              double scale, c10::optional<at::Tensor> k_scale,
                              c10::optional<at::Tensor> v_scale) {
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
  at::Tensor starts;
  if (query_start_loc) starts = query_start_loc->contiguous();
  auto out = at::empty_like(query);
  const Plan work = plan(query_start_loc ? starts.data_ptr<int32_t>() : nullptr,
                         seq_lens.data_ptr<int32_t>(), seq_lens.size(0), query.size(1));
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

void store_quantized(const at::Tensor& x, at::Tensor& cache, const int64_t* slots,
                     at::Tensor& scale) {
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
void write_kv_quantized(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                        at::Tensor value_cache, at::Tensor slot_mapping,
                        at::Tensor k_scale, at::Tensor v_scale) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "write_kv_quantized stores into contiguous caches");
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  store_quantized(key.contiguous(), key_cache, slots, k_scale);
  store_quantized(value.contiguous(), value_cache, slots, v_scale);
}

// key, value [T, num_kv_heads, head_dim] into key_cache, value_cache [num_blocks, block_size,
// num_kv_heads, head_dim] of their dtype (contiguous): token t's heads, one contiguous row,
// copied to row slot_mapping[t] of the cache seen as [num_blocks * block_size, ...] (-1:
// skip).  The torch backend's index_copy_ without its mask: no host sync, one pass.
void write_kv(at::Tensor key, at::Tensor value, at::Tensor key_cache,
              at::Tensor value_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "write_kv stores into contiguous caches");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(),
              "write_kv stores into a cache of the keys' dtype");
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t tokens = key.size(0);
  const int64_t row_bytes = key_cache.size(2) * key_cache.size(3) * key_cache.element_size();
  for (auto [x, cache] : {std::pair{key, key_cache}, std::pair{value, value_cache}}) {
    // Each token's heads must be one run of memory (a row of the packed qkv is).
    if (x.stride(2) != 1 || x.stride(1) != x.size(2)) x = x.contiguous();
    const char* src = static_cast<const char*>(x.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    const int64_t src_stride = x.stride(0) * x.element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] >= 0) std::memcpy(dst + slots[t] * row_bytes, src + t * src_stride, row_bytes);
    }
  }
}

// The ops, registered with the dispatcher as fused_ops.cpp's are (torch.ops.<this
// extension's name>); the build is a plain shared library, no Python module.
#define MINIPAGED_FRAGMENT(name, m) TORCH_LIBRARY_FRAGMENT(name, m)
#define MINIPAGED_CPU_IMPL(name, m) TORCH_LIBRARY_IMPL(name, CPU, m)
MINIPAGED_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor? query_start_loc, Tensor seq_lens, float scale, Tensor? k_scale, "
        "Tensor? v_scale) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("write_kv_quantized(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, Tensor k_scale, Tensor v_scale) -> ()");
  // What only the tests ask: the threads the tasks run on, the floats of one vector.
  m.def("task_threads() -> int", &task_threads);
  m.def("vector_width() -> int", [] { return W; });
}
MINIPAGED_CPU_IMPL(TORCH_EXTENSION_NAME, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_quantized", &write_kv_quantized);
}

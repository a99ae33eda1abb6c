// The small ops around a decoder layer's projections and attention, fused, on the CPU:
// vLLM's CPU backend has the same four in C++ (csrc/cpu: `rms_norm`,
// `fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding`).  In torch each is several
// ops, each a pass over the tensor and a temporary: RMSNorm alone is a widening copy,
// a square, a mean, an rsqrt, two multiplies and a narrowing copy.  At a decode step's
// few rows, that is mostly the cost of launching the ops, paid about ten times per
// layer; here it is one call and one pass per op.
//
// The math follows Hugging Face's modeling_llama.py (minipaged/models/llama.py, whose
// torch reference is minipaged/ops/fused.py), in float32 for float16 and bfloat16
// inputs, with the same roundings where HF rounds between ops that matter:
// - rms_norm: normalised in float32, rounded to the dtype, then multiplied by the
//   weight (LlamaRMSNorm), rounded again;
// - fused_add_rms_norm: residual += x rounded to the dtype first (HF adds in the
//   dtype), then rms_norm of the new residual into x;
// - silu_and_mul, rotary_embedding: float32 throughout, rounded once at the end (as
//   vLLM; HF rounds after each op in a 16-bit dtype, at most half a unit apart).
//
// The vector width is the build's: AVX-512 (16 floats) or AVX2 (8), one float at a time
// otherwise (minipaged/ops/cpu_ops.py builds this file with paged_attention.cpp).  Rows
// are split over threads in chunks of at least at::internal::GRAIN_SIZE elements, so a
// decode step's few rows stay on one thread, as torch's own elementwise ops do.
//
// Validate against the torch reference, every dtype and instruction set:
//   pytest tests/test_fused_ops.py
// ATen's and the dispatcher's headers, not <torch/extension.h>: that one brings pybind11
// and torch's C++ frontend, whose headers alone compile about four times as long as these.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE, as torch's elementwise ops
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// -- W floats at a time: load as float32, store rounded to the nearest ----------------

#if defined(__AVX512F__)
constexpr int64_t W = 16;
using fvec = __m512;
inline fvec splat(float x) { return _mm512_set1_ps(x); }
inline fvec add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec sub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec div(fvec a, fvec b) { return _mm512_div_ps(a, b); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec clamp(fvec x, float lo, float hi) {
  return _mm512_min_ps(_mm512_max_ps(x, splat(lo)), splat(hi));
}
inline fvec round_nearest(fvec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline fvec times_pow2(fvec y, fvec n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
inline float hsum(fvec a) { return _mm512_reduce_add_ps(a); }
inline fvec load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline fvec load_floats(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline fvec load_floats(const c10::BFloat16* p) {  // a bf16 is a float32's upper half
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store_floats(float* p, fvec x) { _mm512_storeu_ps(p, x); }
inline void store_floats(c10::Half* p, fvec x) {
  __m256i half = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}
inline void store_floats(c10::BFloat16* p, fvec x) {
  // Round to nearest even on the upper half (c10's rule), a NaN staying a quiet NaN.
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC00000));
  __m256i upper = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), upper);
}
#elif defined(__AVX2__)
constexpr int64_t W = 8;
using fvec = __m256;
inline fvec splat(float x) { return _mm256_set1_ps(x); }
inline fvec add(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec sub(fvec a, fvec b) { return _mm256_sub_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec div(fvec a, fvec b) { return _mm256_div_ps(a, b); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec clamp(fvec x, float lo, float hi) {
  return _mm256_min_ps(_mm256_max_ps(x, splat(lo)), splat(hi));
}
inline fvec round_nearest(fvec x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline fvec times_pow2(fvec y, fvec n) {  // y * 2^n: n added to the exponent's bits
  __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), exponent));
}
inline float hsum(fvec a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline fvec load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline fvec load_floats(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline fvec load_floats(const c10::BFloat16* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store_floats(float* p, fvec x) { _mm256_storeu_ps(p, x); }
inline void store_floats(c10::Half* p, fvec x) {
  __m128i half = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), half);
}
inline void store_floats(c10::BFloat16* p, fvec x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  rounded = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
  // Eight 32-bit lanes to eight 16-bit ones: pack (per 128-bit half), then put the
  // halves' results side by side.
  __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(rounded, 16), _mm256_setzero_si256());
  packed = _mm256_permute4x64_epi64(packed, 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#else
constexpr int64_t W = 1;  // no vector unit we know: c10's conversions, one at a time
using fvec = float;
inline fvec splat(float x) { return x; }
inline fvec add(fvec a, fvec b) { return a + b; }
inline fvec sub(fvec a, fvec b) { return a - b; }
inline fvec mul(fvec a, fvec b) { return a * b; }
inline fvec div(fvec a, fvec b) { return a / b; }
inline fvec fmadd(fvec a, fvec b, fvec c) { return a * b + c; }
inline float hsum(fvec a) { return a; }
template <typename T>
inline fvec load_floats(const T* p) { return static_cast<float>(*p); }
template <typename T>
inline void store_floats(T* p, fvec x) { *p = static_cast<T>(x); }
#endif

// x rounded to T and back: where HF's math rounds to the model's dtype between ops.
template <typename T>
inline fvec rounded(fvec x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T buffer[W];
    store_floats(buffer, x);
    return load_floats(static_cast<const T*>(buffer));
  }
}

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// e^x, W at a time (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial
// for e^r, then 2^n; within a few units in the last place).  Clamped to [-88, 88],
// where float32's e^x is finite: silu only needs 1 + e^x to swamp or be swamped.
inline fvec exp_approx(fvec x) {
#if !defined(__AVX512F__) && !defined(__AVX2__)
  return std::exp(x);
#else
  x = clamp(x, -88.f, 88.f);
  const fvec n = round_nearest(mul(x, splat(1.44269504088896341f)));
  fvec r = fmadd(n, splat(-0.693359375f), x);  // ln2 in two parts: r exact to float32
  r = fmadd(n, splat(2.12194440e-4f), r);
  fvec p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  const fvec y = add(fmadd(p, mul(r, r), r), splat(1.f));
  return times_pow2(y, n);
#endif
}

// -- the ops, one row at a time ---------------------------------------------------------

// out = rounded(weight * rounded(x / sqrt(mean(x^2) + eps))), x already rounded to T.
template <typename T>
void normalize_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  fvec squares = splat(0.f);
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    const fvec v = load_floats(x + d);
    squares = fmadd(v, v, squares);
  }
  float sum = hsum(squares);
  for (; d < n; ++d) sum += static_cast<float>(x[d]) * static_cast<float>(x[d]);
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const fvec scale = splat(inv_rms);
  for (d = 0; d + W <= n; d += W) {
    store_floats(out + d, mul(load_floats(weight + d), rounded<T>(mul(load_floats(x + d), scale))));
  }
  for (; d < n; ++d) {
    const float normed = round_to<T>(static_cast<float>(x[d]) * inv_rms);
    out[d] = static_cast<T>(static_cast<float>(weight[d]) * normed);
  }
}

template <typename T>
void add_row(T* x, T* residual, int64_t n) {
  int64_t d = 0;
  for (; d + W <= n; d += W) store_floats(residual + d, add(load_floats(x + d), load_floats(residual + d)));
  for (; d < n; ++d) {
    residual[d] = static_cast<T>(static_cast<float>(x[d]) + static_cast<float>(residual[d]));
  }
}

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    const fvec g = load_floats(gate + d);
    const fvec silu = div(g, add(splat(1.f), exp_approx(sub(splat(0.f), g))));
    store_floats(out + d, mul(silu, load_floats(up + d)));
  }
  for (; d < n; ++d) {
    const float g = static_cast<float>(gate[d]);
    out[d] = static_cast<T>(g / (1.f + std::exp(-g)) * static_cast<float>(up[d]));
  }
}

// HF's half-split layout: element i pairs with i + half, both turned by angle i.
template <typename T>
void rotate_row(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t d = 0;
  for (; d + W <= half; d += W) {
    const fvec x1 = load_floats(x + d), x2 = load_floats(x + half + d), c = load_floats(cos + d), s = load_floats(sin + d);
    store_floats(x + d, sub(mul(x1, c), mul(x2, s)));
    store_floats(x + half + d, add(mul(x2, c), mul(x1, s)));
  }
  for (; d < half; ++d) {
    const float x1 = x[d], x2 = x[half + d], c = cos[d], s = sin[d];
    x[d] = static_cast<T>(x1 * c - x2 * s);
    x[half + d] = static_cast<T>(x2 * c + x1 * s);
  }
}

// f(begin, end) over rows, threads taking chunks of at least GRAIN_SIZE elements.
template <typename F>
void for_rows(int64_t rows, int64_t row_size, F f) {
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, row_size));
  at::parallel_for(0, rows, grain, f);
}

// f(T{}) with T the C++ type of `dtype`: float, c10::Half or c10::BFloat16.
template <typename F>
void dispatch(at::ScalarType dtype, F f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kHalf:
      return f(c10::Half{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    default:
      TORCH_CHECK(false, "the fused ops run on float32, float16 or bfloat16, not ", dtype);
  }
}

void check_floats(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              name, " must be float32, float16 or bfloat16, got ", x.scalar_type());
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [", x.size(-1), "] of the input's dtype");
}

}  // namespace

// input [..., n] (any strides; copied to rows if its last dimension is not contiguous),
// weight [n] -> a new [..., n].
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double epsilon) {
  check_floats(input, "input");
  check_weight(input, weight);
  const int64_t n = input.size(-1);
  const at::Tensor rows = input.reshape({-1, n}).contiguous();
  at::Tensor out = at::empty_like(rows);
  dispatch(input.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* x = rows.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for_rows(rows.size(0), n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) normalize_row(x + r * n, w, o + r * n, n, epsilon);
    });
  });
  return out.view(input.sizes());
}

// input, residual contiguous [..., n] of one dtype, in place: residual += input, then
// input = rms_norm(residual).
void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual,
                        const at::Tensor& weight, double epsilon) {
  check_floats(input, "input");
  check_weight(input, weight);
  TORCH_CHECK(input.is_contiguous() && residual.is_contiguous() &&
                  residual.sizes() == input.sizes() &&
                  residual.scalar_type() == input.scalar_type(),
              "input and residual must be contiguous, of one shape and dtype");
  const int64_t n = input.size(-1);
  dispatch(input.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
        scalar_t* x = input.data_ptr<scalar_t>();
        scalar_t* res = residual.data_ptr<scalar_t>();
        const scalar_t* w = weight.data_ptr<scalar_t>();
        for_rows(input.numel() / std::max<int64_t>(1, n), n, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            add_row(x + r * n, res + r * n, n);
            normalize_row(res + r * n, w, x + r * n, n, epsilon);
          }
        });
      });
}

// input [..., 2 * d] (gate then up, each row contiguous) -> silu(gate) * up [..., d].
at::Tensor silu_and_mul(const at::Tensor& input) {
  check_floats(input, "input");
  const int64_t d = input.size(-1) / 2;
  TORCH_CHECK(input.size(-1) == 2 * d, "input's last dimension must be even");
  const at::Tensor rows = input.reshape({-1, 2 * d}).contiguous();
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, input.options());
  dispatch(input.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* x = rows.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for_rows(rows.size(0), 2 * d, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(x + r * 2 * d, x + r * 2 * d + d, o + r * d, d);
    });
  });
  return out;
}

// query [T, heads, head_dim] and key [T, kv_heads, head_dim] (any strides but the last
// dimension's), rotated in place by cos, sin [T, head_dim / 2] (their first halves: HF's
// cos and sin repeat them), rows of any stride.
void rotary_embedding(at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin) {
  check_floats(query, "query");
  const int64_t tokens = query.size(0), head_dim = query.size(2), half = head_dim / 2;
  for (const at::Tensor* x : {&query, &key}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == tokens && x->size(2) == head_dim &&
                    x->stride(2) == 1 && x->scalar_type() == query.scalar_type(),
                "query and key must be [T, heads, head_dim] of one dtype, head_dim contiguous");
  }
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == half &&
                    t->stride(1) == 1 && t->scalar_type() == query.scalar_type(),
                "cos and sin must be [T, head_dim / 2] of the query's dtype");
  }
  TORCH_CHECK(head_dim == 2 * half, "head_dim must be even");
  dispatch(query.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    const int64_t heads = query.size(1) + key.size(1);
    for_rows(tokens, heads * head_dim, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* ct = c + t * cos.stride(0);
        const scalar_t* st = s + t * sin.stride(0);
        for (at::Tensor* x : {&query, &key}) {
          scalar_t* row = x->data_ptr<scalar_t>() + t * x->stride(0);
          for (int64_t h = 0; h < x->size(1); ++h) rotate_row(row + h * x->stride(1), ct, st, half);
        }
      }
    });
  });
}

// Registered with the dispatcher (torch.ops.<this extension's name>), as vLLM's ops are:
// a schema, which says what each op writes (`Tensor(a!)`), then a CPU kernel.  With no
// kernel for every backend, torch.compile may trace them on shape-only tensors
// (`minipaged.ops.cpu_ops.register_fakes`).  The indirection lets the build's name
// expand before the macro pastes it.
#define MINIPAGED_FRAGMENT(name, m) TORCH_LIBRARY_FRAGMENT(name, m)
#define MINIPAGED_CPU_IMPL(name, m) TORCH_LIBRARY_IMPL(name, CPU, m)
MINIPAGED_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float epsilon) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  m.def("silu_and_mul(Tensor input) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
}
MINIPAGED_CPU_IMPL(TORCH_EXTENSION_NAME, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}

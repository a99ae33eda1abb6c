// torch_binding.cpp: the CUDA kernels as a torch extension (minipaged.ops.cuda_ops).
//
// Turns tensors into the plain structs of minipaged_kernels.h and launches on the
// current CUDA stream.  minipaged.ops checks the arguments users pass; the checks here
// guard what the kernels themselves rely on (dtypes of index tensors, contiguity and
// 16-byte alignment), which minipaged.ops.cuda_ops arranges.
//
// A build may hold one decode version (minipaged/ops/cuda_build.py's KernelSet sets
// MINIPAGED_DECODE_VERSION): it binds that one, and the cache write.
//
// It includes the tensor class and torch's pybind11 glue, not <torch/extension.h> (every
// torch API): this file is the build's longest translation unit, and those headers
// compile in a third of the time.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#ifndef MINIPAGED_CPU_EMULATION
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "minipaged_kernels.h"

#ifndef MINIPAGED_DECODE_VERSION
#define MINIPAGED_DECODE_VERSION -1  // every version
#endif
#define MINIPAGED_HAS_VERSION(v) (MINIPAGED_DECODE_VERSION < 0 || MINIPAGED_DECODE_VERSION == (v))

namespace minipaged_torch {

using minipaged::CacheView;
using minipaged::DecodeParams;
using minipaged::DType;
using minipaged::PARTITION_SIZE;
using minipaged::WriteKVParams;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK_VALUE(false, "the CUDA kernels take float32, float16 or bfloat16, "
                                      "got ", t.scalar_type());
  }
}

// The dtype of a cache read with `query`: the query's own, or a quantized one.
DType cache_dtype_of(const at::Tensor& cache, const at::Tensor& query) {
  switch (cache.scalar_type()) {
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return DType::kFloat8E5M2;
    case at::kChar: return DType::kInt8;
    default:
      TORCH_CHECK_VALUE(cache.scalar_type() == query.scalar_type(),
                        "the cache must hold the query's dtype, fp8 or int8, got ",
                        cache.scalar_type());
      return dtype_of(query);
  }
}

// The stream to launch on, with the tensor's GPU made current for the launch.
struct Launch {
#ifdef MINIPAGED_CPU_EMULATION
  explicit Launch(const at::Tensor&) {}
  void* stream() const { return nullptr; }
#else
  explicit Launch(const at::Tensor& t) : guard(t.device()) {}
  void* stream() const { return c10::cuda::getCurrentCUDAStream().stream(); }
  c10::cuda::CUDAGuard guard;
#endif
};

// `aligned`: the attention kernels read cache rows with 16-byte loads.
CacheView cache_view(const at::Tensor& key_cache, const at::Tensor& value_cache,
                     bool aligned) {
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.stride(3) == 1,
              "key_cache and value_cache must share strides, head_dim contiguous");
  for (const auto& cache : {key_cache, value_cache})
    TORCH_CHECK(!aligned || (reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0 &&
                             cache.stride(0) * cache.element_size() % 16 == 0 &&
                             cache.stride(1) * cache.element_size() % 16 == 0 &&
                             cache.stride(2) * cache.element_size() % 16 == 0),
                "every cache row must start on 16 bytes, for the kernels' wide loads");
  return {key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0),
          key_cache.stride(1), key_cache.stride(2), int(key_cache.size(1)),
          int(key_cache.size(2)), int(key_cache.size(3))};
}

// A quantized cache's scales, float32 [num_blocks, block_size, num_kv_heads] views sharing strides
// (0 for fp8's one per layer), into `view`; none for a cache in the query's dtype.
void add_scales(CacheView& view, const at::Tensor& key_cache,
                const c10::optional<at::Tensor>& k_scale,
                const c10::optional<at::Tensor>& v_scale) {
  const bool quantized = key_cache.element_size() == 1;
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "k_scale and v_scale go with a quantized (fp8 or int8) cache, and only with one");
  if (!quantized) return;
  const std::vector<int64_t> shape{key_cache.size(0), key_cache.size(1), key_cache.size(2)};
  for (const auto& scale : {*k_scale, *v_scale})
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.sizes() == shape &&
                    scale.strides() == k_scale->strides(),
                "k_scale and v_scale must be float32 [num_blocks, block_size, num_kv_heads] "
                "sharing strides");
  view.k_scale = k_scale->data_ptr<float>();
  view.v_scale = v_scale->data_ptr<float>();
  view.scale_block_stride = k_scale->stride(0);
  view.scale_slot_stride = k_scale->stride(1);
  view.scale_head_stride = k_scale->stride(2);
}

void check_index(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.stride(-1) == 1, name, " must be ", dtype,
              " with a contiguous last dimension");
}

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_index(slot_mapping, at::kLong, "slot_mapping");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value: head_dim contiguous");
  WriteKVParams p{key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1),
                  value.stride(0), value.stride(1), slot_mapping.data_ptr<int64_t>(),
                  int(key.size(0)), cache_view(key_cache, value_cache, false)};
  const Launch launch(key);
  minipaged::write_kv(p, dtype_of(key), launch.stream());
}

DecodeParams decode_params(const at::Tensor& out, const at::Tensor& query,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           double scale, int64_t max_context_len,
                           const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                           const c10::optional<at::Tensor>& v_scale = c10::nullopt) {
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() &&
                  out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor like query");
  TORCH_CHECK(query.stride(2) == 1, "query: head_dim contiguous");
  check_index(block_tables, at::kInt, "block_tables");
  check_index(context_lens, at::kInt, "context_lens");
  CacheView cache = cache_view(key_cache, value_cache, true);
  add_scales(cache, key_cache, k_scale, v_scale);
  return {out.data_ptr(), query.data_ptr(), query.stride(0), query.stride(1),
          cache, block_tables.data_ptr<int32_t>(),
          block_tables.stride(0), context_lens.data_ptr<int32_t>(), float(scale),
          int(query.size(0)), int(query.size(1)), int(max_context_len), nullptr, nullptr, 0};
}

#if MINIPAGED_HAS_VERSION(0)
// Version 0: out, query, the caches (in the query's dtype), the tables.
void paged_attention_v0(const at::Tensor& out, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t max_context_len) {
  const DecodeParams p = decode_params(out, query, key_cache, value_cache, block_tables,
                                       context_lens, scale, max_context_len);
  TORCH_CHECK_VALUE(key_cache.scalar_type() == query.scalar_type(),
                    "paged_attention_v0 reads a cache of the query's dtype");
  const Launch launch(query);
  minipaged::paged_attention_v0(p, dtype_of(query), launch.stream());
}
#endif

#if MINIPAGED_HAS_VERSION(1)
// Version 1: the same, plus a quantized cache's scales.
void paged_attention_v1(const at::Tensor& out, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t max_context_len,
                        const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale) {
  const DecodeParams p = decode_params(out, query, key_cache, value_cache, block_tables,
                                       context_lens, scale, max_context_len, k_scale, v_scale);
  const Launch launch(query);
  minipaged::paged_attention_v1(p, dtype_of(query), cache_dtype_of(key_cache, query),
                                launch.stream());
}
#endif

#if MINIPAGED_HAS_VERSION(2)
void paged_attention_v2(const at::Tensor& out, const at::Tensor& partial_out,
                        const at::Tensor& partial_lse, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t max_context_len,
                        const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale) {
  DecodeParams p = decode_params(out, query, key_cache, value_cache, block_tables,
                                 context_lens, scale, max_context_len, k_scale, v_scale);
  const int64_t partitions = (max_context_len + PARTITION_SIZE - 1) / PARTITION_SIZE;
  TORCH_CHECK(partial_out.is_contiguous() && partial_lse.is_contiguous() &&
                  partial_out.scalar_type() == at::kFloat &&
                  partial_lse.scalar_type() == at::kFloat &&
                  partial_out.sizes() == at::IntArrayRef({query.size(0), query.size(1),
                                                          partitions, query.size(2)}) &&
                  partial_lse.sizes() == partial_out.sizes().slice(0, 3),
              "partial_out must be float32 [batch, num_heads, ", partitions,
              ", head_dim] and partial_lse float32 [batch, num_heads, ", partitions, "]");
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.max_num_partitions = int(partitions);
  const Launch launch(query);
  minipaged::paged_attention_v2(p, dtype_of(query), cache_dtype_of(key_cache, query),
                                launch.stream());
}
#endif

#if MINIPAGED_HAS_VERSION(3)
// Version 3: the context in num_splits splits of split_size tokens; with more than one,
// partial_out [batch, num_heads, num_splits, head_dim] and partial_lse hold their
// results for the reduce kernel (with one, they may be None).
void paged_attention_v3(const at::Tensor& out, const c10::optional<at::Tensor>& partial_out,
                        const c10::optional<at::Tensor>& partial_lse, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t max_context_len, int64_t num_splits,
                        int64_t split_size, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale) {
  DecodeParams p = decode_params(out, query, key_cache, value_cache, block_tables,
                                 context_lens, scale, max_context_len, k_scale, v_scale);
  p.max_num_partitions = int(num_splits);
  p.split_size = int(split_size);
  if (num_splits > 1) {
    TORCH_CHECK(partial_out.has_value() && partial_lse.has_value() &&
                    partial_out->is_contiguous() && partial_lse->is_contiguous() &&
                    partial_out->scalar_type() == at::kFloat &&
                    partial_lse->scalar_type() == at::kFloat &&
                    partial_out->sizes() == at::IntArrayRef({query.size(0), query.size(1),
                                                             num_splits, query.size(2)}) &&
                    partial_lse->sizes() == partial_out->sizes().slice(0, 3),
                "partial_out must be float32 [batch, num_heads, ", num_splits,
                ", head_dim] and partial_lse float32 [batch, num_heads, ", num_splits, "]");
    p.partial_out = partial_out->data_ptr<float>();
    p.partial_lse = partial_lse->data_ptr<float>();
  }
  const Launch launch(query);
  minipaged::paged_attention_v3(p, dtype_of(query), cache_dtype_of(key_cache, query),
                                launch.stream());
}
#endif

}  // namespace minipaged_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minipaged's CUDA PagedAttention kernels (kernels/*.cu)";
  m.attr("PARTITION_SIZE") = minipaged::PARTITION_SIZE;
  m.attr("MAX_QUERIES_PER_BLOCK") = minipaged::MAX_QUERIES_PER_BLOCK;
  m.attr("V3_TILE_SIZE") = minipaged::V3_TILE_SIZE;
  m.attr("V3_MAX_QUERIES_PER_BLOCK") = minipaged::V3_MAX_QUERIES_PER_BLOCK;
  m.def("write_kv", &minipaged_torch::write_kv);
#if MINIPAGED_HAS_VERSION(0)
  m.def("paged_attention_v0", &minipaged_torch::paged_attention_v0);
#endif
#if MINIPAGED_HAS_VERSION(1)
  m.def("paged_attention_v1", &minipaged_torch::paged_attention_v1);
  m.def("v1_shared_memory", &minipaged::paged_attention_v1_shared_memory,
        "bytes of shared memory a v1 thread block needs",
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("max_context_len"));
  m.def("max_shared_memory", &minipaged::max_shared_memory_per_block,
        "the most shared memory the current GPU grants one thread block");
#endif
#if MINIPAGED_HAS_VERSION(2)
  m.def("paged_attention_v2", &minipaged_torch::paged_attention_v2);
#endif
#if MINIPAGED_HAS_VERSION(3)
  m.def("paged_attention_v3", &minipaged_torch::paged_attention_v3);
#endif
}

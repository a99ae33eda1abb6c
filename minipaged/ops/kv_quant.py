"""A quantized KV cache: each key and value stored in one byte, read back times a scale.

The paper's thesis is that KV memory decides how many requests run at once (§3); a byte
per element instead of bf16's two holds twice the tokens in the same pool.  vLLM calls
the choice ``kv_cache_dtype``; its values, and ours:

- ``"auto"``: the model's dtype, no quantization;
- ``"fp8"`` = ``"fp8_e4m3"`` (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa
  bits, largest 448; rounding to it costs at most 2^-4 of a value (half of its 2^-3
  step), down to 2^-6, below which the step is a fixed 2^-9;
- ``"fp8_e5m2"`` (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, largest
  57344, half a step 2^-3 of a value;
- ``"int8"``: our teaching variant, which vLLM does not ship: integers in [-127, 127]
  times a scale per token and KV head, the largest magnitude of that token's head over
  127, so an element's error is at most half its step, ``scale / 2``.  The scale is
  fitted to the token alone, so the bytes a token leaves in the cache do not depend on
  which tokens were written with it: recomputing a preempted request, or chunking its
  prompt differently, writes the same bytes (a scale fitted per block would change as
  the block fills, and with it the rounding of the tokens already there).

A stored element ``q`` means ``q * scale``.  fp8 follows vLLM: one ``k_scale`` and one
``v_scale`` per layer, 1.0 unless computed from the first batch (``calculate_kv_scales``,
vLLM's ``Attention.calc_kv_scales``: the largest magnitude over a constant, 200 for keys
and 100 for values, leaving headroom for later tokens).  Either way every kernel reads
the scale of an element as ``scale[block, slot, kv_head]`` from a ``[num_blocks,
block_size, num_kv_heads]`` float32 tensor (`slot_scales`): fp8's per-layer scale is the
same number expanded to that shape, with strides 0.

Writing (`write_kv`) quantizes here, in torch, for every backend but the CPU's, whose
C++ store (``write_kv_quantized`` in ``kernels/cpu/paged_attention.cpp``) follows the
same rules in one loop instead of a dozen small torch operations per layer; the
attention kernels dequantize as they read (``kernels/cpu/paged_attention.cpp``,
``triton_kernels.py``, ``torch_ref.py``).
"""

from __future__ import annotations

import torch

__all__ = [
    "FORMATS",
    "K_SCALE_CONSTANT",
    "V_SCALE_CONSTANT",
    "cache_dtype",
    "calculate_kv_scales",
    "dequantize",
    "is_quantized",
    "kernel_scales",
    "new_scales",
    "quantize",
    "slot_scales",
    "write_kv",
]

# The quantized values of ``kv_cache_dtype`` (``minipaged.config.KV_CACHE_DTYPES``, which
# the engine checks first, without torch), and what each stores.
FORMATS = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
QUANTIZED_DTYPES = tuple(dict.fromkeys(FORMATS.values()))
INT8_MAX = 127
# vLLM's defaults (envs.K_SCALE_CONSTANT, envs.V_SCALE_CONSTANT).
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache stores for ``kv_cache_dtype`` (``"auto"``: the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FORMATS:
        choices = ("auto", *FORMATS)
        raise ValueError(f"kv_cache_dtype must be one of {choices}, got {kv_cache_dtype!r}")
    return FORMATS[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds bytes to be scaled back (fp8 or int8)."""
    return dtype in QUANTIZED_DTYPES


def new_scales(dtype, cache_shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's fresh ``(k_scale, v_scale)`` for a cache of ``cache_shape``: fp8's one
    number each (1.0, vLLM's default), int8's one per slot and KV head, ``[num_blocks,
    block_size, num_kv_heads]`` (0 until a token is written)."""
    if dtype == torch.int8:
        shape = tuple(cache_shape[:3])
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    return torch.ones((), device=device), torch.ones((), device=device)


def slot_scales(scale: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``scale`` as ``[num_blocks, block_size, num_kv_heads]`` for ``cache``: a view,
    strides 0 for a per-layer scale, so kernels read one layout."""
    return scale.expand(cache.shape[:3])


def kernel_scales(key_cache, k_scale, v_scale) -> tuple:
    """The scales a kernel reads (`slot_scales` views), or ``(None, None)`` for a cache
    in the model's dtype."""
    if k_scale is None:
        return None, None
    return slot_scales(k_scale, key_cache), slot_scales(v_scale, key_cache)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``dtype``: rounded to nearest, clamped to the format's range (an
    fp8 cast would overflow to NaN, an int8 one wrap around)."""
    x = x.float() / scale
    if dtype == torch.int8:
        return x.round_().clamp_(-INT8_MAX, INT8_MAX).to(dtype)
    top = torch.finfo(dtype).max
    return x.clamp_(-top, top).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32 (fp8 converts exactly; arithmetic on it may not run)."""
    return q.float() * scale


def calculate_kv_scales(key, value, k_scale, v_scale) -> None:
    """Set a layer's fp8 scales from a batch, in place, as vLLM's ``calc_kv_scales``:
    the largest magnitude over ``K_SCALE_CONSTANT`` (keys) or ``V_SCALE_CONSTANT``."""
    for x, scale, constant in (
        (key, k_scale, K_SCALE_CONSTANT),
        (value, v_scale, V_SCALE_CONSTANT),
    ):
        amax = float(x.abs().max()) if x.numel() else 0.0
        scale.fill_(amax / constant if amax > 0 else 1.0)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    """Quantize each new token's key and value into its slot (-1: skip), in place."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if cache.dtype == torch.int8:
            _write_int8(x, cache, scale, slots)
        else:
            _store(cache, slots, quantize(x, scale, cache.dtype))


def _write_int8(x, cache, scale, slots) -> None:
    """Store ``x [T, H, D]`` at ``slots`` of an int8 cache, each token's head over its
    own scale, its largest magnitude over 127 (kept at ``scale`` viewed as ``[slots,
    H]``): a function of the token alone, however the tokens arrive."""
    step = x.float().abs().amax(-1) / INT8_MAX  # [T, H]
    scale.view(-1, scale.shape[-1]).index_copy_(0, slots, step)
    tiny = torch.finfo(torch.float32).tiny  # an all-zero head: any step stores zeros
    _store(cache, slots, quantize(x, step.clamp_min(tiny)[..., None], torch.int8))


def _store(cache, slots, q) -> None:
    """Row ``slots[t]`` of the cache seen as ``[num_blocks * block_size, H, D]`` takes
    ``q[t]``: one ``index_copy_``, of the raw bytes (torch's has no fp8 kernel)."""
    rows = cache.view(torch.uint8).view(-1, *cache.shape[2:])
    rows.index_copy_(0, slots, q.view(torch.uint8))

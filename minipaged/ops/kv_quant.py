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
  times a scale per block and KV head, the largest magnitude of that head in that block
  over 127, so a block's error is at most half its step, ``scale / 2``.

A stored element ``q`` means ``q * scale``.  fp8 follows vLLM: one ``k_scale`` and one
``v_scale`` per layer, 1.0 unless computed from the first batch (``calculate_kv_scales``,
vLLM's ``Attention.calc_kv_scales``: the largest magnitude over a constant, 200 for keys
and 100 for values, leaving headroom for later tokens).  Either way every kernel reads
the scale of an element as ``scale[block, kv_head]`` from a ``[num_blocks,
num_kv_heads]`` float32 tensor (`block_scales`): fp8's per-layer scale is the same
number expanded to that shape, with strides 0.

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
    "block_scales",
    "cache_dtype",
    "calculate_kv_scales",
    "dequantize",
    "is_quantized",
    "new_scales",
    "quantize",
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


def new_scales(dtype, num_blocks, num_kv_heads, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's fresh ``(k_scale, v_scale)``: fp8's one number each (1.0, vLLM's
    default), int8's one per block and KV head (0 until a token is written)."""
    if dtype == torch.int8:
        shape = (num_blocks, num_kv_heads)
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    return torch.ones((), device=device), torch.ones((), device=device)


def block_scales(scale: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``scale`` as ``[num_blocks, num_kv_heads]`` for ``cache``: a view, strides 0 for
    a per-layer scale, so kernels read one layout."""
    return scale.expand(cache.shape[0], cache.shape[2])


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
    """Store ``x [T, H, D]`` at ``slots`` of an int8 cache whose ``scale [num_blocks, H]``
    is each block's largest magnitude per head over 127.

    A block fills from its first slot on, so a write at offset 0 starts the block
    afresh: the previous owner's scale is forgotten.  Where new tokens are larger than
    a block's scale allows, the scale grows and the tokens already there are rounded
    again to the coarser step (each such growth costs them at most half a new step).
    """
    block_size = cache.shape[1]
    blocks = slots // block_size
    scale[blocks[slots % block_size == 0]] = 0.0
    grown = scale.clone()
    amax = x.float().abs().amax(-1) / INT8_MAX  # [T, H]
    grown.scatter_reduce_(0, blocks[:, None].expand_as(amax), amax, "amax")
    touched = blocks.unique()
    ratio = scale[touched] / grown[touched].clamp_min(torch.finfo(torch.float32).tiny)
    old = cache[touched].float() * ratio[:, None, :, None]
    cache[touched] = old.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    scale.copy_(grown)
    step = grown[blocks].clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    _store(cache, slots, quantize(x, step, torch.int8))


def _store(cache, slots, q) -> None:
    """Row ``slots[t]`` of the cache seen as ``[num_blocks * block_size, H, D]`` takes
    ``q[t]``: one ``index_copy_``, of the raw bytes (torch's has no fp8 kernel)."""
    rows = cache.view(torch.uint8).view(-1, *cache.shape[2:])
    rows.index_copy_(0, slots, q.view(torch.uint8))

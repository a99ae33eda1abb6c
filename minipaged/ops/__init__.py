"""Attention ops over the paged KV cache (paper §4.1, §4.3).

Three ops, each with one signature for every backend:

- ``write_kv`` stores the new tokens' keys and values in their cache slots;
- ``paged_attention_decode`` attends one new token per sequence to its whole context;
- ``paged_attention_prefill`` attends a packed chunk of new tokens per sequence, causally.

The cache layout, per layer, is ``[num_blocks, block_size, num_kv_heads, head_dim]`` for
keys and for values; slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
Arguments are checked here, once, so every backend may assume well-formed input.
The contiguous oracle the backends are tested against is exported beside them.

A quantized cache (fp8 or int8, `kv_quant`) holds bytes that mean ``q * scale``: its
ops take the layer's ``k_scale`` and ``v_scale`` too, and the query and new keys keep the
model's dtype.  fp8's scales default to 1.0; int8's, one per slot and KV head, are
required.

Backends: ``torch`` (``torch_ref``, gather then attend: short and slow), ``triton``
(``triton_ops`` launching ``triton_kernels``: online softmax over blocks, GQA groups,
split-KV), ``cuda`` (``cuda_ops`` launching the CUDA C++ kernels of ``kernels/``, built
on first use; prefill borrows Triton's), and two libraries' kernels where they are
installed on a GPU: ``flash_attn`` (FlashAttention-2, `flash_attn_ops`) and
``flashinfer`` (FlashInfer, `flashinfer_ops`).  The Triton module is imported on first use, so
``import minipaged.ops`` needs no Triton, and ``TRITON_INTERPRET`` may be set any time
before the first Triton call.
"""

from __future__ import annotations

import importlib

import torch

from minipaged.ops import kv_quant, torch_ref
from minipaged.ops.oracle import attention_oracle, decode_oracle, prefill_oracle

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "get_backend",
    "check_supported",
    "write_kv",
    "paged_attention_decode",
    "paged_attention_prefill",
    "attention_oracle",
    "decode_oracle",
    "prefill_oracle",
]

BACKENDS = ("torch", "cpu", "triton", "cuda", "flash_attn", "flashinfer")
LIBRARY_BACKENDS = ("flash_attn", "flashinfer")  # another library's kernels, optional
_INDEX_DTYPES = (torch.int32, torch.int64)


class BackendUnavailableError(RuntimeError, ValueError):
    """The requested attention backend cannot run here: a ``ValueError`` too, as an
    ``attention_backend`` argument this machine cannot honour."""


def write_kv(
    key, value, key_cache, value_cache, slot_mapping, backend="torch", k_scale=None, v_scale=None
) -> None:
    """Store ``key, value [T, num_kv_heads, head_dim]`` in the cache slots
    ``slot_mapping [T]``, in place; a slot of -1 skips that token.  A quantized cache
    stores them over ``k_scale`` and ``v_scale`` (int8: each token's own, set here)."""
    _check_cache(key_cache, value_cache)
    scales = _check_scales(key_cache, k_scale, v_scale)
    impl = get_backend(backend, key_cache.device)
    _require(
        key.dim() == 3 and key.shape[1:] == key_cache.shape[2:],
        f"key must be [T, num_kv_heads, head_dim] = [T, {key_cache.shape[2]}, "
        f"{key_cache.shape[3]}] to match key_cache, got {tuple(key.shape)}",
    )
    _require(
        value.shape == key.shape,
        f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}",
    )
    _require(
        key.dtype == value.dtype and _computes_in(key.dtype, key_cache),
        f"key and value dtype must be key_cache's {_compute_dtypes(key_cache)}, "
        f"got {key.dtype} and {value.dtype}",
    )
    _check_index("slot_mapping", slot_mapping, 1, (key.shape[0],))
    _check_device(key_cache, key=key, value=value, slot_mapping=slot_mapping)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"slot_mapping[{i}] = {int(slot_mapping[i])} is not -1 or a slot in [0, {num_slots})"
        )
    impl.write_kv(key, value, key_cache, value_cache, slot_mapping, *scales)


def paged_attention_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    backend="torch",
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """``query [B, num_heads, head_dim]``, one new token per sequence, attends to the
    ``context_lens[b]`` tokens of its sequence in the cache -> ``[B, num_heads, head_dim]``."""
    _check_cache(key_cache, value_cache)
    scales = _check_scales(key_cache, k_scale, v_scale)
    impl = get_backend(backend, key_cache.device)
    _check_query(query, key_cache)
    _check_tables(block_tables, context_lens, query.shape[0], key_cache)
    _check_context_lens(context_lens, 1, block_tables.shape[1] * key_cache.shape[1])
    return impl.paged_attention_decode(
        query, key_cache, value_cache, block_tables, context_lens, scale, *scales
    )


def paged_attention_prefill(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale,
    backend="torch",
    k_scale=None,
    v_scale=None,
) -> torch.Tensor:
    """Causal attention for the new tokens of several sequences packed in
    ``query [T, num_heads, head_dim]``; sequence ``b`` owns rows
    ``query_start_loc[b]:query_start_loc[b+1]`` -> ``[T, num_heads, head_dim]``."""
    _check_cache(key_cache, value_cache)
    scales = _check_scales(key_cache, k_scale, v_scale)
    impl = get_backend(backend, key_cache.device)
    _check_query(query, key_cache)
    batch = block_tables.shape[0] if block_tables.dim() == 2 else -1
    _check_tables(block_tables, context_lens, batch, key_cache)
    _check_index("query_start_loc", query_start_loc, 1, (batch + 1,))
    _check_device(key_cache, query_start_loc=query_start_loc)
    starts = query_start_loc.tolist()
    _require(
        starts[0] == 0
        and starts[-1] == query.shape[0]
        and all(a <= b for a, b in zip(starts, starts[1:])),
        f"query_start_loc must rise from 0 to query.shape[0] = {query.shape[0]}, got {starts}",
    )
    _check_context_lens(
        context_lens, query_start_loc.diff(), block_tables.shape[1] * key_cache.shape[1]
    )
    return impl.paged_attention_prefill(
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale, *scales
    )


def get_backend(name: str, device: torch.device):
    """The module implementing backend ``name`` for tensors on ``device``.

    Its ``write_kv``, ``paged_attention_decode`` and ``paged_attention_prefill`` take the
    same arguments as the ops here (the scales positional, None for a cache that is not
    quantized), plus the optional host-side hints ``max_context_len`` (decode) and
    ``max_query_len`` (prefill), but check none of them,
    and the Triton ones never wait for the GPU: for hot loops (a model's layers, a
    benchmark) whose caller validated its inputs once.  Raises
    ``BackendUnavailableError`` if it cannot run on ``device``.
    """
    if name == "torch":
        return torch_ref
    if name == "triton":
        try:
            triton_ops = importlib.import_module("minipaged.ops.triton_ops")
        except ImportError as error:
            raise BackendUnavailableError(
                f"the 'triton' attention backend needs the triton package: {error}"
            ) from None
        try:
            triton_ops.check_available(device)
        except RuntimeError as error:
            raise BackendUnavailableError(str(error)) from None
        return triton_ops
    if name in LIBRARY_BACKENDS:
        # torch only at import: the library itself is imported by check_available.
        impl = importlib.import_module(f"minipaged.ops.{name}_ops")
        try:
            impl.check_available(device)
        except RuntimeError as error:
            raise BackendUnavailableError(str(error)) from None
        return impl
    if name in ("cpu", "cuda"):
        # torch only: their C++ is built when check_available (cpu) or the first call
        # (cuda) needs it.
        impl = importlib.import_module(f"minipaged.ops.{name}_ops")
        try:
            impl.check_available(device)
        except RuntimeError as error:
            raise BackendUnavailableError(str(error)) from None
        return impl
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def check_supported(
    backend: str,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    kv_cache_dtype: torch.dtype | None = None,
) -> None:
    """Raise ``ValueError`` if ``backend`` cannot attend over a cache of these shapes,
    computing in ``dtype`` over a cache of ``kv_cache_dtype`` (default: ``dtype``).

    The torch, CPU and Triton backends take any; the CUDA kernels are compiled for a few
    dtypes, head dims and block sizes (``cuda_ops.check_supported``), and read any cache
    dtype of `kv_quant` besides the query's; FlashAttention and FlashInfer take fp16 and
    bf16, their head dims, no quantized cache, and FlashAttention's paged kernels blocks
    of a multiple of 256 tokens: an engine asks once, before it allocates anything.
    """
    if backend in LIBRARY_BACKENDS:
        impl = importlib.import_module(f"minipaged.ops.{backend}_ops")
        impl.check_supported(backend, dtype, head_dim, block_size, kv_cache_dtype)
    if backend == "cuda":
        from minipaged.ops import cuda_ops

        cuda_ops.check_supported(dtype, head_dim, block_size)
        cache_dtype = kv_cache_dtype or dtype
        _require(
            cache_dtype == dtype or kv_quant.is_quantized(cache_dtype),
            f"kv_cache_dtype must be {dtype}, fp8 or int8 for the 'cuda' attention backend, "
            f"got {cache_dtype}",
        )


def _require(ok, message):
    if not ok:
        raise ValueError(message)


def _check_cache(key_cache, value_cache):
    _require(
        key_cache.dim() == 4,
        "key_cache must be 4-D [num_blocks, block_size, "
        f"num_kv_heads, head_dim], got shape {tuple(key_cache.shape)}",
    )
    _require(
        value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype,
        f"value_cache ({tuple(value_cache.shape)}, {value_cache.dtype}) must match "
        f"key_cache ({tuple(key_cache.shape)}, {key_cache.dtype})",
    )
    _check_device(key_cache, value_cache=value_cache)


def _check_query(query, key_cache):
    _require(
        query.dim() == 3,
        f"query must be 3-D [tokens, num_heads, head_dim], got shape {tuple(query.shape)}",
    )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    _require(
        head_dim == key_cache.shape[3],
        f"query head_dim {head_dim} must equal key_cache head_dim {key_cache.shape[3]}",
    )
    _require(
        num_heads % num_kv_heads == 0,
        f"query num_heads {num_heads} must be a multiple of key_cache num_kv_heads {num_kv_heads}",
    )
    _require(
        _computes_in(query.dtype, key_cache),
        f"query dtype {query.dtype} must be key_cache's {_compute_dtypes(key_cache)}",
    )
    _check_device(key_cache, query=query)


_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _computes_in(dtype, key_cache) -> bool:
    """A quantized cache is read and written in any float dtype, the model's; another
    cache in its own."""
    return dtype in _compute_dtypes(key_cache)


def _compute_dtypes(key_cache):
    return _COMPUTE_DTYPES if kv_quant.is_quantized(key_cache.dtype) else (key_cache.dtype,)


def _check_scales(key_cache, k_scale, v_scale):
    """The ``(k_scale, v_scale)`` a backend gets: None for a cache that is not
    quantized, fp8's default 1.0, each a float32 number or ``[num_blocks, block_size,
    num_kv_heads]`` on the cache's device (int8's must be the latter)."""
    if not kv_quant.is_quantized(key_cache.dtype):
        _require(
            k_scale is None and v_scale is None,
            f"k_scale and v_scale are for a quantized cache, not {key_cache.dtype}",
        )
        return None, None
    per_slot = tuple(key_cache.shape[:3])
    shapes = [per_slot] if key_cache.dtype == torch.int8 else [(), (1,), per_slot]
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None and key_cache.dtype != torch.int8:
            scale = torch.ones((), device=key_cache.device)
        _require(
            isinstance(scale, torch.Tensor)
            and scale.dtype == torch.float32
            and tuple(scale.shape) in shapes,
            f"{name} for a {key_cache.dtype} cache must be a float32 tensor of shape "
            f"{' or '.join(map(str, shapes))}, got {_describe(scale)}",
        )
        _check_device(key_cache, **{name: scale})
        scales.append(scale.view(()) if scale.numel() == 1 and scale.dim() == 1 else scale)
    _require(
        scales[0].shape == scales[1].shape,
        f"k_scale and v_scale must have one shape, got {tuple(scales[0].shape)} "
        f"and {tuple(scales[1].shape)}",
    )
    return tuple(scales)


def _describe(x):
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x)


def _check_tables(block_tables, context_lens, batch, key_cache):
    _check_index("block_tables", block_tables, 2, (batch, block_tables.shape[-1]))
    _check_index("context_lens", context_lens, 1, (batch,))
    _check_device(key_cache, block_tables=block_tables, context_lens=context_lens)


def _check_index(name, tensor, ndim, shape):
    _require(
        tensor.dim() == ndim and tensor.dtype in _INDEX_DTYPES,
        f"{name} must be a {ndim}-D int32 or int64 tensor, got {tensor.dim()}-D {tensor.dtype}",
    )
    _require(
        tuple(tensor.shape) == shape, f"{name} must have shape {shape}, got {tuple(tensor.shape)}"
    )


def _check_context_lens(context_lens, at_least, capacity):
    # One reduction, so one host sync, on the happy path.
    bad = (context_lens < at_least) | (context_lens > capacity)
    if bad.any():
        i = int(bad.nonzero()[0])
        low = at_least if isinstance(at_least, int) else int(at_least[i])
        raise ValueError(
            f"context_lens[{i}] = {int(context_lens[i])} must be in "
            f"[{low}, {capacity}]: at least the new tokens, at most "
            f"block_tables.shape[1] * block_size"
        )


def _check_device(key_cache, **tensors):
    for name, tensor in tensors.items():
        _require(
            tensor.device == key_cache.device,
            f"{name} is on {tensor.device} but key_cache is on {key_cache.device}",
        )

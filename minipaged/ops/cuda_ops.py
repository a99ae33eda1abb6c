"""The CUDA backend: launching the kernels of ``kernels/*.cu`` (paper §4.1, §5.1).

``write_kv`` and decode run the CUDA C++ kernels, built on first use
(``cuda_build``, only what the call launches); prefill runs the Triton kernel, which
reads the same cache layout (a CUDA build of torch always brings Triton).  Decode comes
in four versions, lesson 08's steps:

- v0, one thread per query head, every key and value read element by element: the
  plain algorithm, for lesson 08 to start from and the others to be measured against;
- v1, one thread block per (sequence, KV head) over the whole context, the paper's;
- v2, the context also split into partitions of ``PARTITION_SIZE`` tokens, merged by a
  second kernel: more thread blocks for few long sequences;
- v3, flash-decoding: one pass of an online softmax over K/V tiles copied
  asynchronously, the context split as the GPU's size and the batch ask (`split_kv`).
  The engine's, and the default.

v1, v2 and v3 also read a quantized cache (fp8 or int8, `kv_quant`), dequantizing as
they read; v0 reads only a cache of the query's dtype.  ``write_kv`` into a quantized
cache quantizes in torch (`kv_quant.write_kv`), as for every backend.

``choose_version`` is the course's choice between v1 and v2, from the host-side shapes
alone.  Arguments are checked in ``minipaged.ops``; these functions assume well-formed
input but check what only this backend needs: the dtype, head_dim and block_size its
kernels are compiled for.
"""

from __future__ import annotations

import functools
import math

import torch

from minipaged.ops import cuda_build, kv_quant

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32)
VERSIONS = (0, 1, 2, 3)
DEFAULT_VERSION = 3
# Mirrors of kernels/minipaged_kernels.h, for choosing before anything is built; the
# tests check them against the extension's own.
PARTITION_SIZE = 512
MAX_QUERIES_PER_BLOCK = 8
V3_TILE_SIZE = 32
V3_MAX_QUERIES_PER_BLOCK = 8
# v3's split-KV: thread blocks wanted per multiprocessor (about as many as fit at once),
# and the shortest split worth its partial result, in tiles.
V3_BLOCKS_PER_SM = 4
V3_MIN_SPLIT_TILES = 8


def check_available(device: torch.device) -> None:
    """Raise ``RuntimeError`` saying why the CUDA kernels cannot run on ``device``."""
    reason = cuda_build.missing(device)
    if reason:
        raise RuntimeError(reason)
    try:
        from minipaged.ops import triton_ops  # prefill's kernel
    except ImportError as error:
        raise RuntimeError(f"the 'cuda' attention backend prefills with Triton: {error}") from None
    triton_ops.check_available(device)


def check_supported(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    """Raise ``ValueError`` unless the kernels are compiled for these shapes."""
    for name, value, allowed in (
        ("dtype", dtype, DTYPES),
        ("head_dim", head_dim, HEAD_DIMS),
        ("block_size", block_size, BLOCK_SIZES),
    ):
        _check_one(name, value, allowed)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter ``key, value [T, num_kv_heads, head_dim]`` into their slots (§4.3); the
    kernel copies rows of any shape, so only the dtype matters.  A quantized cache is
    written by `kv_quant.write_kv`."""
    if kv_quant.is_quantized(key_cache.dtype):
        kv_quant.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    _check_one("dtype", key_cache.dtype, DTYPES)
    _, block_size, _, head_dim = key_cache.shape
    ext = _extension(
        key_cache.device, DEFAULT_VERSION, key_cache.dtype, key_cache.dtype, head_dim, block_size
    )
    ext.write_kv(key, value, key_cache, value_cache, slot_mapping.to(torch.int64))


def choose_version(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    max_context_len: int,
    num_sms: int,
    v1_fits: bool = True,
) -> int:
    """The course's choice between versions 1 and 2 (lesson 08): 1 unless version 2
    would do clearly better.  (Version 3, the default, needs no such choice: `split_kv`
    sizes its splits from the same facts.)

    v1 launches a thread block per (sequence, KV head, slice of its query heads).  When
    that already gives every multiprocessor work, or the context fits one partition,
    v2's partitions would only add a merge.  A few long sequences leave most of the GPU
    idle under v1; v2 fills it.  And v1 cannot run at all when the logits of its longest
    context do not fit in one thread block's shared memory (``v1_fits``).
    """
    if not v1_fits:
        return 2
    slices = math.ceil(num_heads // num_kv_heads / MAX_QUERIES_PER_BLOCK)
    if max_context_len <= PARTITION_SIZE or batch * num_kv_heads * slices >= num_sms:
        return 1
    return 2


def v3_queries_per_block(group: int) -> int:
    """Query heads a v3 thread block serves for a GQA group of ``group``: the group
    rounded up to a power of two, at most ``V3_MAX_QUERIES_PER_BLOCK`` (the kernel's
    ``queries_per_block``)."""
    return min(1 << (group - 1).bit_length(), V3_MAX_QUERIES_PER_BLOCK)


def split_kv(
    batch: int, num_heads: int, num_kv_heads: int, max_context_len: int, num_sms: int
) -> tuple[int, int]:
    """How version 3 cuts the contexts: ``(num_splits, split_size)``, every split
    ``split_size`` tokens (a multiple of ``V3_TILE_SIZE``) but a context's last.

    v3 launches a thread block per (KV head x slice of its query heads, sequence,
    split).  Splits are added until the grid gives each of the ``num_sms``
    multiprocessors about ``V3_BLOCKS_PER_SM`` thread blocks, so a batch of 64
    sequences gets one split and a single 32k-token sequence dozens; but none shorter
    than ``V3_MIN_SPLIT_TILES`` tiles, whose partial result would cost more to write and
    merge than the parallelism gains.
    """
    group = num_heads // num_kv_heads
    blocks = max(1, batch * num_kv_heads * math.ceil(group / v3_queries_per_block(group)))
    tiles = math.ceil(max_context_len / V3_TILE_SIZE)
    wanted = (V3_BLOCKS_PER_SM * num_sms + blocks // 2) // blocks  # rounded
    return _splits_of(max_context_len, max(1, min(wanted, tiles // V3_MIN_SPLIT_TILES)))


def _splits_of(max_context_len: int, num_splits: int) -> tuple[int, int]:
    """About ``num_splits`` splits of whole tiles: ``(num_splits, split_size)``."""
    tiles = math.ceil(max_context_len / V3_TILE_SIZE)
    split_size = math.ceil(tiles / num_splits) * V3_TILE_SIZE
    return math.ceil(max_context_len / split_size), split_size


def paged_attention_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    k_scale=None,
    v_scale=None,
    max_context_len: int | None = None,
    version: int | None = None,
    num_splits: int | None = None,
):
    """One query token per sequence over its paged context -> ``[B, num_heads, D]``.

    ``max_context_len`` bounds the contexts, if the caller knows it on the host; by
    default the block tables' width does, so that launching never waits for the GPU.
    ``version`` (0, 1, 2 or 3; default 3) and v3's ``num_splits`` (default: `split_kv`'s)
    are exposed for tests, the lesson and the benchmark; results do not depend on them
    beyond rounding.  A quantized cache comes with its ``k_scale`` and ``v_scale`` (not
    v0).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    check_supported(query.dtype, head_dim, block_size)
    version = DEFAULT_VERSION if version is None else version
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    if num_splits is not None and (version != 3 or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, for version 3, got {num_splits!r}")
    scales = kv_quant.kernel_scales(key_cache, k_scale, v_scale)
    if version == 0 and kv_quant.is_quantized(key_cache.dtype):
        raise ValueError(f"version 0 reads no {key_cache.dtype} KV cache: use version 1, 2 or 3")
    ext = _extension(query.device, version, query.dtype, key_cache.dtype, head_dim, block_size)
    max_len = max_context_len or block_tables.shape[1] * block_size
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    # The kernels read int32 tables and a query whose head_dim is contiguous.
    tables, lens = block_tables.to(torch.int32), context_lens.to(torch.int32)
    query = query if query.stride(2) == 1 else query.contiguous()
    args = (query, key_cache, value_cache, tables, lens, float(scale), max_len)
    if version == 0:
        ext.paged_attention_v0(out, *args)
    elif version == 1:
        ext.paged_attention_v1(out, *args, *scales)
    elif version == 2:
        partial, lse = _partials(
            batch, num_heads, math.ceil(max_len / PARTITION_SIZE), head_dim, query.device
        )
        ext.paged_attention_v2(out, partial, lse, *args, *scales)
    else:
        splits, split_size = (
            split_kv(batch, num_heads, num_kv_heads, max_len, _num_sms(query.device))
            if num_splits is None
            else _splits_of(max_len, num_splits)
        )
        partial, lse = (
            _partials(batch, num_heads, splits, head_dim, query.device)
            if splits > 1
            else (None, None)
        )
        ext.paged_attention_v3(out, partial, lse, *args, splits, split_size, *scales)
    return out


def _partials(batch, num_heads, num_partitions, head_dim, device):
    """The float32 partial outputs and log-sum-exps that v2 and v3 merge."""
    partial = torch.empty(
        batch, num_heads, num_partitions, head_dim, dtype=torch.float32, device=device
    )
    lse = torch.empty(batch, num_heads, num_partitions, dtype=torch.float32, device=device)
    return partial, lse


def _extension(device, version, dtype, cache_dtype, head_dim, block_size):
    """The built kernels a launch needs (`cuda_build.kernels_for`)."""
    kernels = cuda_build.kernels_for(device, version, dtype, cache_dtype, head_dim, block_size)
    return cuda_build.load(device, kernels)


def paged_attention_prefill(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale,
    k_scale=None,
    v_scale=None,
    max_query_len: int | None = None,
):
    """Causal attention of packed new tokens: the Triton kernel, on the same cache."""
    from minipaged.ops import triton_ops

    return triton_ops.paged_attention_prefill(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        k_scale,
        v_scale,
        max_query_len=max_query_len,
    )


def _check_one(name, value, allowed):
    if value not in allowed:
        raise ValueError(
            f"{name} must be one of {allowed} for the 'cuda' attention "
            f"backend, got {value}; the 'triton' backend takes any"
        )


@functools.cache  # asked on every decode launch; the answers never change
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the emulator runs one thread block at a time

"""The ``flashinfer`` backend: FlashInfer's paged-KV attention over minipaged's cache
(vLLM's FlashInfer backend; FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper``).

FlashInfer reads the cache minipaged keeps, ``[num_blocks, block_size, num_kv_heads,
head_dim]`` for K and for V (its ``"NHD"`` layout, K and V passed as a pair), but not
the block tables: it wants each sequence's pages packed in CSR form (`paged_kv_metadata`:
``indptr``, ``indices``, ``last_page_len``).  Keys and values are written by the torch
reference's scatter.  It runs only on a CUDA GPU with the ``flashinfer`` package
(``pip install flashinfer-python``), in fp16 or bf16, over a cache that is not quantized.
Each call plans its wrapper afresh (FlashInfer's host-side scheduling), where vLLM plans
once per step for every layer: correct, but not FlashInfer's best speed.
"""

from __future__ import annotations

import functools
import importlib

import torch

from minipaged.ops.torch_ref import write_kv as _write_kv

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch for split-KV partial results


def check_available(device: torch.device) -> None:
    """Raise ``RuntimeError`` saying why FlashInfer cannot run on ``device``."""
    _library("flashinfer", "flashinfer-python", device)


def _library(name: str, pip_name: str, device: torch.device):
    """The attention library ``name``, imported; ``RuntimeError`` naming what is missing."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"the {name!r} attention backend needs a CUDA GPU, got {device}")
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise RuntimeError(
            f"the {name!r} attention backend needs the {name} package "
            f"(pip install {pip_name}): {error}"
        ) from None


def check_supported(
    name: str, dtype: torch.dtype, head_dim: int, block_size: int, kv_cache_dtype
) -> None:
    """Raise ``ValueError`` unless FlashInfer's kernels take these shapes."""
    del block_size  # any page size
    _check_common(name, dtype, head_dim, HEAD_DIMS, kv_cache_dtype)


def _check_common(name, dtype, head_dim, head_dims, kv_cache_dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float16 or bfloat16 for the {name!r} backend, got {dtype}")
    if head_dim not in head_dims:
        raise ValueError(
            f"head_dim must be one of {head_dims} for the {name!r} backend, got {head_dim}"
        )
    if kv_cache_dtype not in (None, dtype):
        raise ValueError(
            f"kv_cache_dtype must be the model's {dtype} for the {name!r} backend "
            f"(it reads no quantized cache), got {kv_cache_dtype}"
        )


def paged_kv_metadata(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables ``[B, W]`` and context lengths ``[B]`` as FlashInfer's paged-KV
    description, all int32 on their device:

    - ``indptr [B + 1]``: sequence ``b``'s pages are ``indices[indptr[b]:indptr[b+1]]``;
    - ``indices``: the pages (physical blocks) each sequence uses, in order, packed;
    - ``last_page_len [B]``: the tokens in each sequence's last page, 1 to ``block_size``.
    """
    lens = context_lens.to(torch.int32)
    pages = (lens + block_size - 1) // block_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = pages.cumsum(0)
    used = torch.arange(block_tables.shape[1], device=lens.device)[None, :] < pages[:, None]
    indices = block_tables.to(torch.int32)[used]  # row-major: each sequence's in order
    last_page_len = lens - (pages - 1) * block_size
    return indptr, indices, last_page_len


@functools.cache
def _workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    """Scatter the new keys and values into their slots (the torch reference's)."""
    _write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    k_scale=None,
    v_scale=None,
    max_context_len=None,
):
    """One query per sequence: FlashInfer's batch decode over the paged cache."""
    flashinfer = _library("flashinfer", "flashinfer-python", query.device)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(query.device), "NHD")
    wrapper.plan(
        *paged_kv_metadata(block_tables, context_lens, block_size),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        pos_encoding_mode="NONE",
        q_data_type=query.dtype,
        kv_data_type=key_cache.dtype,
        sm_scale=scale,
    )
    return wrapper.run(query, (key_cache, value_cache))


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
    max_query_len=None,
):
    """Packed new tokens: FlashInfer's batch prefill over the paged cache, causal with
    the queries aligned to the end of each context (its ``causal=True``)."""
    flashinfer = _library("flashinfer", "flashinfer-python", query.device)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(query.device), "NHD")
    wrapper.plan(
        query_start_loc.to(torch.int32),
        *paged_kv_metadata(block_tables, context_lens, block_size),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        causal=True,
        sm_scale=scale,
        q_data_type=query.dtype,
        kv_data_type=key_cache.dtype,
    )
    return wrapper.run(query, (key_cache, value_cache))

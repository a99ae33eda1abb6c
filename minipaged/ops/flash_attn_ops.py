"""The ``flash_attn`` backend: FlashAttention-2's kernels over minipaged's paged cache
(vLLM's FlashAttention backend; ``flash_attn_with_kvcache`` and
``flash_attn_varlen_func`` with a ``block_table``).

FlashAttention reads minipaged's layout as it is: ``[num_blocks, block_size,
num_kv_heads, head_dim]`` for K and for V with an int32 block table per sequence, the
context lengths as ``cache_seqlens`` (decode) or their prefix sums ``cu_seqlens_k``
(prefill, `varlen_metadata`).  Its paged kernels want blocks of a multiple of 256 tokens
(vLLM's own fork of FlashAttention takes 16); keys and values are written by the torch
reference's scatter.  It runs only on a CUDA GPU with the ``flash-attn`` package, in fp16
or bf16, over a cache that is not quantized.
"""

from __future__ import annotations

import torch

from minipaged.ops.flashinfer_ops import _check_common, _library
from minipaged.ops.torch_ref import write_kv as _write_kv

PAGE_MULTIPLE = 256  # flash_attn 2's paged KV: page_block_size % 256 == 0
HEAD_DIMS = tuple(range(32, 257, 32))


def check_available(device: torch.device) -> None:
    """Raise ``RuntimeError`` saying why FlashAttention cannot run on ``device``."""
    _library("flash_attn", "flash-attn", device)


def check_supported(
    name: str, dtype: torch.dtype, head_dim: int, block_size: int, kv_cache_dtype
) -> None:
    """Raise ``ValueError`` unless FlashAttention's paged kernels take these shapes."""
    _check_common(name, dtype, head_dim, HEAD_DIMS, kv_cache_dtype)
    if block_size % PAGE_MULTIPLE:
        raise ValueError(
            f"block_size must be a multiple of {PAGE_MULTIPLE} for the {name!r} backend "
            f"(flash_attn's paged KV), got {block_size}"
        )


def varlen_metadata(
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor
) -> dict:
    """``flash_attn_varlen_func``'s paged arguments: ``cu_seqlens_q`` (the query
    offsets), ``cu_seqlens_k`` (each context's start in a packed K/V; the block table
    finds its tokens), ``max_seqlen_k`` and the int32 ``block_table``."""
    lens = context_lens.to(torch.int32)
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    cu_k[1:] = lens.cumsum(0)
    return dict(
        cu_seqlens_q=query_start_loc.to(torch.int32),
        cu_seqlens_k=cu_k,
        max_seqlen_k=int(lens.max()),
        block_table=block_tables.to(torch.int32),
    )


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
    """One query per sequence: ``flash_attn_with_kvcache`` over the paged cache (the new
    token's K/V already written, so none appended)."""
    flash_attn = _library("flash_attn", "flash-attn", query.device)
    out = flash_attn.flash_attn_with_kvcache(
        query.unsqueeze(1),  # [B, 1, H, D]: one new token per sequence
        key_cache,
        value_cache,
        cache_seqlens=context_lens.to(torch.int32),
        block_table=block_tables.to(torch.int32),
        softmax_scale=scale,
        causal=True,
    )
    return out.squeeze(1)


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
    """Packed new tokens: ``flash_attn_varlen_func`` with a block table, causal aligned
    to the end of each context (FlashAttention's since 2.1)."""
    flash_attn = _library("flash_attn", "flash-attn", query.device)
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max())
    return flash_attn.flash_attn_varlen_func(
        query,
        key_cache,
        value_cache,
        max_seqlen_q=max_query_len,
        softmax_scale=scale,
        causal=True,
        **varlen_metadata(query_start_loc, context_lens, block_tables),
    )

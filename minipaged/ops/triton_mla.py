"""Absorbed MLA decode in Triton over the paged latent cache (DeepSeek-V2 §2.1; the
shape of FlashMLA's and vLLM's ``TritonMLA`` decode).

`minipaged.ops.mla` explains the absorbed form: every query head attends to the same
latents ``[c_kv, k_pe]``, the score ``q_latent . c_kv + q_pe . k_pe``, the output the
weighted sum of ``c_kv``.  So a program takes ``BLOCK_H`` query heads of one sequence
as the rows of one matrix and walks the sequence's block table ``BLOCK_N`` positions at
a time: each latent tile is loaded once and serves as the keys (both parts) and as the
values (its ``c_kv`` part), for all those heads at once.  Where the unabsorbed form
reads ``heads x (qk_head_dim + v_head_dim)`` values a token, this reads
``kv_lora_rank + qk_rope_head_dim``, once per program (DeepSeek-V2-Lite: 16 x 320 =
5,120 against 576).

One program per (sequence, group of heads), no split of the context (flash-decoding's
split is `minipaged.ops.triton_ops`'; here a long context runs in one program).
Exponentials are base 2, as in `minipaged.ops.triton_kernels`.  An fp8 cache is read
as bytes times its one scale.  On a CPU it runs in Triton's interpreter
(``TRITON_INTERPRET=1``): ``tests/test_mla.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipaged.ops import kv_quant
from minipaged.ops.triton_kernels import LOG2E

__all__ = ["decode", "mla_decode_kernel"]

BLOCK_N = 32  # positions a tile
MIN_DOT = 16  # tl.dot's smallest side


@triton.jit
def mla_decode_kernel(
    query_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    kv_scale_ptr,
    qk_scale,
    num_heads,
    block_size,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ob,
    stride_oh,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Sequence ``program_id(0)``'s query heads ``BLOCK_H * program_id(1)`` onwards
    (``query [B, H, RANK + ROPE]``: ``q_latent`` then ``q_pe``) over its latents ->
    each head's weighted ``c_kv`` (``out [B, H, RANK]``)."""
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    heads = (h < num_heads)[:, None]
    q_row = query_ptr + b * stride_qb + h[:, None] * stride_qh
    q_latent = tl.load(q_row + r[None, :], mask=heads & (r < RANK)[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + p[None, :], mask=heads & (p < ROPE)[None, :], other=0.0)
    q_latent, q_pe = q_latent.to(tl.float32), q_pe.to(tl.float32)
    length = tl.load(context_lens_ptr + b)
    kv_scale = 1.0
    if QUANTIZED:
        kv_scale = tl.load(kv_scale_ptr)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < length
        # The block table turns positions into slots (§4.1); positions past the end
        # read as 0, for their slots may hold NaN.
        physical = tl.load(block_tables_ptr + b * stride_bt + n // block_size, mask=valid, other=0)
        row = physical.to(tl.int64) * stride_cb + (n % block_size) * stride_cs
        latent_row = cache_ptr + row[:, None]
        c_kv = tl.load(
            latent_row + r[None, :], mask=valid[:, None] & (r < RANK)[None, :], other=0.0
        )
        k_pe = tl.load(
            latent_row + RANK + p[None, :], mask=valid[:, None] & (p < ROPE)[None, :], other=0.0
        )
        c_kv = c_kv.to(tl.float32) * kv_scale
        k_pe = k_pe.to(tl.float32) * kv_scale
        scores = tl.dot(q_latent, tl.trans(c_kv), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp2(m - m_new)
        weights = tl.exp2(scores - m_new[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights, c_kv, input_precision=DOT_PRECISION)
        m = m_new
    out = acc / total[:, None]
    out_ptrs = out_ptr + b * stride_ob + h[:, None] * stride_oh + r[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=heads & (r < RANK)[None, :])


def decode(
    query: torch.Tensor,
    rank: int,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """``query [B, H, rank + rope]`` over ``cache [num_blocks, block_size, rank +
    rope]`` -> ``[B, H, rank]`` in the query's dtype (`mla_decode_kernel`)."""
    batch, num_heads, width = query.shape
    out = torch.empty(batch, num_heads, rank, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    block_h = max(MIN_DOT, triton.next_power_of_2(min(num_heads, 64)))
    quantized = kv_quant.is_quantized(cache.dtype)
    grid = (batch, triton.cdiv(num_heads, block_h))
    mla_decode_kernel[grid](
        query,
        cache,
        block_tables,
        context_lens,
        out,
        kv_scale if quantized else context_lens,  # any pointer when unused
        scale * LOG2E,
        num_heads,
        cache.shape[1],
        query.stride(0),
        query.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        RANK=rank,
        ROPE=width - rank,
        BLOCK_H=block_h,
        BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)),
        BLOCK_P=max(MIN_DOT, triton.next_power_of_2(width - rank)),
        BLOCK_N=BLOCK_N,
        QUANTIZED=quantized,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out

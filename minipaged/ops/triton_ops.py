"""The Triton backend: launching the kernels of ``triton_kernels`` (paper §4.1, §5.1).

Here live the choices a kernel cannot make for itself: how many programs to launch, how
big a tile each one takes, and, for decode, into how many splits to cut the context.
Arguments are checked in ``minipaged.ops``; these functions assume well-formed input.

On a machine without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is first imported): slow, but the same code, so the CPU tests
check exactly what the GPU runs.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from minipaged.ops import kv_quant
from minipaged.ops.triton_kernels import (
    LOG2E,
    decode_kernel,
    merge_splits_kernel,
    prefill_kernel,
    write_kv_kernel,
)

# Triton reads TRITON_INTERPRET when a kernel is defined, not when it runs.
INTERPRETED = isinstance(decode_kernel, InterpretedFunction)

# Keys per tile.  On a GPU, 64 keys x 128 dims in bf16 is 16 KiB per K (or V) tile: big
# enough to keep many loads in flight, small enough for 2-3 pipeline stages in shared
# memory.  The interpreter runs one program at a time, so there smaller tiles just
# exercise more loop iterations in tests at no real cost.
BLOCK_N = 64
# Query rows per prefill program (tokens x heads of the GQA group): tl.dot wants >= 16.
PREFILL_ROWS = 64
MIN_DOT_ROWS = 16
# Flash-decoding: a split shorter than this is not worth its partial result and merge.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Decode programs wanted per streaming multiprocessor when a batch is split.  One program
# keeps only one tile's loads in flight; at 64 sequences of 8 KV heads (512 programs,
# about 4 per SM of an H100 or H200) the unsplit kernel reads at the memory's rate,
# while 2 per SM (the split count that took "two waves") read at 18% of it on an H200
# for one 32K-token sequence.
PROGRAMS_PER_SM = 4


def check_available(device: torch.device) -> None:
    """Raise ``RuntimeError`` saying why the Triton kernels cannot run on ``device``."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and INTERPRETED:
        return
    raise RuntimeError(
        f"the 'triton' attention backend needs CUDA tensors (got {device.type}); on a CPU "
        "it runs in Triton's interpreter only if TRITON_INTERPRET=1 is set before "
        "minipaged.ops.triton_ops is first imported"
    )


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter ``key, value [T, num_kv_heads, head_dim]`` into their slots (§4.3); into a
    quantized cache, with ``kv_quant.write_kv`` (torch)."""
    if kv_quant.is_quantized(key_cache.dtype):
        kv_quant.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping,
        **_strides("k", key, "thd"),
        **_strides("v", value, "thd"),
        **_strides("c", key_cache, "bshd"),
        block_size=key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many splits of the context each decode program gets (flash-decoding).

    Decode launches one program per (sequence, KV head).  A big batch already gives
    every streaming multiprocessor a program or more, and splitting would only add a
    merge.  A few long sequences leave most of the GPU idle; cutting each context into
    splits that run in parallel fills it, up to ``PROGRAMS_PER_SM`` programs on each
    multiprocessor (enough loads in flight to read at the memory's rate), as long as
    each split keeps at least ``MIN_TOKENS_PER_SPLIT`` tokens to amortise its partial
    result, and no more than ``MAX_SPLITS``.
    """
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / programs)
    worth_it = math.ceil(max_context_len / MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, worth_it, MAX_SPLITS))


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
    num_splits: int | None = None,
    block_n: int | None = None,
):
    """One query token per sequence over its paged context -> ``[B, num_heads, D]``.

    ``max_context_len`` is the longest context, if the caller knows it on the host; by
    default the block tables' width bounds it, so that launching never waits for the
    GPU.  ``num_splits`` (default: ``choose_num_splits``) and ``block_n`` (keys per tile)
    are exposed for tests and the lesson; results do not depend on them beyond rounding.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    block_n = block_n or BLOCK_N
    max_len = max_context_len or block_tables.shape[1] * key_cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, _num_sms(query.device))
    # Splits start on tile boundaries, so no tile straddles two programs.
    tokens_per_split = block_n * math.ceil(max_len / (num_splits * block_n))
    out = torch.empty_like(query)
    group = num_heads // num_kv_heads
    args = dict(
        query_ptr=query,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        block_tables_ptr=block_tables,
        context_lens_ptr=context_lens,
        qk_scale=scale * LOG2E,
        tokens_per_split=tokens_per_split,
        **_strides("q", query, "bhd"),
        **_strides("c", key_cache, "bshd"),
        stride_bt=block_tables.stride(0),
        block_size=key_cache.shape[1],
        GROUP=group,
        BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(query.dtype),
        **_scale_args(key_cache, k_scale, v_scale),
    )
    grid = (batch, num_kv_heads, num_splits)
    if num_splits == 1:  # the program's result is the output: one split of [B, H, 1, D]
        decode_kernel[grid](out_ptr=out, **_strides("o", out.unsqueeze(2), "bhsd"), **args)
        return out
    partial = torch.empty(
        batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
    )
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    decode_kernel[grid](
        out_ptr=partial,
        **_strides("o", partial, "bhsd"),
        WRITE_LSE=True,
        lse_ptr=lse,
        stride_lb=lse.stride(0),
        stride_lh=lse.stride(1),
        **args,
    )
    merge_splits_kernel[(batch, num_heads)](
        out_ptr=out,
        partial_ptr=partial,
        lse_ptr=lse,
        num_splits=num_splits,
        **_strides("o", out, "bhd"),
        **_strides("p", partial, "bhsd"),
        stride_lb=lse.stride(0),
        stride_lh=lse.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


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
    block_n: int | None = None,
):
    """Causal attention of packed new tokens over cached prefix + chunk -> ``[T, H, D]``.

    ``max_query_len``, the most new tokens of any sequence, sizes the grid; by default
    it is bounded by the query's and the block tables' shapes, so that launching never
    waits for the GPU (programs past a sequence's last new token return at once).
    """
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    batch, num_kv_heads = block_tables.shape[0], key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_q = max(1, PREFILL_ROWS // block_g)
    max_new = max_query_len or min(num_tokens, block_tables.shape[1] * key_cache.shape[1])
    prefill_kernel[(triton.cdiv(max_new, block_q), batch, num_kv_heads)](
        out_ptr=out,
        query_ptr=query,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        block_tables_ptr=block_tables,
        query_start_loc_ptr=query_start_loc,
        context_lens_ptr=context_lens,
        qk_scale=scale * LOG2E,
        **_strides("q", query, "thd"),
        **_strides("o", out, "thd"),
        **_strides("c", key_cache, "bshd"),
        stride_bt=block_tables.stride(0),
        block_size=key_cache.shape[1],
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_N=block_n or BLOCK_N,
        DOT_PRECISION=_dot_precision(query.dtype),
        **_scale_args(key_cache, k_scale, v_scale),
    )
    return out


def _scale_args(key_cache, k_scale, v_scale) -> dict:
    """The kernels' scale arguments: ``scale[block, slot, kv_head]`` of a quantized
    cache (one layout, strides 0 for fp8's per-layer scale), or none to read."""
    if k_scale is None:
        # Never read: QUANTIZED is a compile-time False.
        return dict(
            k_scale_ptr=key_cache,
            v_scale_ptr=key_cache,
            stride_sb=0,
            stride_ss=0,
            stride_sh=0,
            QUANTIZED=False,
        )
    # One pair of strides for both: ``minipaged.ops`` checks they have one shape.
    k_scale, v_scale = kv_quant.kernel_scales(key_cache, k_scale, v_scale)
    return dict(
        k_scale_ptr=k_scale,
        v_scale_ptr=v_scale,
        stride_sb=k_scale.stride(0),
        stride_ss=k_scale.stride(1),
        stride_sh=k_scale.stride(2),
        QUANTIZED=True,
    )


def _strides(name: str, tensor: torch.Tensor, dims: str) -> dict[str, int]:
    """``tensor``'s strides as the kernels' keyword arguments: ``_strides("q", query,
    "bhd")`` is ``{"stride_qb": ..., "stride_qh": ..., "stride_qd": ...}``."""
    strides = zip(dims, tensor.stride(), strict=True)
    return {f"stride_{name}{dim}": stride for dim, stride in strides}


def _block_d(head_dim: int) -> int:
    # tl.arange needs a power of two and tl.dot at least 16; odd head dims are masked.
    return max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot defaults to TF32 on a GPU (10-bit mantissa), far outside fp32 tolerances;
    # fp16/bf16 inputs are exact in either mode.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache  # asked on every decode launch; the answer never changes
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs one program at a time

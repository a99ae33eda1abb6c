"""PagedAttention in Triton: the kernels, in the order a reader meets them (paper §4.1, §5.1).

The cache of one layer is a pool of physical blocks, ``key_cache, value_cache:
[num_blocks, block_size, num_kv_heads, head_dim]``, and a sequence's tokens are scattered
over that pool in whatever order the block allocator handed blocks out.  The sequence's
row of the block table says where: its logical block ``i`` (tokens ``i * block_size`` to
``(i + 1) * block_size - 1``) lives in physical block ``block_table[i]``.

Read this file top to bottom:

1. ``write_kv_kernel`` stores each new token's K and V at its slot.
2. ``_load_kv_tile`` walks the block table: it turns ``BLOCK_N`` token positions into cache
   addresses, which is all that paging changes about attention.
3. ``_attend_tile`` is one step of the online softmax (FlashAttention's trick): it folds a
   tile of keys into a running max, a running sum and a running weighted sum of values,
   so the whole context never has to sit in memory at once.
4. ``decode_kernel``: one program per (sequence, KV head, split).  The program takes the
   query heads that share the KV head (GQA) as the rows of one matrix, so every K/V tile
   is read from memory once for the whole group, not once per query head.  With more than
   one split (flash-decoding), each program covers a slice of the context and leaves a
   partial result and its log-sum-exp;
5. ``merge_splits_kernel`` combines those partials into the final output.
6. ``prefill_kernel``: a packed chunk of new tokens per sequence attends causally to the
   cached prefix plus itself; rows are (token, query head of the group) pairs, so again
   each K/V tile is read once per tile of queries.

The launch code (grids, tile sizes, the number of splits) is in ``triton_ops``.  These
kernels take every stride as an argument, so views (a query sliced out of a fused QKV
projection, say) need no copy; Triton specialises strides equal to 1, so contiguous
inputs still get vectorised loads.

Exponentials are base 2 (``exp2`` is one instruction on a GPU): scores are multiplied by
``scale * log2(e)`` up front, and every log-sum-exp here is in base 2 as well.

Validate (against the contiguous oracle; on a CPU in Triton's interpreter, which
``tests/conftest.py`` turns on) and time (on a GPU, against the torch backend and the
CUDA kernels)::

    pytest tests/test_ops_triton.py
    minipaged bench attention --backends torch triton cuda-v1 cuda-v2
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# 1. Writing K/V ------------------------------------------------------------------------
@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per new token: copy its ``[num_kv_heads, head_dim]`` keys and values
    into slot ``slot_mapping[t]``, i.e. block ``slot // block_size``, offset
    ``slot % block_size`` (§4.3).  A slot of -1 (padding, or KV already cached) is skipped.
    """
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // block_size, slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d * stride_cd
    key = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    tl.store(key_cache_ptr + dst, key, mask=mask)
    value = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


# 2. Walking the block table -------------------------------------------------------------
@triton.jit
def _load_kv_tile(
    cache_ptr,
    block_table_ptr,
    n,
    in_context,
    kv_head,
    block_size,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    scale_ptr,
    stride_sb,
    stride_ss,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Load keys (or values) of token positions ``n [BLOCK_N]`` of one sequence and one
    KV head -> ``[BLOCK_N, BLOCK_D]``; from a ``QUANTIZED`` cache (fp8, int8:
    ``kv_quant``), float32, each row times its slot's scale, ``scale[block, slot,
    kv_head]``.

    Position ``n`` is in logical block ``n // block_size``; the block table maps that to
    a physical block, and the token sits at offset ``n % block_size`` inside it (§4.1).
    A tile may span several physical blocks (small blocks) or part of one (large blocks):
    the address is worked out per row, so any block size works with any tile size.
    Positions outside the context are masked and read as 0: their cache slots, and the
    block-table entries past the sequence's last block, may hold garbage (even NaN), and
    a NaN times a zero softmax weight is still NaN.
    """
    physical = tl.load(block_table_ptr + n // block_size, mask=in_context, other=0)
    row = physical.to(tl.int64) * stride_cb + (n % block_size) * stride_cs
    d = tl.arange(0, BLOCK_D)
    ptrs = cache_ptr + row[:, None] + kv_head * stride_ch + d[None, :] * stride_cd
    mask = in_context[:, None] & (d < HEAD_DIM)[None, :]
    tile = tl.load(ptrs, mask=mask, other=0.0)
    if QUANTIZED:
        scale = tl.load(
            scale_ptr
            + physical.to(tl.int64) * stride_sb
            + (n % block_size) * stride_ss
            + kv_head * stride_sh,
            mask=in_context,
            other=0.0,
        )
        tile = tile.to(tl.float32) * scale[:, None]
    return tile


# 3. One step of the online softmax --------------------------------------------------------
@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    kv_end,
    query_pos,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    kv_head,
    block_size,
    qk_scale,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Fold keys ``n0 .. n0 + BLOCK_N - 1`` (those below ``kv_end``) into the running
    softmax of every query row.

    ``q [M, BLOCK_D]`` holds M query rows; row ``r`` sits at position ``query_pos[r]`` and
    may only see keys at positions ``<= query_pos[r]`` (causal; for decode that is every
    key).  Per row we carry ``m_i``, the largest score so far (base-2 units), ``l_i``,
    the sum of ``exp2(score - m_i)``, and ``acc``, the same weights times V.  A new tile
    with a larger max rescales what came before by ``exp2(m_old - m_new)``, so the result
    equals a softmax over all keys at once, without ever holding all the scores.
    The caller guarantees every row sees at least one key in the first tile it folds, so
    ``m_i`` is finite from then on and no ``-inf - -inf`` can appear.
    """
    n = n0 + tl.arange(0, BLOCK_N)
    in_context = n < kv_end
    k = _load_kv_tile(
        key_cache_ptr,
        block_table_ptr,
        n,
        in_context,
        kv_head,
        block_size,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_cd,
        k_scale_ptr,
        stride_sb,
        stride_ss,
        stride_sh,
        HEAD_DIM,
        BLOCK_D,
        QUANTIZED,
    )
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    visible = in_context[None, :] & (n[None, :] <= query_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    rescale = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    v = _load_kv_tile(
        value_cache_ptr,
        block_table_ptr,
        n,
        in_context,
        kv_head,
        block_size,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_cd,
        v_scale_ptr,
        stride_sb,
        stride_ss,
        stride_sh,
        HEAD_DIM,
        BLOCK_D,
        QUANTIZED,
    )
    # The tensor cores take P in the query's dtype, as FlashAttention does (dequantized
    # keys and values too); fp32 stays fp32.
    v = v.to(q.dtype)
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * rescale + tl.sum(p, axis=1)
    return m_new, l_i, acc


# 4. Decode: one query token per sequence, GQA group as rows, optional split-KV ------------
@triton.jit
def decode_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    block_size,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    stride_sh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    # Only with more than one split: each split's log-sum-exp, [batch, num_heads, splits].
    WRITE_LSE: tl.constexpr = False,
    lse_ptr=None,
    stride_lb=0,
    stride_lh=0,
):
    """Program ``(b, kv_head, split)``: the ``GROUP`` query heads that read ``kv_head``
    attend to tokens ``[split * tokens_per_split, (split + 1) * tokens_per_split)`` of
    sequence ``b``'s context (all of it when there is one split).

    The group's query vectors are the rows of ``q [BLOCK_G, BLOCK_D]`` (padded up to 16
    rows, the smallest tile ``tl.dot`` takes; the padding rows are zeros and never
    stored), so one pass over the K/V tiles serves the whole group: GQA's memory saving
    becomes a bandwidth saving too.  With ``WRITE_LSE`` the program writes its partial
    output (already divided by its own softmax sum) and that sum's log, ``m + log2(l)``,
    for ``merge_splits_kernel``; without, it writes the final output.
    """
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        query_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_mask,
        other=0.0,
    )
    # The new token is the last of its context, so it sees every key: causal is a no-op.
    query_pos = tl.zeros([BLOCK_G], tl.int32) + context_len - 1

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            end,
            query_pos,
            key_cache_ptr,
            value_cache_ptr,
            block_table,
            kv_head,
            block_size,
            qk_scale,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_cd,
            k_scale_ptr,
            v_scale_ptr,
            stride_sb,
            stride_ss,
            stride_sh,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            DOT_PRECISION,
            QUANTIZED,
        )

    # A split past the end of a short sequence saw no key: l = 0, lse = -inf, output 0,
    # and the merge gives it weight exp2(-inf) = 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_ptrs = (
        out_ptr
        + b * stride_ob
        + head[:, None] * stride_oh
        + split * stride_os
        + d[None, :] * stride_od
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    if WRITE_LSE:
        lse = m_i + tl.log2(l_safe)
        tl.store(lse_ptr + b * stride_lb + head * stride_lh + split, lse, mask=g < GROUP)


# 5. Merging the splits ------------------------------------------------------------------
@triton.jit
def merge_splits_kernel(
    out_ptr,
    partial_ptr,
    lse_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program ``(b, head)``: the softmax over the whole context from per-split results.

    Split ``s`` computed ``o_s = sum_j exp2(x_j) v_j / l_s`` over its keys, with
    ``lse_s = log2(l_s)`` (max included).  The softmax over all keys weights each ``o_s``
    by its share of the total mass, ``exp2(lse_s) / sum_t exp2(lse_t)``; subtracting the
    largest ``lse`` first keeps every exponent <= 0.
    """
    b, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(
        lse_ptr + b * stride_lb + head * stride_lh + s, mask=s < num_splits, other=float("-inf")
    )
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    weight = weight / tl.sum(weight, axis=0)
    mask = (s < num_splits)[:, None] & (d < HEAD_DIM)[None, :]
    partial = tl.load(
        partial_ptr
        + b * stride_pb
        + head * stride_ph
        + s[:, None] * stride_ps
        + d[None, :] * stride_pd,
        mask=mask,
        other=0.0,
    )
    out = tl.sum(weight[:, None] * partial, axis=0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# 6. Prefill: packed chunks of new tokens, causal over cached prefix + chunk ---------------
@triton.jit
def prefill_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    block_size,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    stride_sh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Program ``(tile, b, kv_head)``: new tokens ``tile * BLOCK_Q ...`` of sequence ``b``,
    with every query head of ``kv_head``'s group, attend causally.

    Sequence ``b``'s new tokens are query rows ``query_start_loc[b] ..
    query_start_loc[b+1] - 1``; they are the last ``n_new`` of its ``context_len`` cached
    tokens (their K/V already written), so new token ``j`` sits at position
    ``context_len - n_new + j``: after a prefix-cache hit or an earlier chunk of a
    chunked prefill, that is well past 0.  Rows of the tile are (token, head-in-group)
    pairs, ``BLOCK_Q * BLOCK_G`` of them, so each K/V tile loaded serves them all.  Keys
    past the tile's last query position can never be seen, so the loop stops there.
    """
    tile, b, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    num_new = tl.load(query_start_loc_ptr + b + 1) - q_start
    if tile * BLOCK_Q >= num_new:
        return
    context_len = tl.load(context_lens_ptr + b)
    first_pos = context_len - num_new  # position of new token 0

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    token = tile * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    row_mask = ((token < num_new) & (g < GROUP))[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        query_ptr
        + (q_start + token)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + d[None, :] * stride_qd,
        mask=row_mask,
        other=0.0,
    )
    # Padding rows past the last new token get positions past it too, so (like real rows)
    # they see key 0 in the first tile; their results are never stored.
    query_pos = first_pos + token

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    kv_end = tl.minimum(context_len, first_pos + (tile + 1) * BLOCK_Q)
    block_table = block_tables_ptr + b * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            kv_end,
            query_pos,
            key_cache_ptr,
            value_cache_ptr,
            block_table,
            kv_head,
            block_size,
            qk_scale,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_cd,
            k_scale_ptr,
            v_scale_ptr,
            stride_sb,
            stride_ss,
            stride_sh,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            DOT_PRECISION,
            QUANTIZED,
        )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr
        + (q_start + token)[:, None] * stride_ot
        + head[:, None] * stride_oh
        + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )

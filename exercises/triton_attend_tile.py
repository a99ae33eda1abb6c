"""Lesson 07: one step of the online softmax, in Triton (§4.1, FlashAttention's trick).

Write ``attend_tile``, the ``@triton.jit`` function at the heart of
`minipaged.ops.triton_kernels`' decode and prefill kernels: it folds one tile of
``BLOCK_N`` keys and values into every query row's running softmax.  Load the tile
with ``_load_kv_tile`` (given: it walks the block table), once for the keys and once
for the values.  Scores are in base 2: multiply ``q @ k^T`` by ``qk_scale`` (which
includes ``log2(e)``) and use ``tl.exp2``.  Use ``tl.dot(a, b,
input_precision=DOT_PRECISION)`` for both products, and give ``tl.dot`` the
probabilities in the values' dtype (``p.to(v.dtype)``).

On a CPU the kernels run in Triton's interpreter (the tests set ``TRITON_INTERPRET=1``),
which runs this body as Python: the stub's ``raise`` is what you replace.
Check with ``make check LESSON=07``.
"""

import triton
import triton.language as tl

from minipaged.ops.triton_kernels import _load_kv_tile  # noqa: F401  (use it)


@triton.jit
def attend_tile(
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
    softmax of every query row; return the new ``(m_i, l_i, acc)``.

    ``q [M, BLOCK_D]`` holds M query rows; row ``r`` sits at position ``query_pos[r]`` and
    sees only keys at positions ``<= query_pos[r]`` (and ``< kv_end``): mask the others
    to ``-inf``.  ``m_i [M]`` is each row's largest score so far, ``l_i [M]`` the sum of
    ``exp2(score - m_i)``, ``acc [M, BLOCK_D]`` the same weights times V.  A tile with a
    larger max rescales what came before by ``exp2(m_old - m_new)``.  Load a tile with
    ``_load_kv_tile(cache_ptr, block_table_ptr, n, in_context, kv_head, block_size,
    stride_cb, stride_cs, stride_ch, stride_cd, scale_ptr, stride_sb, stride_ss, stride_sh,
    HEAD_DIM, BLOCK_D, QUANTIZED)``, with ``k_scale_ptr`` for the keys and
    ``v_scale_ptr`` for the values (they dequantize a quantized cache, lesson 14; pass
    them through), and give ``tl.dot`` the loaded tiles in the query's dtype
    (``k.to(q.dtype)``, ``v.to(q.dtype)``).
    """
    raise NotImplementedError("write attend_tile() in exercises/triton_attend_tile.py")

"""Lesson 07: PagedAttention's decode, block by block, with the online softmax (§4.1).

Write ``paged_attention_decode`` in plain PyTorch, the way the kernels work: for each
sequence, walk its block table one physical block at a time, and fold each block's
keys and values into a running max ``m``, a running sum ``l`` of ``exp(score - m)``
and a running weighted sum ``acc`` of values.  When a block raises the max, rescale
what came before by ``exp(m_old - m_new)``.  The result is ``acc / l``: the softmax
over the whole context, without ever holding all its scores.

It replaces the gather-then-attend `minipaged.ops.torch_ref.paged_attention_decode`,
and is checked against the naive contiguous oracle.  Compute in float32 and return
the query's dtype.  Check with ``make check LESSON=07``.
"""

import torch


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One new token per sequence attends to its whole context.

    ``query [B, num_heads, D]``; ``key_cache, value_cache [num_blocks, block_size,
    num_kv_heads, D]``; ``block_tables [B, max_blocks]`` (entries past a sequence's last
    block are garbage); ``context_lens[b]`` tokens of sequence ``b`` are cached, the
    last block possibly partly full.  Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)`` (grouped-query attention).  Returns
    ``[B, num_heads, D]``.  ``k_scale``/``v_scale`` belong to a quantized cache
    (lesson 14); this exercise's caches are not quantized, so they are None.
    """
    raise NotImplementedError("write paged_attention_decode() in exercises/online_softmax.py")

"""PagedAttention in plain PyTorch: the reference backend.

The KV cache of one layer is a pool of physical blocks,
``key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.  A
sequence's keys and values are scattered over that pool; its block table lists which
physical block holds each of its logical blocks (paper §4.2).  These functions read
through the block table into dense tensors and then attend the ordinary way.  They are
short rather than fast: the Triton and CUDA backends do the same work without ever
materialising the gathered K/V.

Two things keep them usable as the CPU's attention path.  The gather is one
``index_select`` of cache slots into a buffer reused from call to call (`_workspace`):
a fresh buffer of tens of megabytes costs the kernel a page fault per 4 KB, which on a
CPU took longer than the copy itself.  And each KV head's scores are one ``bmm`` over
strided views of the gathered K/V, with no copy to reorder them.

A quantized cache (fp8, int8: `kv_quant`) is written by `kv_quant.write_kv`, and
gathered as its bytes, then widened to float32 and multiplied by each position's scale.

Arguments are checked in ``minipaged.ops``; these functions assume well-formed input.
"""

from __future__ import annotations

import torch

from minipaged.ops import kv_quant


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each new token's key and value in its cache slot, in place (paper §4.3).

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``.  A slot of -1
    means "do not store": padding tokens, or tokens whose KV is already cached.
    """
    if kv_quant.is_quantized(key_cache.dtype):
        kv_quant.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    # Slot s is row s of the cache seen as [num_blocks * block_size, ...] (a view: the
    # caches are contiguous), so one index_copy_ stores every token.
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


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
    """One new token per sequence attends to its whole context (paper §4.1).

    ``query [B, num_heads, D]``; ``context_lens[b]`` tokens of sequence ``b`` are in the
    cache, the current one included.  ``max_context_len``, if the caller knows it on the
    host, spares reading it back from the device.  Returns ``[B, num_heads, D]``.
    """
    max_len = max_context_len or int(context_lens.max())
    k, v, valid = _gather_kv(
        key_cache, value_cache, block_tables, context_lens, max_len, k_scale, v_scale
    )
    # The new token is the last position, so it may see every valid one: no causal mask.
    return _attend(query[:, None], k, v, valid[:, None], scale)[:, 0]


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention for a packed chunk of new tokens per sequence (paper §4.1, §4.5).

    Sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; they are
    its last ``n_new`` tokens, so new token ``j`` sits at ``context_lens[b] - n_new + j``
    and sees the cached prefix plus the new tokens up to itself.  Returns
    ``[T, num_heads, D]``.  ``max_query_len`` is taken for a signature shared with the
    Triton backend, which sizes its grid with it; this loop over sequences needs none.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for b, (start, end, length) in enumerate(zip(starts, starts[1:], context_lens.tolist())):
        k, v, _ = _gather_kv(
            key_cache,
            value_cache,
            block_tables[b : b + 1],
            context_lens[b : b + 1],
            length,
            k_scale,
            v_scale,
        )
        key_pos = torch.arange(length, device=query.device)
        query_pos = key_pos[length - (end - start) :]
        causal = key_pos[None, :] <= query_pos[:, None]
        out[start:end] = _attend(query[None, start:end], k, v, causal[None], scale)[0]
    return out


def _gather_kv(
    key_cache, value_cache, block_tables, context_lens, max_len, k_scale=None, v_scale=None
):
    """Read the first ``max_len`` positions of each sequence through its block table.

    Position ``i`` of sequence ``b`` lives in physical block ``block_tables[b, i //
    block_size]`` at offset ``i % block_size`` (paper §4.1).  Returns ``k, v [B, max_len,
    num_kv_heads, D]`` and ``valid [B, max_len]``.  Positions past a sequence's length
    read its position 0 instead: block-table entries past its last block, and slots past
    its last token, may hold anything (even NaN), and a zero attention weight times NaN
    would still be NaN.  Both tensors live in `_workspace` buffers, valid until the
    next call; from a quantized cache they are new float32 tensors, each position
    times its slot's scale.
    """
    block_size = key_cache.shape[1]
    pos = torch.arange(max_len, device=key_cache.device)
    valid = pos[None, :] < context_lens[:, None]
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    slots = torch.where(valid, slots, slots[:, :1]).view(-1)
    shape = (*valid.shape, *key_cache.shape[2:])
    k, v = (
        torch.index_select(
            cache.flatten(0, 1), 0, slots, out=_workspace(name, slots.numel(), cache)
        ).view(shape)
        for name, cache in (("key", key_cache), ("value", value_cache))
    )
    if kv_quant.is_quantized(key_cache.dtype):
        k, v = (
            kv_quant.dequantize(x, s.flatten(0, 1)[slots].view(*shape[:3], 1))
            for x, s in zip((k, v), kv_quant.kernel_scales(key_cache, k_scale, v_scale))
        )
    return k, v, valid


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(name: str, rows: int, cache: torch.Tensor) -> torch.Tensor:
    """A ``[rows, num_kv_heads, D]`` buffer of ``cache``'s dtype and device, the same
    memory at every call (grown when too small): every layer of every step gathers
    into it."""
    key = (name, cache.device, cache.dtype)
    buffer = _WORKSPACES.get(key)
    if buffer is None or buffer.shape[0] < rows or buffer.shape[1:] != cache.shape[2:]:
        # A normal tensor even when made under inference mode (the engine's), so that
        # a forward outside it (a test under no_grad) may write into it too.
        with torch.inference_mode(False):
            buffer = _WORKSPACES[key] = torch.empty(
                rows, *cache.shape[2:], dtype=cache.dtype, device=cache.device
            )
    return buffer[:rows]


def _attend(query, k, v, mask, scale):
    """``query [B, n, H, D]`` attends to ``k, v [B, L, H_kv, D]`` where ``mask [B, n, L]``.

    Scores and softmax run in float32 whatever the storage dtype, as the kernels do.
    GQA: the ``group`` query heads of one KV head are rows of one ``bmm`` against that
    head's keys, a strided view of ``k``, so K/V are never copied per query head.  (Not
    torch's fused SDPA: on a CPU it splits a decode's keys over threads, so a
    sequence's logits, and its seeded samples, would depend on the thread count.)
    """
    batch, n, num_heads, head_dim = query.shape
    length, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(batch, n, num_kv_heads, group, head_dim)
    k, v = k.float(), v.float()
    hidden = ~mask[:, :, None, :]  # [B, n, 1, L]: the same for a head's whole group
    out = torch.empty(batch, n, num_kv_heads, group, head_dim, device=query.device)
    for h in range(num_kv_heads):
        rows = q[:, :, h].reshape(batch, n * group, head_dim)
        scores = torch.bmm(rows, k[:, :, h].transpose(1, 2)).mul_(scale)
        scores = scores.view(batch, n, group, length).masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(dim=-1).view(batch, n * group, length)
        out[:, :, h] = torch.bmm(probs, v[:, :, h]).view(batch, n, group, head_dim)
    return out.view(batch, n, num_heads, head_dim).to(query.dtype)

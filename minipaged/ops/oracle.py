"""The attention oracle: explicit softmax over dense, contiguous K/V.

This is the textbook formula, ``softmax(q @ k^T * scale) @ v``, written out with no
paging, no blocks and no tricks.  Every backend (torch reference, Triton, CUDA) is
tested against it.  It takes each sequence's keys and values as one dense tensor, so
it shares no code with the block-table gather it checks, and it computes in float64,
so it is more precise than anything it judges.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def attention_oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
) -> torch.Tensor:
    """Attention of one sequence: ``q [n, num_heads, D]``, ``k, v [L, num_kv_heads, D]``.

    With ``causal=True`` the ``n`` queries are the *last* ``n`` of the ``L`` positions:
    query ``j`` sits at position ``L - n + j`` and sees keys at positions up to its own.
    Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (GQA).
    Returns ``[n, num_heads, D]`` in the dtype of ``q``.
    """
    n, length = q.shape[0], k.shape[0]
    if causal and n > length:
        raise ValueError(f"causal attention needs n <= L, got n={n}, L={length}")
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if causal:
        query_pos = torch.arange(length - n, length, device=q.device)
        key_pos = torch.arange(length, device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("hnl,lhd->nhd", weights, v).to(q.dtype)


def decode_oracle(
    query: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """One new token per sequence: ``query [B, num_heads, D]``; ``keys[b], values[b]``
    are sequence ``b``'s dense K/V ``[L_b, num_kv_heads, D]``, the new token included."""
    return torch.stack(
        [
            attention_oracle(q[None], k, v, scale)[0]
            for q, k, v in zip(query, keys, values, strict=True)
        ]
    )


def prefill_oracle(
    query: torch.Tensor,
    query_start_loc: Sequence[int] | torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens: ``query [T, num_heads, D]``, sequence ``b``
    owning rows ``query_start_loc[b]:query_start_loc[b+1]``; ``keys[b], values[b]`` hold
    its whole context (cached prefix + new tokens)."""
    starts = [int(s) for s in query_start_loc]
    if len(starts) != len(keys) + 1:
        raise ValueError(f"query_start_loc needs {len(keys) + 1} entries, got {len(starts)}")
    out = torch.empty_like(query)
    for start, end, k, v in zip(starts, starts[1:], keys, values):
        out[start:end] = attention_oracle(query[start:end], k, v, scale, causal=True)
    return out

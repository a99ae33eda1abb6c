"""Multi-head latent attention's ops over a paged *latent* cache (DeepSeek-V2, Liu et al.
2024, §2.1; vLLM's ``MLACommonImpl``, FlashMLA).

MLA caches one vector per token and layer instead of a key and a value per KV head: the
compressed ``c_kv`` (``kv_lora_rank`` values, after its RMSNorm) and the decoupled RoPE
key ``k_pe`` (``qk_rope_head_dim`` values, rotated), side by side.  The cache of a layer
is one tensor ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, no heads
dimension, paged exactly as the K/V caches are (slot ``s``: block ``s // block_size``,
offset ``s % block_size``), so block tables, prefix caching, copy-on-write and swapping
move it without knowing what it holds.  An fp8 cache stores it over one scale per
layer (`kv_quant`'s rules, vLLM's ``k_scale``).

Every head's key and value are linear in ``c_kv``: ``k_nope[h] = W_UK[h] c_kv`` and
``v[h] = W_UV[h] c_kv`` (the rows of ``kv_b_proj``).  So a query head's score is

    q_nope[h] . (W_UK[h] c_kv) + q_pe[h] . k_pe = (W_UK[h]^T q_nope[h]) . c_kv + q_pe[h] . k_pe

and its output ``W_UV[h] (sum_j p_j c_kv_j)``: with ``W_UK`` *absorbed* into the query,
every head attends to the same 576-value latent (multi-query attention with one KV head
whose value is the key's first ``kv_lora_rank`` values), and ``W_UV`` is applied once to
each head's weighted latent.  `decode_absorbed` runs that over the paged cache:

- ``torch``: gather the latents, two matmuls (readable);
- ``triton``: `minipaged.ops.triton_mla`, one pass over the latent, each tile serving as
  key and as value;
- ``cpu``: ``kernels/cpu/mla_decode.cpp``, one pass over each sequence's latents for a
  chunk of its heads, each row serving as key and as value.

The unabsorbed form decompresses each context's latents into per-head keys and values
(`gather_latent`, then ``kv_b_proj``) for the ordinary paged kernels; the model does that
for prefill always and for decode when asked (`minipaged.models.deepseek_v2`).
"""

from __future__ import annotations

import importlib

import torch

from minipaged.ops import kv_quant

__all__ = [
    "decode_absorbed",
    "gather_latent",
    "write_latent",
]


def write_latent(
    latent: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Store ``latent [T, L]`` (``c_kv`` then ``k_pe``) at ``slot_mapping [T]`` of
    ``cache [num_blocks, block_size, L]``, in place; slot -1 skips a token.  An fp8 cache
    stores ``latent / scale`` rounded (`kv_quant.quantize`)."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        latent, slots = latent[keep], slots[keep]
    if kv_quant.is_quantized(cache.dtype):
        latent = kv_quant.quantize(latent, scale, cache.dtype)
        # Raw bytes: torch's index_copy_ has no fp8 kernel.
        cache.view(torch.uint8).view(-1, cache.shape[-1]).index_copy_(
            0, slots, latent.view(torch.uint8)
        )
        return
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, latent)


def gather_latent(
    cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype, scale=None
) -> torch.Tensor:
    """The latents of physical ``blocks`` ``[n]`` -> ``[n, block_size, L]`` in
    ``dtype``, an fp8 cache's bytes times its ``scale``."""
    latent = cache[blocks.long()]
    if kv_quant.is_quantized(cache.dtype):
        return kv_quant.dequantize(latent, scale).to(dtype)
    return latent.to(dtype)


def decode_absorbed(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    backend: str = "torch",
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: ``q_latent [B, H, kv_lora_rank]`` (``W_UK^T q_nope``) and
    ``q_pe [B, H, rope]`` attend to the ``context_lens[b]`` latents of sequence ``b``
    -> each head's weighted latent ``[B, H, kv_lora_rank]`` (float32 from torch and the
    CPU kernel, the query's dtype from Triton), ``W_UV`` still to apply."""
    if backend == "torch":
        return _decode_torch(
            q_latent, q_pe, cache, block_tables, context_lens, scale, kv_scale, max_context_len
        )
    rank = q_latent.shape[-1]
    query = torch.cat((q_latent, q_pe), dim=-1)
    if backend == "cpu":
        cpu_ops = importlib.import_module("minipaged.ops.cpu_ops")
        return cpu_ops.mla_decode(query, cache, block_tables, context_lens, rank, scale, kv_scale)
    if backend == "triton":
        triton_mla = importlib.import_module("minipaged.ops.triton_mla")
        return triton_mla.decode(
            query, rank, cache, block_tables, context_lens, scale, kv_scale, max_context_len
        )
    raise ValueError(f"backend must be 'torch', 'cpu' or 'triton', got {backend!r}")


def _decode_torch(q_latent, q_pe, cache, block_tables, context_lens, scale, kv_scale, max_len):
    """Gather each sequence's latents through its block table (positions past its end
    read its position 0: unwritten slots may hold NaN), then attend: scores from
    ``c_kv`` and ``k_pe``, the weighted sum of ``c_kv`` alone.  In float32."""
    rank = q_latent.shape[-1]
    block_size = cache.shape[1]
    max_len = max_len or int(context_lens.max())
    pos = torch.arange(max_len, device=cache.device)
    valid = pos[None, :] < context_lens[:, None]  # [B, L]
    blocks = block_tables[:, pos // block_size].long()
    slots = torch.where(valid, blocks * block_size + pos % block_size, blocks[:, :1] * block_size)
    latent = cache.flatten(0, 1)[slots]  # [B, max_len, L]
    if kv_quant.is_quantized(cache.dtype):
        latent = kv_quant.dequantize(latent, kv_scale)
    latent = latent.float()
    c_kv, k_pe = latent[..., :rank], latent[..., rank:]
    scores = torch.einsum("bhr,blr->bhl", q_latent.float(), c_kv)
    scores += torch.einsum("bhp,blp->bhl", q_pe.float(), k_pe)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blr->bhr", scores.softmax(dim=-1), c_kv)

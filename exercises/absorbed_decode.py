"""Lesson 21: multi-head latent attention's decode with the up-projections absorbed
(DeepSeek-V2, DeepSeek-AI 2024, §2.1.2-2.1.3; vLLM's ``MLACommonImpl`` decode).

Write ``decode_absorbed``, the decode step of `MLAPagedAttention` (in
`minipaged.models.deepseek_v2`) in the absorbed form, then check with
``make check LESSON=21``: the tests compare your decode with the naive oracle (every
head's keys and values rebuilt from the latents, then attention in float64) on the
torch, CPU and Triton backends over shuffled paged blocks, on an fp8 latent cache, and
DeepSeek-V2's greedy tokens through the whole engine with Hugging Face's.

Hint: two ``torch.einsum`` around one call.  ``kv_b_proj.weight`` is ``[heads *
(qk_nope_head_dim + v_head_dim), kv_lora_rank]``: view it ``[heads, qk_nope_head_dim +
v_head_dim, kv_lora_rank]`` and split dim 1 into ``W_UK`` and ``W_UV``.  Absorb
``W_UK`` into the query (``q_latent[b, h] = W_UK[h]^T q_nope[b, h]``), let
``mla.decode_absorbed`` attend to the cached latents on ``self._kernel_backend()``
(its arguments: the query's two parts, ``cache``, ``attn``'s decode block tables and
context lengths, ``self.scale``, ``kv_scale``, the backend, and ``attn``'s longest
decode context), then apply ``W_UV`` to the weighted latents, cast back to the query's
dtype first.
"""

import torch

from minipaged.ops import mla  # noqa: F401 (yours to call)


def decode_absorbed(self, impl, q_nope, q_pe, cache, kv_scale, attn, kv_b_proj) -> torch.Tensor:
    """Each decoding sequence's attention output ``[B, heads, v_head_dim]`` from
    ``q_nope [B, heads, qk_nope_head_dim]`` and ``q_pe [B, heads, qk_rope_head_dim]``
    over the latent ``cache`` (``[blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]``, fp8 read with ``kv_scale``) that ``attn``'s decode block
    tables name, never expanding a cached latent into per-head keys or values.
    ``self`` is the `MLAPagedAttention` layer (``self.qk_nope_head_dim``,
    ``self.v_head_dim``, ``self.scale``); ``impl`` (its per-head kernels) is not
    needed here.
    """
    raise NotImplementedError("write decode_absorbed() in exercises/absorbed_decode.py")

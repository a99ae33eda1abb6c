"""Punica's gather-matmuls: many LoRA adapters applied to one batch at once (Chen et al. 2023).

A LoRA adapter changes a linear layer ``y = x W^T`` into ``y = x W^T + x A^T B^T`` with
``A [r, in]`` and ``B [out, r]``, ``r`` small (Hu et al. 2021, §4.1).  The base matmul
is the same for every request, so a batch of requests with *different* adapters still
shares it; only the small LoRA term differs per token.  Punica computes it for the whole
batch in one kernel, from the adapters stacked into slots (``A [slots, r, in]``,
``B [slots, out, r]``) and each token's slot index (-1: the base model, no term):

- **BGMV** (batched gather matrix-vector): every token gathers its own adapter's ``A``
  and ``B`` and multiplies; one op for any mix, cheapest when each adapter has few
  tokens, as in a decode step;
- **SGMV** (segmented gather matrix-vector): the tokens of one adapter sit in contiguous
  segments (the model runner orders the batch so), and each segment is one matmul with
  its adapter's ``A`` and ``B``; a prompt's hundreds of tokens share one gather.

The engine runs SGMV (`minipaged.models.lora.LoRABatch` says why); BGMV is the per-token
definition, which the lessons and tests check SGMV against.

Both compute the "shrink" ``x A^T`` (to rank ``r``) then the "expand" ``(x A^T) B^T``,
in torch (Punica writes them as CUDA kernels; the arithmetic is the same).
"""

from __future__ import annotations

import torch

__all__ = ["bgmv", "sgmv"]


def bgmv(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """``x [T, in]`` with per-token slots ``indices [T]`` -> the LoRA term ``[T, out]``:
    row ``t`` is ``x[t] A[i]^T B[i]^T`` for ``i = indices[t]``, zero where ``i`` is -1."""
    slot = indices.clamp(min=0)
    shrunk = torch.bmm(lora_a[slot], x[:, :, None])  # [T, r, 1]
    delta = torch.bmm(lora_b[slot], shrunk)[:, :, 0]  # [T, out]
    return delta * (indices >= 0)[:, None].to(delta.dtype)


def sgmv(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: list[tuple[int, int, int]],
) -> torch.Tensor:
    """``x [T, in]`` and ``segments``, ``(slot, start, end)`` runs of tokens of one adapter,
    -> the LoRA term ``[T, out]`` (zero outside every segment: the base model's tokens)."""
    delta = x.new_zeros(x.shape[0], lora_b.shape[1])
    for slot, start, end in segments:
        delta[start:end] = (x[start:end] @ lora_a[slot].T) @ lora_b[slot].T
    return delta

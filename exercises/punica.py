"""Lesson 15: Punica's gather-matmuls, one batch of tokens through many LoRA adapters
(Chen et al. 2023, §4; Hu et al. 2021, §4.1).

Write ``bgmv`` and ``sgmv``, which `minipaged.ops.punica` exports and the LoRA layers
of `minipaged.models.lora` call, then check with ``make check LESSON=15``: the tests
compare both with a per-token loop, and the engine's logits and tokens with PEFT's,
adapters mixed in one batch.

Each computes the LoRA term of every token: the "shrink" ``x A^T`` to rank ``r``, then
the "expand" ``(x A^T) B^T``, with token ``t``'s own adapter (its slot), and zero for a
token of the base model.

Hint: ``bgmv`` gathers per token: ``lora_a[slot]`` is ``[T, r, in]`` for a ``[T]``
tensor of slots, and ``torch.bmm`` multiplies the T matrices with the T vectors in one
call (give ``x`` a last dimension of 1).  Clamp the -1s to a valid slot for the gather,
then zero those rows.  ``sgmv`` is a loop over the segments, two matmuls each.
"""

import torch


def bgmv(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """``x [T, in]``, adapters stacked in slots ``lora_a [slots, r, in]`` and ``lora_b
    [slots, out, r]``, and each token's slot ``indices [T]`` (-1: the base model) -> the
    LoRA term ``[T, out]``: row ``t`` is ``x[t] A[i]^T B[i]^T`` for ``i = indices[t]``,
    zero where ``i`` is -1."""
    raise NotImplementedError("write bgmv() in exercises/punica.py")


def sgmv(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: list[tuple[int, int, int]],
) -> torch.Tensor:
    """``x [T, in]`` and ``segments``, ``(slot, start, end)``: tokens ``start..end - 1``
    all use the adapter in ``slot`` -> the LoRA term ``[T, out]``, in ``x``'s dtype,
    zero for the tokens of no segment (the base model's)."""
    raise NotImplementedError("write sgmv() in exercises/punica.py")

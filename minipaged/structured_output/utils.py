"""Applying a step's grammar bitmask to its logits (vLLM's ``apply_grammar_bitmask``,
``v1/structured_output/utils.py``)."""

from __future__ import annotations

import torch

# Bit b of a 32-bit word is token 32 * word + b (llguidance's, and xgrammar's, layout).
_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every logit of ``logits[rows[i]]`` whose token's bit in
    ``bitmask[i]`` is 0: one unpack and one masked write for the whole step.

    ``bitmask`` is ``[len(rows), ceil(vocab / 32)]`` ``int32``.  (llguidance's own
    ``apply_token_bitmask_inplace`` is the same operation under ``torch.compile``,
    which would cost a CPU run a compile on first use.)
    """
    with torch.inference_mode():  # the logits are the forward pass's inference tensor
        bitmask = bitmask.to(logits.device, non_blocking=True)
        bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(logits.device)) & 1
        allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

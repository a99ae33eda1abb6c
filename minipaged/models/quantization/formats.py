"""Hugging Face's two INT4 checkpoint formats, packed and unpacked.

Both pack eight 4-bit values into an int32, the first value in the lowest bits, and both
store ``scales [G, N]`` (one row per group of input columns) and integer zero points
``qzeros [G, N / 8]`` packed along the output dimension.  They differ in the rest:

- **GPTQ** (AutoGPTQ's ``checkpoint_format: "gptq"``, which transformers and vLLM
  read): ``qweight [K / 8, N]``, packed along the *input* dimension, values in order;
  ``qzeros`` hold the zero point minus one (a quirk of AutoGPTQ's first kernels that
  the format kept: gptqmodel calls the corrected form "v2"); ``g_idx [K]`` gives each
  input column's group, in act-order (``desc_act``) not ``k // group_size``.
- **AWQ** (AutoAWQ's ``version: "gemm"``): ``qweight [K, N / 8]``, packed along the
  *output* dimension in the interleaved order ``AWQ_ORDER`` (slot ``i`` of an int32
  holds column ``AWQ_ORDER[i]`` of its eight, the order AWQ's CUDA kernel dequantizes
  in); zero points stored as they are; no ``g_idx`` (groups are always in order).

`unpack_gptq` and `unpack_awq` turn each into minipaged's `IntWeight`; `pack_gptq` and
`pack_awq` go back, for ``minipaged quantize``.
"""

from __future__ import annotations

import torch

from minipaged.ops.quant_linear import IntWeight

__all__ = ["AWQ_ORDER", "pack_awq", "pack_gptq", "unpack_awq", "unpack_gptq"]

BITS = 4
PACK = 32 // BITS
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack(packed: torch.Tensor, dim: int, order=tuple(range(PACK))) -> torch.Tensor:
    """``packed`` int32 -> its 4-bit values (uint8), ``PACK`` times as long on ``dim``;
    slot ``i`` of each int32 goes to position ``order[i]`` of its eight."""
    shifts = [BITS * order.index(j) for j in range(PACK)]
    shifts = torch.tensor(shifts, dtype=torch.int32, device=packed.device)
    packed = packed.unsqueeze(dim + 1)
    shape = [1] * packed.dim()
    shape[dim + 1] = PACK
    values = (packed >> shifts.view(shape)) & (2**BITS - 1)
    return values.flatten(dim, dim + 1).to(torch.uint8)


def _pack(values: torch.Tensor, dim: int, order=tuple(range(PACK))) -> torch.Tensor:
    """The inverse of `_unpack`: 4-bit ``values`` -> int32, ``PACK`` times shorter on ``dim``."""
    values = values.to(torch.int64).movedim(dim, -1)
    values = values.reshape(*values.shape[:-1], -1, PACK)[..., list(order)]
    shifts = torch.arange(PACK, dtype=torch.int64, device=values.device) * BITS
    packed = (values << shifts).sum(-1)  # the fields do not overlap: sum == or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def unpack_gptq(qweight, qzeros, scales, g_idx) -> IntWeight:
    """GPTQ's tensors (``qweight [K / 8, N]``, ``qzeros [G, N / 8]``, ``scales [G, N]``,
    ``g_idx [K]``) as an `IntWeight` ``[N, K]``."""
    return IntWeight(
        q=_unpack(qweight, 0).T.contiguous(),
        scales=scales.T.contiguous(),
        zeros=(_unpack(qzeros, 1).to(torch.int16) + 1).T.contiguous(),
        g_idx=g_idx.to(torch.int64),
        bits=BITS,
    )


def unpack_awq(qweight, qzeros, scales, group_size: int) -> IntWeight:
    """AWQ's tensors (``qweight [K, N / 8]``, ``qzeros [G, N / 8]``, ``scales [G, N]``)
    as an `IntWeight` ``[N, K]``."""
    k = qweight.shape[0]
    return IntWeight(
        q=_unpack(qweight, 1, AWQ_ORDER).T.contiguous(),
        scales=scales.T.contiguous(),
        zeros=_unpack(qzeros, 1, AWQ_ORDER).to(torch.int16).T.contiguous(),
        g_idx=torch.arange(k, device=qweight.device) // group_size,
        bits=BITS,
    )


def check_gptq_zeros(weight: IntWeight, name: str) -> None:
    """Refuse a ``weight`` (the projection ``name``) with a zero point of 0: GPTQ's format
    stores zero points minus one, so 0 has no form (it would wrap to 15; gptqmodel's
    "v2" format, which stores them as they are, has one)."""
    groups = (weight.zeros < 1).nonzero()
    if len(groups):
        raise ValueError(
            f"{name}: {len(groups)} group(s) have a zero point of 0 (the first: output "
            f"{groups[0, 0].item()}, group {groups[0, 1].item()}), which GPTQ's format "
            "cannot store (it stores zero points minus one)"
        )


def pack_gptq(weight: IntWeight, dtype=torch.float16, name="weight") -> dict[str, torch.Tensor]:
    """``weight`` as GPTQ's ``qweight``, ``qzeros``, ``scales`` (in ``dtype``), ``g_idx``;
    refused if it has a zero point of 0 (`check_gptq_zeros`)."""
    check_gptq_zeros(weight, name)
    return {
        "qweight": _pack(weight.q.T, 0),
        "qzeros": _pack(weight.zeros.T.to(torch.int64) - 1, 1),
        "scales": weight.scales.T.to(dtype).contiguous(),
        "g_idx": weight.g_idx.to(torch.int32),
    }


def pack_awq(weight: IntWeight, dtype=torch.float16) -> dict[str, torch.Tensor]:
    """``weight`` as AWQ's ``qweight``, ``qzeros``, ``scales`` (in ``dtype``)."""
    return {
        "qweight": _pack(weight.q.T, 1, AWQ_ORDER),
        "qzeros": _pack(weight.zeros.T, 1, AWQ_ORDER),
        "scales": weight.scales.T.to(dtype).contiguous(),
    }

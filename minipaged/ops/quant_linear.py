"""Weight-only quantized matmuls: ``y = x @ dequantize(W).T + b``, the activations and
the result in the model's dtype, the weight in 8 or 4 bits.

Every integer scheme minipaged loads is one form (`IntWeight`), as in GPTQ's paper
(Frantar et al. 2022, §3) and AWQ's (Lin et al. 2023, §2): an integer ``q[n, k]`` per
weight, and per output row ``n`` and *group* of input columns a scale and an integer
zero point, ``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]`` with ``g = g_idx[k]``.
A group is ``group_size`` consecutive input columns, unless GPTQ's act-order
(``desc_act``) quantized the columns in another order: then ``g_idx`` says each
column's group.  INT8 per-channel is the case of one group and no zero point.

Three kernels compute the same product:

- `reference`: dequantize to a dense weight, then ``F.linear``: the oracle;
- `CpuInt8Linear`, `CpuInt4Linear`: torch's packed weight-only CPU ops
  (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, which vLLM's CPU backend
  and torchao use), the weight repacked once at load;
- the Triton GEMM of `minipaged.ops.triton_quant`, which dequantizes a tile at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["CPU_INT4_GROUP_SIZES", "CpuInt4Linear", "CpuInt8Linear", "IntWeight", "reference"]

# The group sizes ``_weight_int4pack_mm_for_cpu`` takes.
CPU_INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class IntWeight:
    """An integer-quantized ``[N, K]`` weight (module docstring).

    ``q``: ``[N, K]``, int8 (signed, ``zeros`` None) or uint8 (``0 .. 2**bits - 1``);
    ``scales``: ``[N, G]`` float; ``zeros``: ``[N, G]`` integer zero points, or None
    for a symmetric scheme; ``g_idx``: ``[K]`` int64, each input column's group.
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` weight, computed in float32, returned in ``dtype``."""
        scales = self.scales.float()[:, self.g_idx]
        q = self.q.float()
        if self.zeros is not None:
            q = q - self.zeros.float()[:, self.g_idx]
        return (q * scales).to(dtype)

    def contiguous_groups(self) -> tuple[torch.Tensor | None, int] | None:
        """``(perm, group_size)`` such that the columns ``perm`` (None: in order) fall in
        groups of ``group_size`` consecutive columns, ``g_idx`` ascending; None if
        no such order exists (groups of different sizes, other than a shorter last)."""
        order = torch.argsort(self.g_idx, stable=True)
        in_order = torch.equal(order, torch.arange(len(order), device=order.device))
        perm = None if in_order else order
        counts = torch.bincount(self.g_idx)
        size = int(counts[0])
        if bool((counts[:-1] != size).any()) or int(counts[-1]) > size:
            return None
        return perm, size


def reference(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None):
    """``F.linear`` on the dequantized weight: the oracle every kernel is tested against."""
    return F.linear(x, weight.dequantize(x.dtype), bias)


class CpuInt8Linear:
    """Symmetric per-channel INT8 through ``torch.ops.aten._weight_int8pack_mm``: the
    int8 weight ``[N, K]`` as it is and one scale per row, in the activations' dtype."""

    def __init__(self, weight: IntWeight, dtype: torch.dtype) -> None:
        if weight.zeros is not None or weight.scales.shape[1] != 1 or weight.bits != 8:
            raise ValueError("CpuInt8Linear takes symmetric per-channel 8-bit weights")
        self.q = weight.q.to(torch.int8).contiguous()
        self.scales = weight.scales[:, 0].to(dtype).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.q, self.scales)
        out = out.reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes


class CpuInt4Linear:
    """Group-wise INT4 through ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

    That op computes ``W = (q - 8) * scale + zero`` with a float ``zero`` per group,
    so an integer zero point ``z`` becomes ``zero = (8 - z) * scale``.  Its groups are
    consecutive columns: act-order weights are stored with their columns sorted by group
    (``perm``) and each call permutes the activations' columns the same way (what
    exllama and Marlin do).  A group size the op lacks is split: a group of 128 is two
    of 64 with the same scale, which also covers a shorter last group (576 = 4 x 128
    + 64 takes groups of 64).  `supports` says whether a weight fits at all.
    """

    def __init__(self, weight: IntWeight, dtype: torch.dtype) -> None:
        layout = self.layout(weight)
        if layout is None:
            raise ValueError("CpuInt4Linear cannot take this weight (see supports)")
        self.perm, self.group_size = layout
        q, g_idx = weight.q, weight.g_idx
        if self.perm is not None:
            q, g_idx = q[:, self.perm], g_idx[self.perm]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1
        )
        # One (scale, zero) per group of the op's size, from the group its first column is in.
        first = g_idx[:: self.group_size]
        scales = weight.scales.float()[:, first]
        zeros = weight.zeros.float()[:, first] if weight.zeros is not None else 8.0
        self.scales_and_zeros = (
            torch.stack([scales, (8 - zeros) * scales], dim=-1).transpose(0, 1).to(dtype)
        ).contiguous()
        self.out_features = weight.shape[0]

    @staticmethod
    def layout(weight: IntWeight) -> tuple[torch.Tensor | None, int] | None:
        """``(perm, group_size)`` of the op's form, or None if it cannot hold ``weight``."""
        n, k = weight.shape
        groups = weight.contiguous_groups()
        if weight.bits != 4 or n % 16 or groups is None:
            return None
        perm, size = groups
        size = math.gcd(size, k)
        return (perm, size) if size in CPU_INT4_GROUP_SIZES else None

    @classmethod
    def supports(cls, weight: IntWeight) -> bool:
        return cls.layout(weight) is not None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            x2 = x2[:, self.perm]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.contiguous(), self.packed, self.group_size, self.scales_and_zeros
        )
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if bias is None else out + bias

    def nbytes(self) -> int:
        perm = 0 if self.perm is None else self.perm.nbytes
        return self.packed.nbytes + self.scales_and_zeros.nbytes + perm

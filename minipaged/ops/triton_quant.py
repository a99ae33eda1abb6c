"""A dequantize-and-multiply GEMM in Triton for INT4 and INT8 weights (`IntWeight`).

The model of vLLM's ``awq_triton.py``: each program computes a ``BLOCK_M x BLOCK_N``
tile of ``y = x @ W.T``; it walks ``K`` a ``BLOCK_K`` slice at a time, loads the
packed integers of that ``BLOCK_K x BLOCK_N`` tile of ``W.T``, unpacks them with
shifts and masks, subtracts each column's zero point and multiplies by its scale (both
gathered through ``g_idx``, so act-order weights need no reordering), and feeds the
dense tile to ``tl.dot``.  Only the packed weight crosses memory: the dense tile lives
in registers, which is where weight-only quantization's speed comes from at small batch.

The weight is packed as GPTQ packs it, ``32 / bits`` values per int32 along ``K``
(``qweight [ceil(K / pack), N]``), unsigned: a signed int8 weight is stored as
``q + 128`` with zero point 128.  `pack` makes this form from an `IntWeight`.
On a CPU it runs in Triton's interpreter (``TRITON_INTERPRET=1``, set before this
module is imported), which is how ``tests/test_quant_linear.py`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minipaged.ops.quant_linear import IntWeight

__all__ = ["TritonQuantLinear", "TritonQuantWeight", "pack", "quant_matmul"]


@triton.jit
def quant_matmul_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    out_ptr,
    M,
    N,
    K,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * K + offs_k[None, :],
            mask=(offs_m[:, None] < M) & in_k[None, :],
            other=0.0,
        )
        w_mask = in_k[:, None] & (offs_n[None, :] < N)
        packed = tl.load(
            qweight_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :], mask=w_mask, other=0
        )
        q = (packed >> ((offs_k % PACK) * BITS)[:, None]) & MASK
        group = tl.load(g_idx_ptr + offs_k, mask=in_k, other=0)
        gn = group[:, None] * N + offs_n[None, :]
        scale = tl.load(scales_ptr + gn, mask=w_mask, other=0.0)
        zero = tl.load(zeros_ptr + gn, mask=w_mask, other=0)
        w = ((q - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + offs_m[:, None] * N + offs_n[None, :],
        out,
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


@dataclass
class TritonQuantWeight:
    """The kernel's form of a weight: ``qweight [ceil(K / pack), N]`` int32, ``scales
    [G, N]``, ``zeros [G, N]`` int32 (unsigned), ``g_idx [K]`` int32."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    in_features: int


def pack(weight: IntWeight, dtype: torch.dtype) -> TritonQuantWeight:
    """``weight`` packed for `quant_matmul`, its scales in ``dtype``."""
    n, k = weight.shape
    per_int = 32 // weight.bits
    offset = 1 << (weight.bits - 1) if weight.q.dtype == torch.int8 else 0
    q = (weight.q.to(torch.int64) + offset).T  # [K, N], unsigned
    q = torch.cat([q, q.new_zeros(-k % per_int, n)]).view(-1, per_int, n)
    shifts = torch.arange(per_int, dtype=torch.int64, device=q.device)[None, :, None] * weight.bits
    packed = (q << shifts).sum(dim=1)  # the bit fields do not overlap: sum == or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    zeros = weight.zeros if weight.zeros is not None else torch.zeros_like(weight.scales)
    return TritonQuantWeight(
        qweight=packed.contiguous(),
        scales=weight.scales.T.to(dtype).contiguous(),
        zeros=(zeros.to(torch.int32) + offset).T.contiguous(),
        g_idx=weight.g_idx.to(torch.int32).contiguous(),
        bits=weight.bits,
        in_features=k,
    )


def quant_matmul(
    x: torch.Tensor,
    weight: TritonQuantWeight,
    bias: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """``x [..., K] @ dequantize(weight).T (+ bias)``, in ``x``'s dtype."""
    x2 = x.reshape(-1, weight.in_features).contiguous()
    m, n = x2.shape[0], weight.qweight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    quant_matmul_kernel[grid](
        x2,
        weight.qweight,
        weight.scales,
        weight.zeros,
        weight.g_idx,
        out,
        m,
        n,
        weight.in_features,
        BITS=weight.bits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # A float32 model is the engine's exact mode: on a GPU tl.dot would round its
        # float32 inputs to TF32 (10 mantissa bits) unless told otherwise.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    out = out.reshape(*x.shape[:-1], n)
    return out if bias is None else out + bias


class TritonQuantLinear:
    """A layer's kernel: ``weight`` packed once, `quant_matmul` per call."""

    def __init__(self, weight: IntWeight, dtype: torch.dtype) -> None:
        self.weight = pack(weight, dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return quant_matmul(x, self.weight, bias)

    def nbytes(self) -> int:
        w = self.weight
        return sum(t.nbytes for t in (w.qweight, w.scales, w.zeros, w.g_idx))

"""The small ops around a decoder layer's projections and attention, fused in Triton for
the GPU: the same four ops, with the same signatures and in-place semantics, as the C++
ones of ``kernels/cpu/fused_ops.cpp`` (`cpu_ops`), vLLM's custom ops of the same names
(``csrc/layernorm_kernels.cu``, ``activation_kernels.cu``, ``pos_encoding_kernels.cu``).

Written as torch ops, RMSNorm is eight kernels (two casts, a square, a mean, an add, a
reciprocal square root, two products), the rotary embedding five per tensor and
SwiGLU's activation two: with the residual adds, about 30 a layer, of the 39 a layer
that an H200 ran in a decode step of Qwen2.5-0.5B (941 for 24 layers and the sampler,
`minipaged bench throughput --profile-steps`); each is a pass over its tensor and, in
the steps that run eagerly, a launch from Python.  Here each op is one kernel, reading its
inputs once and rounding once at the end, where HF rounds after each op (the
tolerances of ``tests/test_fused_ops.py`` say what that changes):

- `rms_norm`: one program per row, the row's sum of squares in float32;
- `fused_add_rms_norm`: the residual add rounded to the dtype (as HF adds), written
  back into ``residual``, then normed into ``x``;
- `silu_and_mul`: ``silu(gate) * up``, the activation rounded to the dtype first (as
  HF's two ops do);
- `rotary_embedding`: one program per token rotates all its query and key heads in
  place (HF's layout: dimension ``i`` paired with ``i + head_dim / 2``).

Rows may be strided (a query sliced out of the packed q/k/v output); the last
dimension must be contiguous (`fused` checks before it calls these).  On a CPU they
run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the CPU tests check
them; bf16 is wrong there, so those tests take float32 and float16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul", "supports"]

# Columns per program of `silu_and_mul`: rows as wide as an MLP's (thousands) are cut
# into tiles so that a decode step of a few rows still spreads over many programs.
ACT_BLOCK = 1024


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x`` as it is: 2 or 3 dimensions, the last contiguous."""
    return x.dim() in (2, 3) and x.stride(-1) == 1


def _rows(x: torch.Tensor) -> tuple[int, int, int]:
    """``(inner, outer_stride, inner_stride)``: row ``r`` of ``x`` (its last dimension)
    starts at ``(r // inner) * outer_stride + (r % inner) * inner_stride``."""
    if x.dim() == 2:
        return 1, x.stride(0), 0
    return x.shape[1], x.stride(0), x.stride(1)


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    inner,
    x_outer,
    x_inner,
    res_outer,
    res_inner,
    out_outer,
    out_inner,
    D,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    outer, within = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + outer * x_outer + within * x_inner + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        at = residual_ptr + outer * res_outer + within * res_inner + cols
        r = tl.load(at, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(at, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    # HF casts the normed row back to the dtype before the weight multiplies.
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + outer * out_outer + within * out_inner + cols, y, mask=mask)


def _norm(x, residual, weight, eps, out) -> None:
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    if rows == 0:
        return
    inner, x_outer, x_inner = _rows(x)
    _, res_outer, res_inner = _rows(residual) if residual is not None else (1, 0, 0)
    _, out_outer, out_inner = _rows(out)
    block = triton.next_power_of_2(d)
    rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        inner,
        x_outer,
        x_inner,
        res_outer,
        res_inner,
        out_outer,
        out_inner,
        d,
        eps,
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm`` of ``x``'s rows, into a new tensor."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, None, weight, eps, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as vLLM's: ``residual += x`` (in the dtype), ``x = rms_norm(residual)``;
    returns ``(x, residual)``."""
    _norm(x, residual, weight, eps, x)
    return x, residual


@triton.jit
def silu_and_mul_kernel(gate_up_ptr, out_ptr, in_stride, out_stride, D, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + D + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2 * d]``, a new ``[..., d]`` tensor."""
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    rows, d = flat.shape[0], flat.shape[1] // 2
    out = torch.empty(rows, d, dtype=gate_up.dtype, device=gate_up.device)
    if rows and d:
        block = min(ACT_BLOCK, triton.next_power_of_2(d))
        grid = (rows, triton.cdiv(d, block))
        silu_and_mul_kernel[grid](
            flat, out, flat.stride(0), out.stride(0), d, BLOCK=block, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _rotate(
    x_ptr, token, token_stride, head_stride, heads, cos, sin, half_cols, HALF: tl.constexpr
):
    """Rotate the ``heads`` heads of one token of ``x`` in place (one [heads, HALF] tile
    of each half), by ``cos`` and ``sin`` [1, HALF]."""
    BLOCK_H: tl.constexpr = 16
    d = tl.arange(0, HALF)[None, :]
    for h0 in range(0, heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < heads) & (d < half_cols)
        first_at = x_ptr + token * token_stride + h * head_stride + d
        first = tl.load(first_at, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(first_at + half_cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(first_at, (first * cos - second * sin).to(x_ptr.dtype.element_ty), mask=mask)
        out_second = (second * cos + first * sin).to(x_ptr.dtype.element_ty)
        tl.store(first_at + half_cols, out_second, mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    table_stride,
    num_heads,
    num_kv_heads,
    half_cols,
    HALF: tl.constexpr,
):
    token = tl.program_id(0)
    d = tl.arange(0, HALF)[None, :]
    in_half = d < half_cols
    cos = tl.load(cos_ptr + token * table_stride + d, mask=in_half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * table_stride + d, mask=in_half, other=0.0).to(tl.float32)
    _rotate(q_ptr, token, q_token_stride, q_head_stride, num_heads, cos, sin, half_cols, HALF)
    _rotate(k_ptr, token, k_token_stride, k_head_stride, num_kv_heads, cos, sin, half_cols, HALF)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, heads, head_dim]`` and ``key [T, kv_heads, head_dim]`` in
    place by ``cos, sin [T, head_dim / 2]`` (the tables' first halves, as the C++ op
    takes them); returns them."""
    tokens, half = query.shape[0], query.shape[-1] // 2
    if tokens:
        rotary_kernel[(tokens,)](
            query,
            key,
            cos,
            sin,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos.stride(0),
            query.shape[1],
            key.shape[1],
            half,
            HALF=triton.next_power_of_2(half),
            num_warps=4,
        )
    return query, key

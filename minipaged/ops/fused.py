"""The small ops around a decoder layer's projections and attention, fused on the CPU
and on the GPU.

A decode step's projections and attention run in oneDNN and C++; what is left of a
layer is RMSNorm, the residual adds, SwiGLU's activation and the rotary embedding, a
dozen torch ops of a few rows each, whose cost at decode is launching them and writing
their temporaries.  vLLM's CPU backend fuses them into four C++ ops (csrc/cpu), and so
does ``kernels/cpu/fused_ops.cpp`` (`cpu_ops`):

- `rms_norm`: HF's ``LlamaRMSNorm``, one pass;
- `fused_add_rms_norm`: the residual add and the next norm in one pass, in place (vLLM's
  name and semantics: the layers carry the residual stream beside the hidden states);
- `silu_and_mul`: SwiGLU's ``silu(gate) * up`` from the packed gate/up projection;
- `rotary_embedding`: the query's and key's rotation, in place.

On a GPU the same four ops are Triton kernels (`triton_fused`): written as torch ops
they are about 30 kernels a layer (of the 39 a layer an H200 ran), each a launch from
Python in the steps that run eagerly.

Each function here is the torch reference, the readable definition that runs in other
dtypes and wherever the kernels cannot, and this one place picks the kernels instead
(`kernels_for`: the C++ ops for CPU tensors, Triton's for CUDA ones).  `reference_ops`
forces the torch path, to compare them in one process (``tests/test_fused_ops.py``,
``minipaged bench cpu_step``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from minipaged.ops import cpu_ops

__all__ = [
    "fused_add_rms_norm",
    "get_act_fn",
    "reference_ops",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "kernels_for",
    "uses_cpu_kernels",
]

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_force_reference = False


def uses_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether the ops run ``x`` through the C++ extension: a CPU tensor of a dtype it
    handles, the extension built here (on the first call), and no `reference_ops`."""
    return (
        x.device.type == "cpu"
        and x.dtype in KERNEL_DTYPES
        and not _force_reference
        and cpu_ops.available()
    )


def kernels_for(x: torch.Tensor):
    """The module whose kernels take ``x`` (`cpu_ops` on a CPU, `triton_fused` on CUDA,
    each with the same four ops), or None: the torch reference runs."""
    if uses_cpu_kernels(x):
        return cpu_ops
    if x.device.type == "cuda" and x.dtype in KERNEL_DTYPES and not _force_reference:
        from minipaged.ops import triton_fused  # noqa: PLC0415  (Triton only on a GPU)

        return triton_fused if triton_fused.supports(x) else None
    return None


@contextlib.contextmanager
def reference_ops():
    """Run the torch references, not the C++ ops, inside the ``with`` block."""
    global _force_reference
    previous, _force_reference = _force_reference, True
    try:
        yield
    finally:
        _force_reference = previous


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (Zhang & Sennrich
    2019), as HF's ``LlamaRMSNorm``: normalised in float32, cast back to ``x``'s dtype
    before the weight multiplies."""
    if weight.dtype == x.dtype and (kernels := kernels_for(x)) is not None:
        return kernels.rms_norm(x, weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (in ``x``'s dtype, as HF's layers add), then
    ``(rms_norm(residual), residual)``.  The C++ op writes both into ``x`` and
    ``residual`` (vLLM's in-place semantics): use the returned tensors, not those."""
    kernels = kernels_for(x)
    if weight.dtype == x.dtype == residual.dtype and kernels and _same_rows(x, residual):
        return kernels.fused_add_rms_norm(x, residual, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def _same_rows(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the in-place add can walk both tensors' rows together."""
    return x.shape == residual.shape and residual.stride(-1) == 1


# config.json's `hidden_act` names the families here use, each the function transformers'
# ``ACT2FN`` maps it to (tests/test_fused_ops.py compares them).  Not ACT2FN itself:
# importing it loads transformers' kernel hub, a second or more of every process's start.
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def get_act_fn(name: str):
    """The activation config.json's ``hidden_act`` names (vLLM's ``get_act_fn``)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` (Shazeer 2020) from ``gate_up [..., 2 * d]``, the gate
    projection's outputs then the up projection's (the packed ``gate_up_proj``)."""
    if (kernels := kernels_for(gate_up)) is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query [T, heads, head_dim]`` and ``key [T, kv_heads, head_dim]`` rotated by
    ``cos, sin [T, head_dim]`` (RoFormer, Su et al. 2021; HF's layout pairs dimension
    ``i`` with ``i + head_dim / 2``, not adjacent pairs as in the paper).  The C++ op
    rotates them in place (vLLM's): use the returned tensors."""
    kernels = kernels_for(query)
    if query.dtype == key.dtype == cos.dtype and kernels and kernels_for(key) is kernels:
        half = query.shape[-1] // 2  # HF's cos and sin repeat their first half
        return kernels.rotary_embedding(query, key, cos[:, :half], sin[:, :half])
    return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos, sin [T, head_dim]`` (HF's
    ``apply_rotary_pos_emb`` for one tensor)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-second, first), dim=-1) * sin[:, None]

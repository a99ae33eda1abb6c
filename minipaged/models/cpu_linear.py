"""The projections on a CPU at oneDNN's rate: every weight packed once, at load.

A decode step multiplies each weight matrix by a skinny batch (one row per running
sequence), so how fast the matmul streams the weight through the cores is most of the
step.  ``F.linear`` hands the BLAS the weight in the checkpoint's layout on every call;
oneDNN (the library under torch's CPU matmuls) instead reorders a weight into the blocked
layout its kernels read, which it can do once, ahead of time: vLLM's CPU backend does so
at load (``dispatch_cpu_unquantized_gemm``), as inductor does when it freezes a model.
`pack_linear_weights` keeps such a packed copy beside each projection's weight, and the
layers' forward (`minipaged.distributed.layers.linear`) multiplies through it.  What it
buys, in float32 and bfloat16 and at each batch size, is measured by
``minipaged bench cpu-step`` (`docs/performance.md`).

The packed copy is oneDNN's opaque tensor, so the plain weight stays, for the loader,
LoRA, tensor parallelism and anyone reading the model (the projections' memory twice).
Its sums run in oneDNN's order, not the BLAS's: the logits move by float32 rounding,
and each row's result does not depend on the other rows of the batch or on the thread
count (`tests/test_cpu_linear.py`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from minipaged.distributed.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

__all__ = ["PACKED_DTYPES", "can_pack", "cpu_flags", "native_bf16", "pack_linear_weights"]

# The batch size oneDNN is told to expect when it picks the layout: any other runs on
# the same packed weight, and from 1 to 512 rows the hint made no difference beyond
# the noise of our measurements.
BATCH_HINT = 32
PACKED_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (``/proc/cpuinfo``); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512-BF16's dot products or
    AMX's tiles), where bfloat16 matmuls run at about twice float32's rate; without
    them oneDNN emulates bfloat16 with float32 instructions.  Asked at run time: the
    machine that runs the engine is not always the one that built it."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack ``weight`` here: on a CPU with oneDNN, in float32, or in
    bfloat16 where oneDNN runs it (AVX-512 or better; natively with `native_bf16`)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


@torch.no_grad()
def pack_linear_weights(model: nn.Module) -> int:
    """Give each projection of ``model`` (q/k/v, o, gate/up, down, the LM head) a packed
    copy of its weight that its forward then uses; returns how many it packed.  Call it
    after the weights are loaded: a packed copy does not follow later writes."""
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)  # None: quantized (`quantization`)
        if isinstance(module, PACKED_LAYERS) and weight is not None and can_pack(weight):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), BATCH_HINT
            )
            packed += 1
    return packed

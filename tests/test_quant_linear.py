"""The quantized matmuls of `minipaged.ops.quant_linear` and `minipaged.ops.triton_quant`
against the plain-torch reference (dequantize, then ``F.linear``), which is checked
against a loop over the definition first: ragged shapes, group sizes 32, 64 and 128,
groups in order and act-order's ``g_idx``, symmetric INT8 per channel."""

import dataclasses

import pytest
import torch

from minipaged.ops.quant_linear import CpuInt4Linear, CpuInt8Linear, IntWeight, reference

# (N, K, group_size): K not a multiple of the group (a short last group) among them, as
# SmolLM2's 576 columns in groups of 128.  The CPU op needs N % 16 and K % 32.
SHAPES = [(48, 96, 32), (80, 224, 64), (96, 320, 128), (32, 576, 128), (16, 128, 64)]
# The Triton kernel takes any N and K.
TRITON_SHAPES = [(48, 96, 32), (40, 200, 64), (24, 136, 128)]


def int4_weight(n, k, group_size, act_order, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    g_idx = torch.arange(k) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return IntWeight(
        q=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        scales=torch.rand(n, groups, generator=g) * 0.02 + 0.005,
        zeros=torch.randint(0, 16, (n, groups), generator=g, dtype=torch.int16),
        g_idx=g_idx,
        bits=4,
    )


def int8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return IntWeight(
        q=torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
        scales=torch.rand(n, 1, generator=g) * 0.01 + 1e-3,
        zeros=None,
        g_idx=torch.zeros(k, dtype=torch.int64),
        bits=8,
    )


def activations(m, k, dtype=torch.float32, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_reference_is_the_definition():
    w = int4_weight(8, 40, 16, act_order=True)
    dense = torch.empty(8, 40)
    for n in range(8):
        for k in range(40):
            g = int(w.g_idx[k])
            dense[n, k] = (int(w.q[n, k]) - int(w.zeros[n, g])) * float(w.scales[n, g])
    x = activations(3, 40)
    torch.testing.assert_close(reference(x, w), x @ dense.T)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "g_idx"])
@pytest.mark.parametrize("n,k,group_size", SHAPES)
@pytest.mark.parametrize("m", [1, 7])
def test_cpu_int4_equals_reference(m, n, k, group_size, act_order):
    w = int4_weight(n, k, group_size, act_order)
    assert CpuInt4Linear.supports(w)
    x = activations(m, k)
    torch.testing.assert_close(CpuInt4Linear(w, torch.float32)(x), reference(x, w))


def test_cpu_int4_in_bfloat16_and_with_a_bias():
    w = int4_weight(64, 192, 64, act_order=True)
    x, bias = activations(5, 192, torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    out = CpuInt4Linear(w, torch.bfloat16)(x, bias)
    torch.testing.assert_close(out.float(), reference(x, w, bias).float(), atol=0.05, rtol=0.02)


def test_cpu_int4_refuses_what_the_op_cannot_hold():
    assert not CpuInt4Linear.supports(int4_weight(24, 96, 32, False))  # N % 16
    assert not CpuInt4Linear.supports(int4_weight(32, 80, 16, False))  # group of 16
    uneven = int4_weight(32, 96, 32, False)
    uneven.g_idx = torch.cat([torch.zeros(40), torch.ones(56)]).long()[:96].clamp(max=2)
    assert not CpuInt4Linear.supports(uneven)
    with pytest.raises(ValueError, match="cannot take"):
        CpuInt4Linear(uneven, torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (9, 96, 200)])
def test_cpu_int8_equals_reference(m, n, k):
    w, x = int8_weight(n, k), activations(m, k)
    torch.testing.assert_close(CpuInt8Linear(w, torch.float32)(x), reference(x, w))


def _triton():
    from minipaged.ops import triton_quant  # after conftest set TRITON_INTERPRET

    return triton_quant


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "g_idx"])
@pytest.mark.parametrize("n,k,group_size", TRITON_SHAPES)
def test_triton_int4_equals_reference(n, k, group_size, act_order):
    w, x = int4_weight(n, k, group_size, act_order), activations(5, k)
    ops = _triton()
    torch.testing.assert_close(ops.quant_matmul(x, ops.pack(w, torch.float32)), reference(x, w))


def test_triton_int8_equals_reference():
    w, x = int8_weight(40, 72), activations(3, 72)
    ops = _triton()
    torch.testing.assert_close(ops.quant_matmul(x, ops.pack(w, torch.float32)), reference(x, w))


def test_triton_in_float16():
    w, x = int4_weight(48, 96, 32, act_order=True), activations(17, 96, torch.float16)
    ops = _triton()
    out = ops.TritonQuantLinear(w, torch.float16)(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference(x.float(), w), atol=2e-2, rtol=1e-2)


# Qwen2.5-0.5B's projections (hidden 896, MLP 4864) as [N, K]: the GPU's real sizes.
GPU_SHAPES = [(4864, 896), (896, 4864)]
# bits, group size, act-order; group None: INT8, one scale per output channel.
GPU_SCHEMES = [(4, 32, False), (4, 64, True), (4, 128, False), (8, None, False)]
# One unit in the last place of each dtype at 1.0: the output's own rounding.
ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _on(weight: IntWeight, device: str) -> IntWeight:
    return IntWeight(
        q=weight.q.to(device),
        scales=weight.scales.to(device),
        zeros=None if weight.zeros is None else weight.zeros.to(device),
        g_idx=weight.g_idx.to(device),
        bits=weight.bits,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(ULP), ids=str)
@pytest.mark.parametrize("bits,group_size,act_order", GPU_SCHEMES)
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 100])
def test_triton_on_the_gpu_equals_reference(m, n, k, bits, group_size, act_order, dtype):
    """Compiled for the GPU (not interpreted), at real sizes, in every dtype: the kernel
    against a float32 product with the weight dequantized as the kernel's tile is (its
    scales stored in ``dtype``, the tile rounded to ``dtype``).  What may differ is the
    order of the float32 sums and the output's rounding to ``dtype``: a few units in its
    last place, and near zero a bound on float32's error on the terms' magnitudes."""
    w = int4_weight(n, k, group_size, act_order) if bits == 4 else int8_weight(n, k)
    w, x = _on(w, "cuda"), activations(m, k).to(dtype).cuda()
    out = _triton().TritonQuantLinear(w, dtype)(x)
    rounded = dataclasses.replace(w, scales=w.scales.to(dtype).float())  # stored in dtype
    dense = rounded.dequantize(dtype).float()
    expected = x.float() @ dense.T
    magnitude = x.float().abs() @ dense.abs().T
    error = (out.float() - expected).abs()
    assert out.dtype == dtype
    assert (error <= 4 * ULP[dtype] * expected.abs() + 1e-4 * magnitude).all(), error.max()

"""The fused ops against Hugging Face's own modules (``LlamaRMSNorm``,
``apply_rotary_pos_emb``, ``ACT2FN["silu"]``): the C++ ones (``kernels/cpu/fused_ops.cpp``)
built for each instruction set this machine runs (`attention_cases.CPU_ISAS`) and the
Triton ones (`minipaged.ops.triton_fused`, in Triton's interpreter here, which gets
bfloat16 wrong: float32 and float16 only), in float32, float16 and bfloat16, at a
decode step's shapes and at odd ones (a vector's tail); the ``gpu`` tests run the
Triton ones compiled, at a real model's sizes.

Tolerances (`minipaged.ops.testing`): both sides round the same float32 math to the
dtype, HF after each op and the kernels once at the end (or where HF's order makes it
matter: the norm before its weight), so a 16-bit output is within a unit or two in the
last place; float32 differs by summation order and exp's last bits only.
"""

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from attention_cases import CPU_ISAS
from minipaged.ops import cpu_ops, fused
from minipaged.ops.testing import assert_close

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-5
# (rows, hidden): decode's one row, a vector's tail (67), SmolLM2's intermediate size.
NORM_SHAPES = ((1, 576), (7, 67), (33, 1536), (0, 64))


@pytest.fixture(params=[*CPU_ISAS, "triton"], scope="module")
def ops(request):
    """The fused ops of the build for one instruction set, or Triton's."""
    if request.param == "triton":
        from minipaged.ops import triton_fused  # after conftest set TRITON_INTERPRET

        return triton_fused
    return cpu_ops.build(request.param)


@pytest.fixture(autouse=True)
def _interpreter_dtypes(request):
    """Triton's interpreter computes bfloat16 wrongly: those cases are not its."""
    params = getattr(request.node, "callspec", None)
    params = params.params if params else {}
    if params.get("ops") == "triton" and params.get("dtype") == torch.bfloat16:
        pytest.skip("Triton's interpreter gets bfloat16 wrong")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=EPS).to(x.device, x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_equals_hf(ops, dtype, shape):
    x = randn(*shape, dtype=dtype, seed=0, scale=3.0)
    weight = randn(shape[-1], dtype=dtype, seed=1) + 1
    assert_close(ops.rms_norm(x, weight, EPS), hf_rms_norm(x, weight))


def test_rms_norm_of_strided_heads_equals_hf(ops):
    """Qwen3's q_norm: each head of a query sliced out of the packed q/k/v output."""
    qkv = randn(5, 3 * 4 * 64, dtype=torch.bfloat16, seed=2)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    weight = randn(64, dtype=torch.bfloat16, seed=3) + 1
    assert_close(ops.rms_norm(q, weight, EPS), hf_rms_norm(q, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_fused_add_rms_norm_is_hfs_residual_add_then_norm(ops, dtype, shape):
    """In place, as vLLM's: ``residual`` becomes HF's ``residual + x`` (added in the
    dtype, exactly), ``x`` the next layer norm of it."""
    x = randn(*shape, dtype=dtype, seed=4, scale=2.0)
    residual = randn(*shape, dtype=dtype, seed=5, scale=4.0)
    weight = randn(shape[-1], dtype=dtype, seed=6) + 1
    expected_residual = residual + x
    expected = hf_rms_norm(expected_residual, weight)
    ops.fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(residual, expected_residual)
    assert_close(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ((1, 1536), (9, 67), (40, 8)))
def test_silu_and_mul_equals_hf(ops, dtype, shape):
    """Gates from -100 to 100: where e^-x overflows and where it vanishes, and zero."""
    rows, d = shape
    gate = randn(rows, d, dtype=dtype, seed=7, scale=4.0)
    gate[0, :3] = torch.tensor([-100.0, 100.0, 0.0], dtype=dtype)
    up = randn(rows, d, dtype=dtype, seed=8, scale=2.0)
    expected = ACT2FN["silu"](gate) * up
    assert_close(ops.silu_and_mul(torch.cat((gate, up), dim=-1)), expected)


def cos_sin(tokens: int, head_dim: int, dtype: torch.dtype):
    """HF's default RoPE tables at scattered positions, in ``dtype``."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = (torch.arange(tokens) * 37.0)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ((1, 9, 3, 64), (5, 4, 2, 18), (40, 8, 8, 128)))
def test_rotary_embedding_rotates_q_and_k_in_place_as_hf(ops, dtype, shape):
    """Query and key as the model has them, views into the packed q/k/v output; the
    values beside them are left alone."""
    tokens, heads, kv_heads, head_dim = shape
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v_before = v.clone()
    cos, sin = cos_sin(tokens, head_dim, dtype)
    # HF's layout: [heads, T, head_dim], the tables broadcast over the heads.
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, 0)
    half = head_dim // 2
    ops.rotary_embedding(q, k, cos[:, :half], sin[:, :half])
    assert_close(q, hf_q.transpose(0, 1))
    assert_close(k, hf_k.transpose(0, 1))
    assert torch.equal(v, v_before)


def test_the_ops_pick_the_kernels_on_a_cpu_and_reference_ops_the_torch_path():
    x = randn(3, 576, dtype=torch.bfloat16, seed=10)
    assert fused.uses_cpu_kernels(x) and fused.kernels_for(x) is cpu_ops
    with fused.reference_ops():
        assert not fused.uses_cpu_kernels(x) and fused.kernels_for(x) is None
    assert fused.uses_cpu_kernels(x)
    assert not fused.uses_cpu_kernels(x.double())  # a dtype the kernels do not take


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_op_equals_its_torch_reference(dtype):
    """`minipaged.ops.fused` both ways in one process: what the model runs on a CPU
    against what it runs elsewhere (non-contiguous inputs included)."""
    x = randn(6, 2, 64, dtype=dtype, seed=11).transpose(0, 1)  # not contiguous
    residual = randn(2, 6, 64, dtype=dtype, seed=12)
    weight = randn(64, dtype=dtype, seed=13) + 1
    gate_up = randn(6, 2 * 96, dtype=dtype, seed=14)
    q, k = randn(6, 4, 64, dtype=dtype, seed=15), randn(6, 2, 64, dtype=dtype, seed=16)
    cos, sin = cos_sin(6, 64, dtype)

    def run():
        return (
            fused.rms_norm(x, weight, EPS),
            *fused.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS),
            fused.silu_and_mul(gate_up),
            *fused.rotary_embedding(q.clone(), k.clone(), cos, sin),
        )

    with fused.reference_ops():
        expected = run()
    for got, want in zip(run(), expected):
        assert_close(got, want)


@pytest.mark.parametrize("name", sorted(fused.ACTIVATIONS))
def test_get_act_fn_is_transformers_activation(name):
    x = randn(5, 67, dtype=torch.float32, seed=7, scale=3.0)
    assert_close(fused.get_act_fn(name)(x), ACT2FN[name](x))


def test_an_unknown_activation_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act must be one of .*'quick_gelu'"):
        fused.get_act_fn("quick_gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 256, 2048])
def test_triton_ops_on_the_gpu_equal_hf(dtype, tokens):
    """Compiled for the GPU, at Qwen2.5-0.5B's sizes (hidden 896, MLP 4864, 14 query and
    2 KV heads of 64): a decode step, a batch of them, a prefill chunk; and what the
    model calls (`fused`) picks them for CUDA tensors."""
    from minipaged.ops import triton_fused

    def cuda(*shape, seed, scale=1.0):
        return randn(*shape, dtype=dtype, seed=seed, scale=scale).cuda()

    x, residual = cuda(tokens, 896, seed=20, scale=3.0), cuda(tokens, 896, seed=21)
    weight = cuda(896, seed=22) + 1
    assert fused.kernels_for(x) is triton_fused
    assert_close(fused.rms_norm(x, weight, EPS), hf_rms_norm(x, weight))
    expected_residual = residual + x
    out, new_residual = fused.fused_add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    assert torch.equal(new_residual, expected_residual)
    assert_close(out, hf_rms_norm(expected_residual, weight))
    gate_up = cuda(tokens, 2 * 4864, seed=23, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(fused.silu_and_mul(gate_up), ACT2FN["silu"](gate) * up)
    qkv = cuda(tokens, (14 + 2 * 2) * 64, seed=24)
    q, k, _ = qkv.split([14 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.view(tokens, 14, 64), k.view(tokens, 2, 64)
    cos, sin = (t.cuda() for t in cos_sin(tokens, 64, dtype))
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, 0)
    rotated_q, rotated_k = fused.rotary_embedding(q, k, cos, sin)
    assert_close(rotated_q, hf_q.transpose(0, 1))
    assert_close(rotated_k, hf_k.transpose(0, 1))

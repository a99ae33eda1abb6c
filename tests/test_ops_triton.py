"""The Triton backend against the oracle: the whole adversarial suite, split-KV, tiles
smaller than blocks, strided views, and the torch reference backend.

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET),
so shapes stay small; the ``gpu`` tests repeat the suite on CUDA and add real sizes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_cases import (
    DECODE_CASES,
    NUM_HEADS,
    PREFILL_CASES,
    AttentionSuite,
    Case,
    make_paged_kv,
    real_paged_kv,
    refusal_on_cpu,
)
from minipaged.ops import (
    decode_oracle,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_oracle,
    write_kv,
)
from minipaged.ops.testing import assert_close


class TestTritonOps(AttentionSuite):
    backend = "triton"


@pytest.mark.gpu
class TestTritonOpsCuda(AttentionSuite):
    backend = "triton"
    device = "cuda"


def _triton_ops():
    from minipaged.ops import triton_ops  # imported late: after conftest set the interpreter

    return triton_ops


def _decode_inputs(case, device="cpu"):
    g = torch.Generator().manual_seed(1)
    kv = make_paged_kv(case, g, device)
    query = torch.randn(len(case.context_lens), NUM_HEADS, case.head_dim, generator=g)
    return kv, query.to(case.dtype).to(device)


def _prefill_inputs(case, device="cpu"):
    g = torch.Generator().manual_seed(1)
    kv = make_paged_kv(case, g, device)
    query = torch.randn(sum(case.new_lens), NUM_HEADS, case.head_dim, generator=g)
    starts = torch.tensor([0, *case.new_lens]).cumsum(0).to(torch.int32).to(device)
    return kv, query.to(case.dtype).to(device), starts


# Split-KV: ragged batches leave some splits of the short sequences empty.  Each case
# with one of the splittings (every splitting on several cases): the interpreter takes
# seconds a case, and a splitting's bugs show on any ragged batch.
@pytest.mark.parametrize(
    "case, num_splits, block_n",
    [
        (DECODE_CASES[1], 3, 32),
        (DECODE_CASES[3], 7, 16),  # a 5-token sequence among 129: empty splits
        (DECODE_CASES[6], 7, 16),  # 1 to 129 tokens: empty splits
        (DECODE_CASES[8], 2, 16),
        (DECODE_CASES[9], 3, 32),
    ],
    ids=str,
)
def test_split_kv_decode_matches_oracle(case, num_splits, block_n):
    kv, query = _decode_inputs(case)
    out = _triton_ops().paged_attention_decode(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.context_lens,
        case.scale,
        num_splits=num_splits,
        block_n=block_n,
    )
    assert_close(out, decode_oracle(query, kv.keys, kv.values, case.scale))


@pytest.mark.parametrize("case", [c for c in PREFILL_CASES if c.block_size >= 16], ids=str)
def test_prefill_with_tiles_smaller_than_blocks(case):
    kv, query, starts = _prefill_inputs(case)
    out = _triton_ops().paged_attention_prefill(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        starts,
        kv.context_lens,
        case.scale,
        block_n=16,
    )
    assert_close(out, prefill_oracle(query, starts, kv.keys, kv.values, case.scale))


@pytest.mark.parametrize("case", [DECODE_CASES[6], DECODE_CASES[7]], ids=str)
def test_decode_agrees_with_torch_backend(case):
    kv, query = _decode_inputs(case)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, case.scale)
    assert_close(
        paged_attention_decode(*args, backend="triton"),
        paged_attention_decode(*args, backend="torch"),
    )


@pytest.mark.parametrize("case", [PREFILL_CASES[3], PREFILL_CASES[5]], ids=str)
def test_prefill_agrees_with_torch_backend(case):
    kv, query, starts = _prefill_inputs(case)
    args = (
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        starts,
        kv.context_lens,
        case.scale,
    )
    assert_close(
        paged_attention_prefill(*args, backend="triton"),
        paged_attention_prefill(*args, backend="torch"),
    )


def test_strided_views_need_no_copy():
    """Q, K and V sliced out of one fused projection, as a model produces them."""
    case = DECODE_CASES[7]
    kv, query = _decode_inputs(case)
    fused = torch.randn(query.shape[0], NUM_HEADS, 3 * case.head_dim)
    fused[..., : case.head_dim] = query
    view = fused[..., : case.head_dim]
    assert not view.is_contiguous()
    out = paged_attention_decode(
        view,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.context_lens,
        case.scale,
        backend="triton",
    )
    assert_close(out, decode_oracle(query, kv.keys, kv.values, case.scale))

    key_cache = torch.zeros(4, 8, 2, 64)
    value_cache = torch.zeros(4, 8, 2, 64)
    fused_kv = torch.randn(5, 2, 128)
    key, value = fused_kv[..., :64], fused_kv[..., 64:]
    slots = torch.tensor([3, 9, -1, 17, 31], dtype=torch.int32)
    write_kv(key, value, key_cache, value_cache, slots, backend="triton")
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(key_cache[s // 8, s % 8], key[t])
            assert torch.equal(value_cache[s // 8, s % 8], value[t])
    assert int((key_cache != 0).any(dim=(2, 3)).sum()) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu tests compile them")
def test_kernels_compile_for_gpus_without_one():
    """The interpreter never lowers a kernel to GPU code; ahead-of-time compilation for
    sm_80 and sm_90 does, and catches what only a GPU compiler would reject."""
    script = Path(__file__).with_name("compile_triton_kernels.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("sm_90 bf16") == 10


# How many splits: enough programs to fill the GPU, but never splits of a few tokens.
H100_SMS = 132


def test_big_batch_needs_no_split():
    assert _triton_ops().choose_num_splits(64, 8, 2048, H100_SMS) == 1


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_long_context_is_split_until_the_gpu_is_full(batch):
    ops = _triton_ops()
    splits = ops.choose_num_splits(batch, 8, 32768, H100_SMS)
    assert batch * 8 * splits >= ops.PROGRAMS_PER_SM * H100_SMS or splits == ops.MAX_SPLITS
    assert 32768 / splits >= ops.MIN_TOKENS_PER_SPLIT


@pytest.mark.parametrize(
    "batch, num_sms, splits",
    [
        # One 32K-token sequence of 8 KV heads: 8 programs; 4 per SM of an H100's 132
        # would be 66 splits, capped at 64 (512 programs of 512 tokens).
        (1, 132, 64),
        # Four: 32 programs, ceil(528 / 32) = 17 splits (544 programs).
        (4, 132, 17),
        # An H200 or an A100 (108 SMs): ceil(432 / 32) = 14.
        (4, 108, 14),
        # Sixteen: 128 programs, not yet one per SM: ceil(528 / 128) = 5.
        (16, 132, 5),
    ],
)
def test_split_count_fills_the_multiprocessors_four_programs_deep(batch, num_sms, splits):
    assert _triton_ops().choose_num_splits(batch, 8, 32768, num_sms) == splits


def test_the_chosen_split_count_matches_the_oracle(monkeypatch):
    """The heuristic's own choice, not a forced one, on a GPU of 4 multiprocessors: two
    sequences of one KV head are 2 programs, so ceil(4 * 4 / 2) = 8 splits are wanted and
    the 528-token bound allows ceil(528 / 256) = 3."""
    ops = _triton_ops()
    monkeypatch.setattr(ops, "_num_sms", lambda device: 4)
    chosen = []
    choose = ops.choose_num_splits
    monkeypatch.setattr(
        ops, "choose_num_splits", lambda *a: chosen.append(choose(*a)) or chosen[-1]
    )
    case = Case((520, 3), block_size=16, num_kv_heads=1)
    kv, query = _decode_inputs(case)
    out = paged_attention_decode(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.context_lens,
        case.scale,
        backend="triton",
    )
    assert chosen == [3]
    assert_close(out, decode_oracle(query, kv.keys, kv.values, case.scale))


def test_short_context_is_not_split_into_slivers():
    ops = _triton_ops()
    assert ops.choose_num_splits(1, 8, ops.MIN_TOKENS_PER_SPLIT, H100_SMS) == 1
    assert ops.choose_num_splits(1, 8, 3 * ops.MIN_TOKENS_PER_SPLIT, H100_SMS) == 3


def test_cpu_tensors_without_the_interpreter_are_refused():
    assert "TRITON_INTERPRET=1" in refusal_on_cpu("triton", without="TRITON_INTERPRET")


# Real sizes on the GPU: B=64 at 2K and 8K tokens, long contexts split, prefill chunks.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch, context_len", [(64, 2048), (64, 8192), (1, 32768), (4, 40000)])
def test_decode_at_real_sizes(batch, context_len, dtype):
    query, key_cache, value_cache, tables, lens, keys, values = real_paged_kv(
        batch, context_len, dtype
    )
    out = paged_attention_decode(
        query, key_cache, value_cache, tables, lens, 128**-0.5, backend="triton"
    )
    assert_close(out, decode_oracle(query, keys, values, 128**-0.5))


@pytest.mark.gpu
def test_long_context_on_the_gpu_takes_the_split_path():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert _triton_ops().choose_num_splits(1, 8, 32768, sms) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch, context_len, num_new", [(4, 2048, 2048), (4, 4096, 512)])
def test_prefill_at_real_sizes(batch, context_len, num_new, dtype):
    _, key_cache, value_cache, tables, lens, keys, values = real_paged_kv(batch, context_len, dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    query = torch.randn(batch * num_new, 32, 128, generator=g, device="cuda").to(dtype)
    starts = torch.arange(0, batch * num_new + 1, num_new, dtype=torch.int32, device="cuda")
    out = paged_attention_prefill(
        query, key_cache, value_cache, tables, starts, lens, 128**-0.5, backend="triton"
    )
    assert_close(out, prefill_oracle(query, starts, keys, values, 128**-0.5))

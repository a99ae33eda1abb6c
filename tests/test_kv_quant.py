"""A quantized KV cache (``kv_cache_dtype`` fp8 / int8, `minipaged.ops.kv_quant`): every
attention path against the oracle, the formats' rounding against their precision, and
the ops' refusals.

The oracle reads the quantized cache the plain way: every element as a float times its
slot's scale (a per-layer scale for fp8, one per token and KV head for int8), gathered
through the block tables by indexing, then the naive contiguous attention in float64.
A backend reads the same bytes times the same float32 scales, so the product is the
same float32 number on both sides (one rounding, the same one): what is left between
them is the backend's own arithmetic, bounded as for a cache in the query's dtype
(``minipaged.ops.testing.TOLERANCES``: 1e-5 in float32, 2e-3 in float16, whose 11
significant bits Triton also rounds the dequantized keys and values to before its dot
products, 2^-11 ~ 5e-4 of each).  The CUDA kernels (v1 and v2, in the CPU emulator
without a GPU) run every case compiled for them; their bound is the same.  The shapes
are the shared adversarial ones
(`attention_cases`): GQA, partial last blocks, shared blocks, long contexts; every slot
no sequence owns holds fp8's NaN, or for int8 (which has none) garbage bytes in slots
whose scale is NaN.

What the quantization itself costs is the formats' precision, checked on `write_kv`:
rounding to nearest costs at most half a step, 2^-4 of a value in e4m3 (3 mantissa
bits) and 2^-3 in e5m2 (2 bits) above their smallest normal (2^-6, 2^-14), and a fixed
half subnormal step below it (2^-10, 2^-17); in int8 half the token's step,
``scale / 2`` with ``scale = max |x| / 127`` per token and head.  Each element (fp8) or
token (int8) is rounded on its own, so the bytes a token leaves do not depend on the
tokens written with it: one prefill, token by token and ragged chunks store the same.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_cases import (
    CPU_BACKENDS,
    DECODE_CASES,
    LONG_DECODE_CASES,
    LONG_PREFILL_CASES,
    NUM_HEADS,
    PREFILL_CASES,
    Case,
    make_paged_kv,
    use_backend,
)
from minipaged.config import KV_CACHE_DTYPES
from minipaged.ops import (
    check_supported,
    cuda_ops,
    decode_oracle,
    kv_quant,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_oracle,
    write_kv,
)
from minipaged.ops.testing import assert_close

pytestmark = pytest.mark.spread  # independent cases; each ISA is a build of its own

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")
# (relative half step, absolute half step below the smallest normal, in units of the scale)
FP8_PRECISION = {torch.float8_e4m3fn: (2**-4, 2**-10), torch.float8_e5m2: (2**-3, 2**-17)}
# The Triton interpreter takes seconds a case: a few of each shape family.
TRITON_DECODE = [DECODE_CASES[1], DECODE_CASES[3], DECODE_CASES[7]]
TRITON_PREFILL = [PREFILL_CASES[1], PREFILL_CASES[3]]


def quantized_cache(case, fmt: str, g: torch.Generator):
    """``case``'s paged K/V quantized to ``fmt``, and the oracle's dense per-sequence K/V
    read back from it.  fp8 gets per-layer scales away from 1 (0.02 and 0.05: the
    values' largest magnitudes, ~4, land near the middle of e4m3's range); int8 gets
    each token and head's largest magnitude over 127, NaN for slots nobody owns."""
    kv = make_paged_kv(case, g, "cpu")
    dtype = kv_quant.cache_dtype(fmt, case.dtype)
    caches, scales = [], []
    for cache, fp8_scale in ((kv.key_cache, 0.02), (kv.value_cache, 0.05)):
        x = cache.float()
        if dtype == torch.int8:
            scale = x.abs().amax(dim=3) / 127  # [num_blocks, block_size, heads]: NaN if unowned
            q = (x / scale[..., None]).round().clamp(-127, 127)
            garbage = torch.randint(-127, 128, x.shape, generator=g).float()
            q = torch.where(x.isnan(), garbage, q).to(torch.int8)
        else:
            scale = torch.tensor(fp8_scale)
            q = (x / scale).to(dtype)  # NaN stays NaN
        caches.append(q)
        scales.append(scale)
    dense = []
    for cache, scale in zip(caches, scales):
        per_slot = scale.expand(cache.shape[:3])
        values = cache.double() * per_slot.double()[..., None]
        rows = []
        for table, length in zip(kv.block_tables.tolist(), kv.context_lens.tolist()):
            pos = torch.arange(length)
            rows.append(values[torch.tensor(table)[pos // case.block_size], pos % case.block_size])
        dense.append(rows)
    return kv, caches, scales, dense


BACKEND_CASES = (
    [("torch", c) for c in DECODE_CASES]
    + [(cpu, c) for cpu in CPU_BACKENDS for c in DECODE_CASES + LONG_DECODE_CASES]
    + [("triton", c) for c in TRITON_DECODE]
)
# The CUDA kernels' cases: those of a dtype, head_dim and block_size they are built for.
CUDA_DECODE = [
    c
    for c in DECODE_CASES
    if c.dtype in cuda_ops.DTYPES
    and c.head_dim in cuda_ops.HEAD_DIMS
    and c.block_size in cuda_ops.BLOCK_SIZES
]
BACKEND_PREFILL = (
    [("torch", c) for c in PREFILL_CASES]
    + [(cpu, c) for cpu in CPU_BACKENDS for c in PREFILL_CASES + LONG_PREFILL_CASES]
    + [("triton", c) for c in TRITON_PREFILL]
)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend, case", BACKEND_CASES, ids=lambda x: str(x))
def test_decode_reads_the_quantized_cache(backend, case, fmt, monkeypatch):
    backend = use_backend(backend, monkeypatch)
    g = torch.Generator().manual_seed(0)
    kv, (kc, vc), (ks, vs), (keys, values) = quantized_cache(case, fmt, g)
    query = torch.randn(len(case.context_lens), NUM_HEADS, case.head_dim, generator=g)
    query = query.to(case.dtype)
    out = paged_attention_decode(
        query,
        kc,
        vc,
        kv.block_tables,
        kv.context_lens,
        case.scale,
        backend=backend,
        k_scale=ks,
        v_scale=vs,
    )
    assert out.dtype == query.dtype
    assert_close(out, decode_oracle(query.double(), keys, values, case.scale), dtype=query.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend, case", BACKEND_PREFILL, ids=lambda x: str(x))
def test_prefill_reads_the_quantized_cache(backend, case, fmt, monkeypatch):
    backend = use_backend(backend, monkeypatch)
    g = torch.Generator().manual_seed(0)
    kv, (kc, vc), (ks, vs), (keys, values) = quantized_cache(case, fmt, g)
    query = torch.randn(sum(case.new_lens), NUM_HEADS, case.head_dim, generator=g)
    query = query.to(case.dtype)
    starts = torch.tensor([0, *case.new_lens]).cumsum(0).to(torch.int32)
    out = paged_attention_prefill(
        query,
        kc,
        vc,
        kv.block_tables,
        starts,
        kv.context_lens,
        case.scale,
        backend=backend,
        k_scale=ks,
        v_scale=vs,
    )
    expected = prefill_oracle(query.double(), starts, keys, values, case.scale)
    assert_close(out, expected, dtype=query.dtype)


def _written(fmt, key, value, slots, groups, num_blocks, block_size, backend="torch"):
    """Write token ``t`` of ``key, value [T, H, D]`` at ``slots[t]`` of a fresh cache,
    the tokens of each of ``groups`` in one call (as successive steps would); the
    dequantized caches and their scales."""
    dtype = kv_quant.cache_dtype(fmt, torch.float32)
    shape = (num_blocks, block_size, *key.shape[1:])
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    ks, vs = kv_quant.new_scales(dtype, shape, "cpu")
    if dtype != torch.int8:
        ks.fill_(0.05)
    for group in groups:
        write_kv(key[group], value[group], kc, vc, slots[group], backend, ks, vs)
    return [
        (c.float() * kv_quant.slot_scales(s, c)[..., None], c, s) for c, s in ((kc, ks), (vc, vs))
    ]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("one_call", [True, False], ids=["prefill", "token-by-token"])
def test_write_kv_rounds_within_the_formats_precision(fmt, one_call, backend):
    """Every stored element is within the format's rounding of what was written, once,
    however the tokens arrive."""
    g = torch.Generator().manual_seed(0)
    block_size, num_tokens = 8, 37
    # Magnitudes from 1e-4 to ~10: subnormal and normal fp8 alike (over fp8's key scale,
    # 0.05, within e4m3's largest, 448).
    key = torch.randn(num_tokens, 2, 16, generator=g) * torch.logspace(-4, 0.5, 16)
    value = torch.randn(num_tokens, 2, 16, generator=g)
    # Each sequence fills its (shuffled) blocks from their first slot on.
    blocks = torch.randperm(6, generator=g)[: math.ceil(num_tokens / block_size)]
    order = torch.cat([b * block_size + torch.arange(block_size) for b in blocks])[:num_tokens]
    tokens = torch.arange(num_tokens)
    groups = [tokens] if one_call else list(tokens.split(1))
    written = _written(fmt, key, value, order, groups, 6, block_size, backend)
    for x, (stored, _, scale) in zip((key, value), written):
        got = stored.view(-1, *x.shape[1:])[order]
        dtype = kv_quant.cache_dtype(fmt, torch.float32)
        if dtype == torch.int8:
            step = scale.view(-1, x.shape[1])[order][..., None]
            bound = step / 2
            assert (step >= x.abs().amax(-1, keepdim=True) / 127 * (1 - 1e-6)).all()  # no clip
        else:
            rel, floor = FP8_PRECISION[dtype]
            bound = torch.maximum(rel * x.abs(), torch.full_like(x, floor * float(scale)))
        assert ((got - x).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_stored_bytes_do_not_depend_on_how_the_tokens_arrive(fmt, backend):
    """One prefill, token by token, and ragged chunks that split blocks, each over
    slots a previous owner filled with other tokens: the same bytes and scales (what
    makes recompute preemption and chunked prefill token-identical)."""
    g = torch.Generator().manual_seed(1)
    block_size, num_tokens, num_blocks = 4, 19, 6
    scales = torch.logspace(-3, 1, num_tokens)[:, None, None]  # tokens of unlike sizes
    key, value = (torch.randn(num_tokens, 2, 16, generator=g) * scales for _ in range(2))
    first = torch.randperm(num_blocks, generator=g) * block_size
    slots = (first[:, None] + torch.arange(block_size)).flatten()[:num_tokens]
    tokens = torch.arange(num_tokens)
    stored = []
    for groups in ([tokens], list(tokens.split(1)), list(tokens.split([3, 6, 1, 9]))):
        previous = [50 * torch.randn(num_tokens, 2, 16, generator=g) for _ in range(2)]
        written = _written(fmt, *previous, slots, [tokens], num_blocks, block_size, backend)
        (_, kc, ks), (_, vc, vs) = written
        for group in groups:
            write_kv(key[group], value[group], kc, vc, slots[group], backend, ks, vs)
        stored.append(
            [
                (
                    c.view(torch.uint8).flatten(0, 1)[slots],
                    kv_quant.slot_scales(s, c).flatten(0, 1)[slots],
                )
                for c, s in ((kc, ks), (vc, vs))
            ]
        )
    for other in stored[1:]:
        for (bytes_a, scale_a), (bytes_b, scale_b) in zip(stored[0], other):
            assert torch.equal(bytes_a, bytes_b) and torch.equal(scale_a, scale_b)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_kernels_quantizing_store_writes_kv_quants_bytes(fmt, dtype):
    """The C++ store (the CPU backend's ``write_kv``) and `kv_quant.write_kv` in torch
    leave the same bytes and scales: a prefill that fills blocks and starts one, decode
    tokens of growing size, a reused block, skipped slots."""
    g = torch.Generator().manual_seed(1)
    steps = [torch.arange(0, 21), torch.tensor([21, -1]), torch.tensor([22]), torch.tensor([8, 9])]
    results = []
    for backend in ("torch", "cpu"):
        g.manual_seed(1)
        cache_dtype = kv_quant.cache_dtype(fmt, dtype)
        kc = torch.zeros(4, 8, 2, 16, dtype=cache_dtype)
        vc = kc.clone()
        ks, vs = kv_quant.new_scales(cache_dtype, kc.shape, "cpu")
        for step, slots in enumerate(steps):
            growth = 1 + 3 * step  # later tokens larger than a block's earlier ones
            key = (torch.randn(len(slots), 2, 16, generator=g) * growth).to(dtype)
            value = (torch.randn(len(slots), 2, 16, generator=g) * growth).to(dtype)
            write_kv(key, value, kc, vc, slots, backend, ks, vs)
        results.append([kc.view(torch.uint8), vc.view(torch.uint8), ks, vs])
    for torch_made, kernel_made in zip(*results):
        assert torch.equal(torch_made, kernel_made)


def test_the_engines_choices_are_the_formats():
    assert KV_CACHE_DTYPES == ("auto", *kv_quant.FORMATS)
    assert kv_quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.cache_dtype("fp4", torch.bfloat16)


def test_calculate_kv_scales_is_vllms_amax_over_its_constants():
    key, value = torch.tensor([[[-3.0, 1.0]]]), torch.tensor([[[0.5, 2.5]]])
    ks, vs = kv_quant.new_scales(torch.float8_e4m3fn, (4, 2, 1, 2), "cpu")
    kv_quant.calculate_kv_scales(key, value, ks, vs)
    assert float(ks) == pytest.approx(3.0 / 200) and float(vs) == pytest.approx(2.5 / 100)


def test_fp8_scale_defaults_to_one_and_large_values_saturate():
    kc = torch.zeros(1, 2, 1, 2, dtype=torch.float8_e4m3fn)
    vc = kc.clone()
    x = torch.tensor([[[1.5, 1e6]], [[-1e6, 3.0]]])
    write_kv(x, x, kc, vc, torch.tensor([0, 1]))
    assert kc.float().flatten().tolist() == [1.5, 448.0, -448.0, 3.0]


def test_bad_scales_are_refused_by_name():
    q = torch.randn(1, 2, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    int8 = torch.zeros(3, 4, 2, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_scale for a torch.int8 cache"):
        paged_attention_decode(q, int8, int8, tables, lens, 1.0)
    with pytest.raises(ValueError, match="k_scale and v_scale are for a quantized cache"):
        fp32 = torch.zeros(3, 4, 2, 8)
        paged_attention_decode(q, fp32, fp32, tables, lens, 1.0, k_scale=torch.ones(()))
    fp8 = int8.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="must have one shape"):
        paged_attention_decode(
            q, fp8, fp8, tables, lens, 1.0, k_scale=torch.ones(()), v_scale=torch.ones(3, 4, 2)
        )
    scales = torch.ones(3, 4, 2), torch.ones(3, 4, 2)
    with pytest.raises(ValueError, match="query dtype torch.int8"):
        paged_attention_decode(q.to(torch.int8), int8, int8, tables, lens, 1.0, "torch", *scales)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("version", [1, 2, 3], ids=lambda v: f"v{v}")
@pytest.mark.parametrize("case", CUDA_DECODE, ids=str)
def test_cuda_decode_reads_the_quantized_cache(case, version, fmt):
    """Both CUDA versions that read a quantized cache, each asked for by name (the
    backend's own choice would take v1 for every case here)."""
    g = torch.Generator().manual_seed(0)
    kv, (kc, vc), (ks, vs), (keys, values) = quantized_cache(case, fmt, g)
    query = torch.randn(len(case.context_lens), NUM_HEADS, case.head_dim, generator=g)
    query = query.to(case.dtype)
    out = cuda_ops.paged_attention_decode(
        query, kc, vc, kv.block_tables, kv.context_lens, case.scale, ks, vs, version=version
    )
    assert_close(out, decode_oracle(query.double(), keys, values, case.scale), dtype=query.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_v3_splits_read_the_quantized_cache(fmt):
    """v3 copies a quantized tile's scales beside its bytes; across three splits too."""
    case = Case((5, 200, 330), block_size=16, num_kv_heads=2, dtype=torch.float16)
    g = torch.Generator().manual_seed(1)
    kv, (kc, vc), (ks, vs), (keys, values) = quantized_cache(case, fmt, g)
    query = torch.randn(3, NUM_HEADS, case.head_dim, generator=g).to(case.dtype)
    out = cuda_ops.paged_attention_decode(
        query, kc, vc, kv.block_tables, kv.context_lens, case.scale, ks, vs, num_splits=3
    )
    assert_close(out, decode_oracle(query.double(), keys, values, case.scale), dtype=query.dtype)


def test_cuda_kernels_take_a_quantized_cache_but_v0_does_not():
    """The engine's question before allocating, and v0 (the plain kernel) at the op."""
    check_supported("cuda", torch.float16, 128, 16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        check_supported("cuda", torch.float16, 128, 16, torch.float32)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.float8_e4m3fn)
    query = torch.randn(1, 2, 128, dtype=torch.float16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    one = torch.ones(())
    with pytest.raises(ValueError, match="version 0 reads no"):
        cuda_ops.paged_attention_decode(query, cache, cache, tables, lens, 1.0, one, one, version=0)

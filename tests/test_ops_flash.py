"""The optional library backends, ``flash_attn`` (FlashAttention-2) and ``flashinfer``
(`minipaged.ops.flash_attn_ops`, `minipaged.ops.flashinfer_ops`).

On a CPU: each is refused with a ``ValueError`` that says why (no GPU, or no package),
by the op and by ``LLM``; the shapes each library cannot take are refused by name; and
the metadata each library is handed, FlashInfer's ``indptr``/``indices``/``last_page_len``
and FlashAttention's ``cu_seqlens_k``/``block_table``, finds exactly the oracle's
contiguous K/V of every sequence in the paged cache.  On a GPU (``gpu``-marked, each
skipping when its package is not installed): decode and prefill equal the contiguous
oracle, in fp16 and bf16."""

import dataclasses

import pytest
import torch

from attention_cases import DECODE_CASES, NUM_HEADS, PREFILL_CASES, make_paged_kv
from minipaged import LLM
from minipaged.ops import (
    BackendUnavailableError,
    check_supported,
    decode_oracle,
    get_backend,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_oracle,
)
from minipaged.ops.flash_attn_ops import varlen_metadata
from minipaged.ops.flashinfer_ops import paged_kv_metadata
from minipaged.ops.testing import assert_close

LIBRARIES = {"flash_attn": "flash_attn", "flashinfer": "flashinfer"}


# -- refused where they cannot run ------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU may run them")
@pytest.mark.parametrize("backend", LIBRARIES)
def test_refused_on_a_cpu_saying_why(backend):
    with pytest.raises(ValueError, match=f"the '{backend}' attention backend needs a CUDA GPU"):
        get_backend(backend, torch.device("cpu"))
    with pytest.raises(BackendUnavailableError):
        get_backend(backend, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU may run them")
@pytest.mark.parametrize("backend", LIBRARIES)
def test_llm_refuses_them_on_a_cpu(backend, tiny):
    path, _ = tiny("llama")
    with pytest.raises(ValueError, match=f"'{backend}' attention backend needs a CUDA GPU"):
        LLM(path, device="cpu", attention_backend=backend)


@pytest.mark.parametrize(
    "backend, dtype, head_dim, block_size, cache, message",
    [
        ("flashinfer", torch.float32, 64, 16, None, "dtype must be float16 or bfloat16"),
        ("flashinfer", torch.bfloat16, 96, 16, None, "head_dim must be one of"),
        ("flashinfer", torch.float16, 64, 16, torch.int8, "kv_cache_dtype must be the model's"),
        ("flash_attn", torch.bfloat16, 128, 16, None, "block_size must be a multiple of 256"),
        ("flash_attn", torch.float32, 128, 256, None, "dtype must be float16 or bfloat16"),
        ("flash_attn", torch.bfloat16, 100, 256, None, "head_dim must be one of"),
    ],
)
def test_shapes_the_library_cannot_take_are_refused(
    backend, dtype, head_dim, block_size, cache, message
):
    with pytest.raises(ValueError, match=message):
        check_supported(backend, dtype, head_dim, block_size, cache)


@pytest.mark.parametrize("backend, block_size", [("flashinfer", 16), ("flash_attn", 256)])
def test_shapes_the_library_takes_pass(backend, block_size):
    check_supported(backend, torch.bfloat16, 128, block_size, torch.bfloat16)


# -- the metadata each library reads, against the oracle's contiguous K/V ------------------
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_flashinfer_pages_hold_each_sequences_contiguous_kv(case):
    kv = make_paged_kv(case, torch.Generator().manual_seed(0), "cpu")
    bs = case.block_size
    indptr, indices, last_page_len = paged_kv_metadata(kv.block_tables, kv.context_lens, bs)
    assert {t.dtype for t in (indptr, indices, last_page_len)} == {torch.int32}
    assert indptr[0] == 0 and len(indptr) == len(case.context_lens) + 1
    assert ((1 <= last_page_len) & (last_page_len <= bs)).all()
    for b, (keys, values) in enumerate(zip(kv.keys, kv.values)):
        pages = indices[indptr[b] : indptr[b + 1]].long()
        length = (len(pages) - 1) * bs + int(last_page_len[b])
        # FlashInfer's NHD pages are the cache's blocks: [page_size, num_kv_heads, D].
        assert torch.equal(kv.key_cache[pages].flatten(0, 1)[:length], keys)
        assert torch.equal(kv.value_cache[pages].flatten(0, 1)[:length], values)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_flash_attn_varlen_metadata_finds_each_sequences_kv(case):
    kv = make_paged_kv(case, torch.Generator().manual_seed(0), "cpu")
    starts = torch.tensor([0, *case.new_lens]).cumsum(0)
    meta = varlen_metadata(starts, kv.context_lens, kv.block_tables)
    lengths = [len(k) for k in kv.keys]
    assert meta["cu_seqlens_q"].tolist() == starts.tolist()
    assert meta["cu_seqlens_k"].tolist() == torch.tensor([0, *lengths]).cumsum(0).tolist()
    assert meta["max_seqlen_k"] == max(lengths)
    assert meta["cu_seqlens_k"].dtype == meta["block_table"].dtype == torch.int32
    bs = case.block_size
    for b, (keys, values) in enumerate(zip(kv.keys, kv.values)):
        blocks = meta["block_table"][b, : -(-lengths[b] // bs)].long()
        assert torch.equal(kv.key_cache[blocks].flatten(0, 1)[: lengths[b]], keys)
        assert torch.equal(kv.value_cache[blocks].flatten(0, 1)[: lengths[b]], values)


# -- on a GPU: the libraries' kernels against the oracle ---------------------------------
def _gpu_cases(cases, backend):
    """The cases in fp16 and bf16 (the libraries' dtypes); FlashAttention's in blocks of
    256 tokens, FlashInfer's at their own block sizes; head dims both take."""
    out = []
    for case in cases:
        for dtype in (torch.float16, torch.bfloat16):
            changes = dict(dtype=dtype, head_dim=128 if case.head_dim == 128 else 64)
            if backend == "flash_attn":
                changes |= dict(block_size=256, shared_blocks=0)
            out.append(dataclasses.replace(case, **changes))
    return list(dict.fromkeys(out))


def _randn(g, rows, case):
    return torch.randn(rows, NUM_HEADS, case.head_dim, generator=g).to(case.dtype).cuda()


def _params(cases):
    return [
        pytest.param(backend, case, id=f"{backend}-{case}")
        for backend in LIBRARIES
        for case in _gpu_cases(cases, backend)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, case", _params(DECODE_CASES))
def test_decode_matches_oracle_on_a_gpu(backend, case):
    pytest.importorskip(LIBRARIES[backend])
    g = torch.Generator().manual_seed(0)
    kv = make_paged_kv(case, g, "cuda")
    query = _randn(g, len(case.context_lens), case)
    out = paged_attention_decode(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.context_lens,
        case.scale,
        backend=backend,
    )
    assert_close(out, decode_oracle(query, kv.keys, kv.values, case.scale))


@pytest.mark.gpu
@pytest.mark.parametrize("backend, case", _params(PREFILL_CASES))
def test_prefill_matches_oracle_on_a_gpu(backend, case):
    pytest.importorskip(LIBRARIES[backend])
    g = torch.Generator().manual_seed(0)
    kv = make_paged_kv(case, g, "cuda")
    query = _randn(g, sum(case.new_lens), case)
    starts = torch.tensor([0, *case.new_lens], device="cuda").cumsum(0).to(torch.int32)
    out = paged_attention_prefill(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        starts,
        kv.context_lens,
        case.scale,
        backend=backend,
    )
    expected = prefill_oracle(query, starts.tolist(), kv.keys, kv.values, case.scale)
    assert_close(out, expected)

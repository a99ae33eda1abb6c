"""The torch reference backend against the oracle, and the checks at the ops boundary."""

import subprocess
import sys

import pytest
import torch

from attention_cases import AttentionSuite
from minipaged.ops import (
    BackendUnavailableError,
    paged_attention_decode,
    paged_attention_prefill,
    write_kv,
)


class TestTorchOps(AttentionSuite):
    backend = "torch"


i32 = torch.int32


def decode_args(**override):
    """A valid decode call: 2 sequences of 5 and 8 tokens, blocks of 4, GQA 8/2."""
    args = dict(
        query=torch.randn(2, 8, 64),
        key_cache=torch.randn(6, 4, 2, 64),
        value_cache=torch.randn(6, 4, 2, 64),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=i32),
        context_lens=torch.tensor([5, 8], dtype=i32),
        scale=0.125,
    )
    return {**args, **override}


def prefill_args(**override):
    """A valid prefill call: 3 and 5 new tokens ending sequences of 5 and 8 tokens."""
    args = decode_args(
        query=torch.randn(8, 8, 64), query_start_loc=torch.tensor([0, 3, 8], dtype=i32)
    )
    return {**args, **override}


def write_args(**override):
    args = dict(
        key=torch.randn(3, 2, 64),
        value=torch.randn(3, 2, 64),
        key_cache=torch.zeros(6, 4, 2, 64),
        value_cache=torch.zeros(6, 4, 2, 64),
        slot_mapping=torch.tensor([0, -1, 23], dtype=i32),
    )
    return {**args, **override}


BAD_DECODE = {
    "query 2-D": ("query", dict(query=torch.randn(2, 64))),
    "head_dim": ("query", dict(query=torch.randn(2, 8, 32))),
    "heads not a multiple": ("query", dict(query=torch.randn(2, 3, 64))),
    "query dtype": ("query", dict(query=torch.randn(2, 8, 64, dtype=torch.float16))),
    "key_cache 3-D": ("key_cache", dict(key_cache=torch.randn(6, 4, 128))),
    "value_cache shape": ("value_cache", dict(value_cache=torch.randn(6, 4, 2, 32))),
    "block_tables float": ("block_tables", dict(block_tables=torch.zeros(2, 2))),
    "block_tables rows": ("block_tables", dict(block_tables=torch.zeros(3, 2, dtype=i32))),
    "context_lens length": ("context_lens", dict(context_lens=torch.tensor([5], dtype=i32))),
    "context_lens float": ("context_lens", dict(context_lens=torch.tensor([5.0, 8.0]))),
    "context_lens zero": ("context_lens", dict(context_lens=torch.tensor([0, 8], dtype=i32))),
    "context_lens > table": ("context_lens", dict(context_lens=torch.tensor([5, 9], dtype=i32))),
}

BAD_PREFILL = {
    "qsl length": ("query_start_loc", dict(query_start_loc=torch.tensor([0, 8], dtype=i32))),
    "qsl float": ("query_start_loc", dict(query_start_loc=torch.tensor([0.0, 3.0, 8.0]))),
    "qsl end": ("query_start_loc", dict(query_start_loc=torch.tensor([0, 3, 7], dtype=i32))),
    "qsl falls": ("query_start_loc", dict(query_start_loc=torch.tensor([0, 9, 8], dtype=i32))),
    "fewer context than new": (
        "context_lens",
        dict(query_start_loc=torch.tensor([0, 6, 8], dtype=i32)),
    ),
    "query 2-D": ("query", dict(query=torch.randn(8, 64))),
}

BAD_WRITE = {
    "key 2-D": ("key", dict(key=torch.randn(3, 128))),
    "key heads": ("key", dict(key=torch.randn(3, 4, 64), value=torch.randn(3, 4, 64))),
    "value shape": ("value", dict(value=torch.randn(2, 2, 64))),
    "key dtype": ("key", dict(key=torch.randn(3, 2, 64, dtype=torch.float16))),
    "slots length": ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1], dtype=i32))),
    "slots float": ("slot_mapping", dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0]))),
    "slot too big": ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1, 24], dtype=i32))),
    "slot below -1": ("slot_mapping", dict(slot_mapping=torch.tensor([0, -2, 1], dtype=i32))),
}

OPS = {
    "decode": (paged_attention_decode, decode_args),
    "prefill": (paged_attention_prefill, prefill_args),
    "write_kv": (write_kv, write_args),
}


@pytest.mark.parametrize("op", OPS)
def test_valid_arguments_pass(op):
    fn, args = OPS[op]
    fn(**args())


@pytest.mark.parametrize(
    "op, name, override",
    [
        *[pytest.param("decode", *bad, id=f"decode-{k}") for k, bad in BAD_DECODE.items()],
        *[pytest.param("prefill", *bad, id=f"prefill-{k}") for k, bad in BAD_PREFILL.items()],
        *[pytest.param("write_kv", *bad, id=f"write_kv-{k}") for k, bad in BAD_WRITE.items()],
    ],
)
def test_bad_argument_raises_value_error_naming_it(op, name, override):
    fn, args = OPS[op]
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        fn(**args(**override))


@pytest.mark.parametrize("op", OPS)
def test_a_backend_that_cannot_run_here_says_why(op, monkeypatch):
    """CPU tensors and the CUDA backend without its emulator (read at every call)."""
    monkeypatch.delenv("MINIPAGED_CUDA_EMULATE", raising=False)
    fn, args = OPS[op]
    with pytest.raises(BackendUnavailableError, match=r"'cuda'.*MINIPAGED_CUDA_EMULATE=1"):
        fn(**args(), backend="cuda")


@pytest.mark.parametrize("op", OPS)
def test_unknown_backend_is_a_value_error(op):
    fn, args = OPS[op]
    with pytest.raises(ValueError, match=r"^backend .*'flash'"):
        fn(**args(), backend="flash")


def test_ops_do_not_import_the_memory_layer():
    code = (
        "import sys, minipaged.ops; "
        "sys.exit(any(m.startswith('minipaged.core.memory') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

"""The CPU backend's C++ kernel (``kernels/cpu/paged_attention.cpp``) against the oracle:
the whole adversarial suite (NaN in every slot it must not read), thread-count
independence, and ``"auto"`` choosing it on a CPU, or the torch reference without it."""

import pytest
import torch

from attention_cases import DECODE_CASES, AttentionSuite, make_paged_kv
from minipaged.models.resolve import resolve_backend
from minipaged.ops import BackendUnavailableError, cpu_ops, get_backend, paged_attention_decode

CPU = torch.device("cpu")


class TestCpuOps(AttentionSuite):
    backend = "cpu"


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_output_does_not_depend_on_the_thread_count(threads):
    # Each (row, KV head) is summed by one thread in order, so a seeded request samples
    # the same tokens however many cores serve it.
    case = DECODE_CASES[7]
    g = torch.Generator().manual_seed(0)
    kv = make_paged_kv(case, g, "cpu")
    query = torch.randn(len(case.context_lens), 8, case.head_dim, generator=g).to(case.dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, case.scale)
    threads(1)
    one = paged_attention_decode(*args, backend="cpu")
    threads(2)
    two = paged_attention_decode(*args, backend="cpu")
    assert torch.equal(one, two)


def test_auto_picks_the_kernel_on_a_cpu():
    assert resolve_backend("auto", CPU) == "cpu"


def test_without_the_kernel_auto_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_unavailable", lambda: "no C++ compiler")
    with pytest.raises(BackendUnavailableError, match="no C\\+\\+ compiler"):
        get_backend("cpu", CPU)
    assert resolve_backend("auto", CPU) == "torch"


def test_refuses_cuda_tensors():
    with pytest.raises(BackendUnavailableError, match="runs on the CPU, not cuda"):
        get_backend("cpu", torch.device("cuda"))

"""Adversarial attention cases, shared by the tests of every backend.

A backend's test file reuses the whole suite by subclassing ``AttentionSuite``::

    class TestTritonOps(AttentionSuite):
        backend = "triton"

Each case draws dense per-sequence K/V, which the oracle reads, and copies it into a
paged cache, which the op reads.  The paged copy is built to trip a careless kernel:

- physical blocks are handed out in a random order, with spare blocks nobody owns;
- sequences may share physical blocks for a common prefix (as after a fork, §4.4);
- every slot no sequence owns holds NaN: unused blocks, the tail of each last block,
  and the spare block that every block-table padding entry points at.  A kernel that
  reads one of them, even to multiply it by a zero weight, returns NaN.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from minipaged.core.memory.block_table import slot_mapping
from minipaged.ops import (
    cpu_ops,
    decode_oracle,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_oracle,
    write_kv,
)
from minipaged.ops.testing import assert_close

NUM_HEADS = 8
SPARE_BLOCKS = 3


@dataclass(frozen=True)
class Case:
    """One batch: ``context_lens[b]`` tokens of sequence ``b`` are in the cache."""

    context_lens: tuple[int, ...]
    block_size: int
    num_kv_heads: int = NUM_HEADS
    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    new_lens: tuple[int, ...] | None = None  # prefill: new tokens at the end of each sequence
    shared_blocks: int = 0  # leading blocks that all sequences share physically
    # >1 sharpens the softmax towards one-hot: scores of ~100 overflow exp() in any
    # kernel that forgets to subtract the max.  Only in fp16, as fp32 rounding of such
    # scores already costs more than the fp32 tolerance.
    scale_mult: float = 1.0

    @property
    def scale(self) -> float:
        return self.scale_mult / math.sqrt(self.head_dim)

    def __str__(self) -> str:
        parts = [f"bs{self.block_size}", "L" + ",".join(map(str, self.context_lens))]
        if self.new_lens is not None:
            parts.append("new" + ",".join(map(str, self.new_lens)))
        parts += [
            f"gqa{NUM_HEADS // self.num_kv_heads}",
            f"d{self.head_dim}",
            str(self.dtype).removeprefix("torch."),
        ]
        if self.shared_blocks:
            parts.append(f"shared{self.shared_blocks}")
        if self.scale_mult != 1.0:
            parts.append(f"sharp{self.scale_mult:g}")
        return "-".join(parts)


f16 = torch.float16

DECODE_CASES = [
    Case((1,), block_size=16),
    Case((7, 33, 129, 16), block_size=16, num_kv_heads=4),
    Case((1, 7, 33), block_size=1, head_dim=128),
    Case((129, 5, 64), block_size=8, num_kv_heads=2, head_dim=128, dtype=f16),
    Case((33, 100, 1), block_size=32, num_kv_heads=1, dtype=f16),
    Case((32, 64, 31, 129), block_size=32),
    Case((3, 17, 48, 90, 1, 129, 64, 65), block_size=16, num_kv_heads=2, dtype=f16),
    Case((40, 43, 47), block_size=8, num_kv_heads=4, shared_blocks=4),
    Case((129, 129), block_size=16, head_dim=128, dtype=f16, shared_blocks=8),
    Case((33, 70), block_size=16, num_kv_heads=2, dtype=f16, scale_mult=30.0),
]

PREFILL_CASES = [
    Case((7, 33, 129), block_size=16, new_lens=(7, 33, 129)),
    Case((40, 129), block_size=8, num_kv_heads=4, head_dim=128, new_lens=(8, 33)),
    Case((1, 33, 129), block_size=16, num_kv_heads=2, dtype=f16, new_lens=(1, 1, 1)),
    Case((5, 77, 129, 64, 9), block_size=32, num_kv_heads=1, dtype=f16, new_lens=(5, 1, 60, 17, 0)),
    Case((7, 20), block_size=1, head_dim=128, new_lens=(7, 3)),
    Case((50, 60), block_size=16, num_kv_heads=2, shared_blocks=2, new_lens=(18, 28)),
    Case((129,), block_size=32, num_kv_heads=4, head_dim=128, dtype=f16, new_lens=(129,)),
    Case((33, 70), block_size=8, num_kv_heads=2, dtype=f16, scale_mult=30.0, new_lens=(33, 20)),
    # Speculative decoding's verification: a last token and k guesses (2 to 9 queries)
    # on a long paged context, crossing a block boundary (41..49 over 48) or not.
    Case((21, 50, 67), block_size=16, num_kv_heads=2, shared_blocks=1, new_lens=(5, 9, 2)),
]

# Contexts longer than the C++ CPU kernel's partitions (256 positions, merged by a
# reduce) and prefills longer than its tiles (16 query rows); only the CPU kernel's
# tests run them, the others' interpreters and emulators would take minutes.
LONG_DECODE_CASES = [
    Case((700, 3, 257), block_size=16, num_kv_heads=2),
    Case((1030,), block_size=32, num_kv_heads=1, head_dim=128, shared_blocks=4),
]
LONG_PREFILL_CASES = [
    Case((600, 40), block_size=16, num_kv_heads=2, new_lens=(45, 40)),
    Case((300,), block_size=8, num_kv_heads=4, head_dim=128, new_lens=(300,)),
]


@dataclass
class PagedKV:
    """The same K/V twice: dense per sequence (for the oracle) and paged (for the op)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def make_paged_kv(case: Case, generator: torch.Generator, device: str) -> PagedKV:
    """Draw each sequence's K/V and scatter it over a shuffled, NaN-filled block pool."""
    bs, shared = case.block_size, case.shared_blocks
    shape = (case.num_kv_heads, case.head_dim)
    assert all(length >= shared * bs for length in case.context_lens)

    def randn(length):
        return torch.randn(length, *shape, generator=generator).to(case.dtype)

    prefix_k, prefix_v = randn(shared * bs), randn(shared * bs)
    keys = [torch.cat([prefix_k, randn(n - shared * bs)]) for n in case.context_lens]
    values = [torch.cat([prefix_v, randn(n - shared * bs)]) for n in case.context_lens]

    own_blocks = [math.ceil(n / bs) - shared for n in case.context_lens]
    num_blocks = shared + sum(own_blocks) + SPARE_BLOCKS
    free = torch.randperm(num_blocks, generator=generator).tolist()
    shared_ids, free = free[:shared], free[shared:]
    tables = []
    for n in own_blocks:
        tables.append(shared_ids + free[:n])
        free = free[n:]
    width = max(map(len, tables)) + 1  # every row ends in padding
    padded = [table + [free[0]] * (width - len(table)) for table in tables]

    key_cache = torch.full((num_blocks, bs, *shape), float("nan"), dtype=case.dtype)
    value_cache = key_cache.clone()
    for table, k, v in zip(tables, keys, values):
        for i, block in enumerate(table):
            chunk = slice(i * bs, (i + 1) * bs)
            key_cache[block, : len(k[chunk])] = k[chunk]
            value_cache[block, : len(v[chunk])] = v[chunk]
    return PagedKV(
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        context_lens=torch.tensor(case.context_lens, dtype=torch.int32, device=device),
    )


def slots_of(kv: PagedKV, block_size: int) -> torch.Tensor:
    """The slot of every token of every sequence, packed (§4.3), as the memory layer
    translates a block table (the one place it is computed)."""
    slots = []
    for table, length in zip(kv.block_tables.tolist(), kv.context_lens.tolist()):
        slots += slot_mapping(table, block_size, 0, length)
    return torch.tensor(slots, dtype=torch.int64, device=kv.key_cache.device)


# (num_tokens, block_size, num_kv_heads, head_dim, dtype, fraction of slots that are -1)
WRITE_CASES = [
    (10, 1, 1, 64, torch.float32, 0.3),
    (40, 16, 4, 128, torch.float16, 0.25),
    (70, 32, 8, 64, torch.float32, 0.0),
    (12, 8, 2, 64, torch.float16, 1.0),
    (0, 16, 2, 64, torch.float32, 0.0),
]


class AttentionSuite:
    """Every backend must pass these; subclasses set ``backend`` (and maybe ``device``)."""

    backend = "torch"
    device = "cpu"

    def decodes(self, case: Case) -> bool:
        """Whether the backend's decode is built for ``case``'s shapes; a compiled backend
        (CUDA) overrides this, and must then refuse the others with a ``ValueError``."""
        return True

    @pytest.mark.parametrize("case", DECODE_CASES, ids=str)
    def test_decode_matches_oracle(self, case):
        g = torch.Generator().manual_seed(0)
        kv = make_paged_kv(case, g, self.device)
        query = self._randn(g, len(case.context_lens), case)
        args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, case.scale)
        if not self.decodes(case):
            with pytest.raises(ValueError, match="block_size|head_dim"):
                paged_attention_decode(*args, backend=self.backend)
            return
        out = paged_attention_decode(*args, backend=self.backend)
        assert out.dtype == query.dtype
        assert_close(out, decode_oracle(query, kv.keys, kv.values, case.scale))

    @pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
    def test_prefill_matches_oracle(self, case):
        g = torch.Generator().manual_seed(0)
        kv = make_paged_kv(case, g, self.device)
        query = self._randn(g, sum(case.new_lens), case)
        starts = torch.tensor([0, *case.new_lens], device=self.device).cumsum(0)
        starts = starts.to(torch.int32)
        out = paged_attention_prefill(
            query,
            kv.key_cache,
            kv.value_cache,
            kv.block_tables,
            starts,
            kv.context_lens,
            case.scale,
            backend=self.backend,
        )
        assert out.dtype == query.dtype
        assert_close(out, prefill_oracle(query, starts, kv.keys, kv.values, case.scale))

    @pytest.mark.parametrize(
        "num_tokens, block_size, num_kv_heads, head_dim, dtype, skip", WRITE_CASES
    )
    def test_write_kv_scatters_and_skips(
        self, num_tokens, block_size, num_kv_heads, head_dim, dtype, skip
    ):
        g = torch.Generator().manual_seed(0)
        num_blocks = math.ceil(num_tokens / block_size) + 2
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_cache = torch.randn(cache_shape, generator=g).to(dtype)
        value_cache = torch.randn(cache_shape, generator=g).to(dtype)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
        slots[torch.rand(num_tokens, generator=g) < skip] = -1

        expected_k, expected_v = key_cache.clone(), value_cache.clone()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                expected_k[s // block_size, s % block_size] = key[t]
                expected_v[s // block_size, s % block_size] = value[t]
        dev = self.device
        key_cache, value_cache = key_cache.to(dev), value_cache.to(dev)
        write_kv(
            key.to(dev),
            value.to(dev),
            key_cache,
            value_cache,
            slots.to(torch.int32).to(dev),
            backend=self.backend,
        )
        assert torch.equal(key_cache.cpu(), expected_k)
        assert torch.equal(value_cache.cpu(), expected_v)

    @pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[7]], ids=str)
    def test_write_kv_fills_what_block_tables_read(self, case):
        """Writing every token at its slot (§4.3) rebuilds the paged cache exactly."""
        kv = make_paged_kv(case, torch.Generator().manual_seed(0), self.device)
        key_cache = torch.full_like(kv.key_cache, float("nan"))
        value_cache = torch.full_like(kv.value_cache, float("nan"))
        write_kv(
            torch.cat(kv.keys),
            torch.cat(kv.values),
            key_cache,
            value_cache,
            slots_of(kv, case.block_size),
            backend=self.backend,
        )
        torch.testing.assert_close(key_cache, kv.key_cache, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(value_cache, kv.value_cache, rtol=0, atol=0, equal_nan=True)

    def _randn(self, g, num_tokens, case):
        q = torch.randn(num_tokens, NUM_HEADS, case.head_dim, generator=g)
        return q.to(case.dtype).to(self.device)


def real_paged_kv(
    batch, context_len, dtype, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16
):
    """Real sizes on the GPU: a pool of shuffled blocks, a query per sequence, and each
    sequence's dense K/V read back through plain tensor indexing for the oracle."""
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = batch * blocks_per_seq + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    value_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device="cuda")
    tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    keys = [key_cache[t].flatten(0, 1)[:context_len] for t in tables.long()]
    values = [value_cache[t].flatten(0, 1)[:context_len] for t in tables.long()]
    lens = torch.full((batch,), context_len, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_heads, head_dim, generator=g, device="cuda").to(dtype)
    return query, key_cache, value_cache, tables, lens, keys, values


# The C++ CPU kernel's instruction sets the tests run: the machine's best two (AVX-512 and
# AVX2 on an AVX-512 CPU, AVX2 and plain C++ on an AVX2 one), each built once.
CPU_ISAS = cpu_ops.machine_isas()[:2]
CPU_BACKENDS = [f"cpu-{isa}" for isa in CPU_ISAS]


def use_backend(backend: str, monkeypatch) -> str:
    """The op's backend for a test's ``backend``: ``"cpu-avx2"`` is ``"cpu"`` with the
    kernel built for AVX2 (`cpu_ops.ISA_ENV`), any other name itself."""
    name, _, isa = backend.partition("-")
    if name == "cpu" and isa:
        monkeypatch.setenv(cpu_ops.ISA_ENV, isa)
    return name


def refusal_on_cpu(backend: str, without: str) -> str:
    """What ``get_backend(backend, cpu)`` raises in a fresh interpreter whose environment
    lacks the variable ``without`` (the switch that lets the backend run on a CPU)."""
    code = (
        "import torch\n"
        "from minipaged.ops import BackendUnavailableError, get_backend\n"
        "try:\n"
        f"    get_backend({backend!r}, torch.device('cpu'))\n"
        "except BackendUnavailableError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != without}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout

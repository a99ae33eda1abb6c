"""Contiguous (Orca-style) reservation and the memory-waste simulation of lesson 00.

The simulation is checked on workloads small enough to work out by hand.
"""

import pytest

from minipaged.core.memory.contiguous import ContiguousAllocator, reservation_size
from minipaged.core.memory.simulate import SYSTEMS, simulate_memory
from minipaged.core.memory.workloads import RequestSpec, synthetic_requests


@pytest.mark.parametrize(
    "policy, prompt, output, expected",
    [
        ("max", 3, 4, 64),
        ("oracle", 3, 4, 7),
        ("pow2", 3, 4, 8),
        ("pow2", 4, 4, 8),
        ("pow2", 4, 5, 16),
        ("pow2", 40, 30, 64),  # 128 capped at max_len
    ],
)
def test_reservation_size(policy, prompt, output, expected):
    assert reservation_size(policy, prompt, output, max_len=64) == expected


def test_reservation_size_rejects_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        reservation_size("greedy", 1, 1, 8)


def test_first_fit_fills_the_lowest_gap_and_release_merges():
    pool = ContiguousAllocator(10)
    assert [pool.reserve(3), pool.reserve(3), pool.reserve(3)] == [0, 3, 6]
    assert pool.reserve(2) is None  # one slot left
    pool.release(3)
    assert pool.gaps() == [(3, 3), (9, 1)]
    assert pool.reserve(1) == 3  # first fit: the lowest gap that is big enough
    pool.release(0)
    pool.release(6)
    assert pool.gaps() == [(0, 3), (4, 6)]
    assert pool.reserve(6) == 4
    assert pool.num_reserved_slots == 7


def test_contiguous_allocator_errors():
    pool = ContiguousAllocator(4)
    with pytest.raises(ValueError, match="size"):
        pool.reserve(0)
    start = pool.reserve(2)
    with pytest.raises(ValueError, match="start"):
        pool.release(start + 1)
    assert pool.gaps() == [(2, 2)]


def test_oracle_by_hand():
    # 10 slots; A and B each end at 5 tokens.  Steps (lengths after the step):
    # 1: A=3 B=4 -> 7 tokens, 3 reserved; 2: A=4 B=5 -> 9 tokens, 1 reserved (B ends);
    # 3: A=5 -> 5 tokens.  Nobody ever waits, so every step counts.
    requests = [RequestSpec(2, 3), RequestSpec(3, 2)]
    r = simulate_memory(requests, "contiguous-oracle", num_slots=10)
    assert r.num_steps == 3
    assert r.token_share == pytest.approx((7 + 9 + 5) / 30)
    assert r.reserved_share == pytest.approx((3 + 1 + 0) / 30)
    assert r.internal_share == 0 and r.external_share == 0
    assert r.max_batch == pytest.approx(5 / 3)


def test_external_fragmentation_by_hand():
    # 10 slots, oracle reservations placed first fit: A [0,4), B [4,7), C [7,10).
    # D (5 slots) waits.  Lengths after each step:
    # 1: A=4 B=2 C=2 -> 8 tokens, 1 + 1 reserved, no gap at all; A ends: a hole [0,4).
    # 2: B=3 C=3 -> 6 tokens; the hole of 4 < 5 is external fragmentation; B, C end.
    # 3: D is admitted and ends at 5 tokens; nobody waits, so step 3 is not averaged.
    requests = [RequestSpec(3, 1), RequestSpec(1, 2), RequestSpec(1, 2), RequestSpec(4, 1)]
    r = simulate_memory(requests, "contiguous-oracle", num_slots=10)
    assert r.num_steps == 3
    assert r.token_share == pytest.approx((8 + 6) / 20)
    assert r.reserved_share == pytest.approx((2 + 0) / 20)
    assert r.external_share == pytest.approx((0 + 4) / 20)
    assert r.max_batch == pytest.approx((3 + 2) / 2)


def test_paged_preemption_by_hand():
    # Block size 2, 4 blocks.  A and B: prompt 3, output 2.
    # Step 1: both admitted (2 blocks each), grow to 4 tokens.  Pool full, nobody waits.
    # Step 2: A needs a 3rd block; B (the newest) is preempted; A grows to 5 tokens in
    #         3 blocks (1 slot internal) and ends.  B waits: a saturated step.
    # Step 3: B is admitted again with its 4 tokens and grows to 5.
    requests = [RequestSpec(3, 2), RequestSpec(3, 2)]
    r = simulate_memory(requests, "paged", num_slots=8, block_size=2)
    assert (r.num_steps, r.num_preemptions) == (3, 1)
    assert r.token_share == pytest.approx(5 / 8)
    assert r.internal_share == pytest.approx(1 / 8)
    assert r.max_batch == 1


def test_paper_shape_on_a_sharegpt_like_workload():
    # Fig. 2: contiguous systems keep 20.4-38.2% of KV memory as token states, vLLM 96.3%.
    requests = synthetic_requests("sharegpt", 200, seed=3)
    reports = {s: simulate_memory(requests, s, num_slots=15_700) for s in SYSTEMS}
    assert reports["paged"].token_share > 0.9
    assert all(reports[s].token_share < 0.6 for s in SYSTEMS if s != "paged")
    assert reports["paged"].reserved_share == reports["paged"].external_share == 0
    assert reports["contiguous-oracle"].internal_share == 0
    for r in reports.values():
        parts = r.token_share + r.reserved_share + r.internal_share + r.external_share
        assert 0 < parts <= 1 + 1e-9
    batch = {s: r.max_batch for s, r in reports.items()}
    assert (
        batch["paged"]
        > batch["contiguous-oracle"]
        > batch["contiguous-pow2"]
        > batch["contiguous-max"]
    )


@pytest.mark.parametrize(
    "system, kwargs, name",
    [
        ("orca", {}, "system"),
        ("contiguous-max", dict(max_len=4096), "num_slots"),
        ("paged", dict(block_size=16), "num_slots"),
    ],
)
def test_simulation_rejects_impossible_setups(system, kwargs, name):
    requests = [RequestSpec(1000, 1000)]
    with pytest.raises(ValueError, match=name):
        simulate_memory(requests, system, num_slots=1500, **kwargs)

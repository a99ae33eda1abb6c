"""Lesson 01 — the block allocator (paper §4.2): a fixed pool, a free list, ref counts.

Every test compares the allocator with an independent model: a dict of reference
counts kept by the test itself.  Errors must be clear *and* change nothing.
"""

import random

import pytest

from minipaged.core.memory import (
    BlockAllocator,
    KVCacheManager,
    NoFreeBlocksError,
    PrefixCachingBlockAllocator,
)

# The plain pool and the prefix-caching pool must both honour the allocator contract
# (a prefix-caching pool with nothing registered behaves exactly like a plain one).
POOLS = {
    "plain": lambda n, device="gpu": BlockAllocator(n, device),
    "prefix": lambda n, device="gpu": PrefixCachingBlockAllocator(n, 4, device),
}


@pytest.fixture(params=sorted(POOLS))
def make_pool(request):
    return POOLS[request.param]


def state(pool):
    """Everything an operation could change."""
    return (
        pool.num_free_blocks,
        pool.num_used_blocks,
        list(pool._free),
        [pool.ref_count(b) for b in range(pool.num_blocks)],
    )


def check_against_model(pool, refs):
    """``refs``: the test's own record of block -> holders (absent = free)."""
    for block in range(pool.num_blocks):
        assert pool.ref_count(block) == refs.get(block, 0), block
    assert pool.num_free_blocks == pool.num_blocks - len(refs)
    assert pool.num_used_blocks == len(refs)
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


def test_new_pool_is_all_free(make_pool):
    pool = make_pool(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 0
    assert all(pool.ref_count(b) == 0 for b in range(5))


def test_allocate_hands_out_every_block_once_then_raises(make_pool):
    pool = make_pool(6)
    got = [pool.allocate() for _ in range(6)]
    assert sorted(got) == list(range(6))  # each block of the pool exactly once
    assert all(pool.ref_count(b) == 1 for b in got)
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 6
    before = state(pool)
    with pytest.raises(NoFreeBlocksError, match="no free block"):
        pool.allocate()
    assert state(pool) == before


def test_allocate_from_empty_pool_names_the_device(make_pool):
    for device in ("gpu", "cpu"):
        pool = make_pool(0, device)
        with pytest.raises(NoFreeBlocksError) as info:
            pool.allocate()
        assert device in str(info.value)
        assert pool.num_free_blocks == 0


def test_no_free_blocks_error_is_distinguishable_from_misuse():
    # The scheduler catches "pool full" to preempt; misuse must not look like that.
    assert not issubclass(NoFreeBlocksError, ValueError)
    assert not issubclass(ValueError, NoFreeBlocksError)


def test_freed_block_is_reused(make_pool):
    pool = make_pool(3)
    a, b, c = (pool.allocate() for _ in range(3))
    pool.free(b)
    assert pool.num_free_blocks == 1 and pool.ref_count(b) == 0
    assert pool.allocate() == b  # the only free block
    assert pool.ref_count(b) == 1
    assert {a, c} | {b} == {0, 1, 2}


def test_ref_counts_keep_a_block_until_its_last_holder_frees_it(make_pool):
    pool = make_pool(2)
    block = pool.allocate()
    pool.incref(block)
    pool.incref(block)
    assert pool.ref_count(block) == 3
    pool.free(block)
    pool.free(block)
    assert pool.ref_count(block) == 1
    assert pool.num_free_blocks == 1  # still held by one
    pool.free(block)
    assert pool.ref_count(block) == 0
    assert pool.num_free_blocks == 2


def test_double_free_raises_and_changes_nothing(make_pool):
    pool = make_pool(4)
    a = pool.allocate()
    b = pool.allocate()
    pool.free(a)
    before = state(pool)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(a)
    assert state(pool) == before
    assert pool.ref_count(b) == 1


def test_freeing_a_never_allocated_block_raises_and_changes_nothing(make_pool):
    pool = make_pool(4)
    pool.allocate()
    before = state(pool)
    with pytest.raises(ValueError, match=r"block 3"):
        pool.free(3)
    assert state(pool) == before


@pytest.mark.parametrize("bad", [-1, 4, 100, "1", 1.0, None])
def test_freeing_an_unknown_block_raises_and_changes_nothing(make_pool, bad):
    pool = make_pool(4)
    for _ in range(4):
        pool.allocate()
    before = state(pool)
    with pytest.raises(ValueError, match="block"):
        pool.free(bad)
    with pytest.raises(ValueError):
        pool.incref(bad)
    with pytest.raises(ValueError):
        pool.ref_count(bad)
    assert state(pool) == before


def test_incref_of_a_free_block_raises_and_changes_nothing(make_pool):
    pool = make_pool(3)
    pool.allocate()
    before = state(pool)
    with pytest.raises(ValueError, match="incref"):
        pool.incref(2)
    assert state(pool) == before


@pytest.mark.parametrize("bad", [-1, 2.0, "3", None])
def test_pool_size_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)


def test_gpu_and_cpu_pools_are_separate():
    mgr = KVCacheManager(num_gpu_blocks=3, block_size=2, num_cpu_blocks=5)
    assert (mgr.gpu.device, mgr.cpu.device) == ("gpu", "cpu")
    assert (mgr.gpu.num_blocks, mgr.cpu.num_blocks) == (3, 5)
    for _ in range(3):
        mgr.gpu.allocate()
    assert mgr.cpu.num_free_blocks == 5  # the CPU pool is untouched
    with pytest.raises(NoFreeBlocksError, match="gpu"):
        mgr.gpu.allocate()
    cpu_block = mgr.cpu.allocate()
    assert mgr.cpu.num_free_blocks == 4 and mgr.gpu.num_free_blocks == 0
    mgr.cpu.free(cpu_block)
    with pytest.raises(ValueError, match="cpu"):
        mgr.cpu.free(cpu_block)


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_match_a_reference_count_model(make_pool, seed):
    rng = random.Random(seed)
    pool = make_pool(rng.randint(0, 12))
    refs: dict[int, int] = {}
    for _ in range(300):
        op = rng.choice(["allocate", "incref", "free", "free_bad"])
        before = state(pool)
        if op == "allocate":
            if len(refs) == pool.num_blocks:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate()
                assert state(pool) == before
            else:
                block = pool.allocate()
                assert block not in refs and 0 <= block < pool.num_blocks
                refs[block] = 1
        elif op == "incref" and refs:
            block = rng.choice(sorted(refs))
            pool.incref(block)
            refs[block] += 1
        elif op == "free" and refs:
            block = rng.choice(sorted(refs))
            pool.free(block)
            refs[block] -= 1
            if refs[block] == 0:
                del refs[block]
        elif op == "free_bad":
            unheld = [b for b in range(-1, pool.num_blocks + 1) if b not in refs]
            with pytest.raises(ValueError):
                pool.free(rng.choice(unheld))
            assert state(pool) == before
        check_against_model(pool, refs)

"""Lesson 02 — block tables and slot mapping (paper §4.2, §4.3).

The oracle for a slot is computed here, from the design's definition:
token ``p`` lives in slot ``blocks[p // bs] * bs + p % bs``.
"""

import random

import pytest

from minipaged.core.memory import BlockAllocator, BlockTable, NoFreeBlocksError
from minipaged.core.memory.prefix_cache import PrefixCachingBlockAllocator


def ceil_div(a, b):
    return -(-a // b)


def expected_slots(blocks, bs, start, end):
    return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


def table_state(table):
    return (list(table.blocks), list(table.token_ids), list(table.identities))


def pool_state(pool):
    return (list(pool._free), [pool.ref_count(b) for b in range(pool.num_blocks)])


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", None])
def test_block_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(bad, BlockAllocator(4))


@pytest.mark.parametrize("bs", [1, 2, 3, 4, 16])
def test_one_token_at_a_time_takes_a_block_only_when_the_last_is_full(bs):
    pool = BlockAllocator(40)
    table = BlockTable(bs, pool)
    for n in range(3 * bs + 2):
        free_before = pool.num_free_blocks
        last_full = n % bs == 0  # empty table, or last block full
        assert table.num_blocks_needed(1) == int(last_full)
        slots, copies = table.append_tokens([100 + n])
        assert copies == []
        assert pool.num_free_blocks == free_before - int(last_full)
        assert len(table.blocks) == ceil_div(n + 1, bs)
        assert slots == expected_slots(table.blocks, bs, n, n + 1)
        assert table.num_tokens == n + 1
    assert table.token_ids == [100 + n for n in range(3 * bs + 2)]


@pytest.mark.parametrize(
    "bs,first,second",
    [(4, 0, 9), (4, 3, 1), (4, 4, 4), (4, 5, 11), (1, 3, 3), (3, 2, 7), (16, 15, 2)],
)
def test_bulk_append_allocates_exactly_the_blocks_it_needs(bs, first, second):
    pool = BlockAllocator(20)
    table = BlockTable(bs, pool)
    s1, _ = table.append_tokens(list(range(first)))
    need = ceil_div(first + second, bs) - ceil_div(first, bs)
    assert table.num_blocks_needed(second) == need
    free_before = pool.num_free_blocks
    s2, copies = table.append_tokens(list(range(first, first + second)))
    assert copies == []
    assert free_before - pool.num_free_blocks == need
    assert len(table.blocks) == ceil_div(first + second, bs)
    assert s1 == expected_slots(table.blocks, bs, 0, first)
    assert s2 == expected_slots(table.blocks, bs, first, first + second)
    assert table.slot_mapping(0, first + second) == s1 + s2
    assert all(pool.ref_count(b) == 1 for b in table.blocks)


def test_appending_nothing_changes_nothing():
    pool = BlockAllocator(4)
    table = BlockTable(4, pool)
    assert table.append_tokens([]) == ([], [])
    assert table.blocks == [] and pool.num_free_blocks == 4
    table.append_tokens([1, 2, 3, 4])
    before = (table_state(table), pool_state(pool))
    assert table.num_blocks_needed(0) == 0
    assert table.append_tokens([]) == ([], [])
    assert (table_state(table), pool_state(pool)) == before


def test_interleaved_tables_get_scattered_blocks_and_distinct_slots():
    """Physical blocks end up in arbitrary order; slots never collide across tables."""
    rng = random.Random(7)
    bs = 4
    pool = BlockAllocator(64)
    tables = [BlockTable(bs, pool) for _ in range(5)]
    written = {i: [] for i in range(5)}  # per table: slots in token order
    for step in range(120):
        i = rng.randrange(5)
        n = rng.randint(1, 6)
        if tables[i].num_blocks_needed(n) > pool.num_free_blocks:
            continue
        start = tables[i].num_tokens
        slots, _ = tables[i].append_tokens([step] * n)
        assert slots == expected_slots(tables[i].blocks, bs, start, start + n)
        written[i] += slots
    live = [s for i in range(5) for s in written[i]]
    assert len(live) == len(set(live))  # no two tokens share a slot
    for i, table in enumerate(tables):
        assert written[i] == expected_slots(table.blocks, bs, 0, table.num_tokens)
        assert all(s // bs in table.blocks for s in written[i])
    # Logical order is not physical order: some table's blocks are not consecutive.
    assert any(
        t.blocks != list(range(t.blocks[0], t.blocks[0] + len(t.blocks)))
        for t in tables
        if t.blocks
    )
    assert sorted(b for t in tables for b in t.blocks) == sorted(
        set(b for t in tables for b in t.blocks)
    )


def test_slot_mapping_follows_shuffled_physical_blocks():
    """Slot mapping is a pure function of the block table, whatever the ids are."""
    bs = 3
    pool = BlockAllocator(12)
    for _ in range(12):
        pool.allocate()
    order = [7, 2, 11, 0, 5]
    for b in reversed(order):  # the free list is a stack: the last freed comes out first
        pool.free(b)
    table = BlockTable(bs, pool)
    table.append_tokens(list(range(14)))
    assert table.blocks == order
    assert table.slot_mapping(0, 14) == [
        7 * 3,
        7 * 3 + 1,
        7 * 3 + 2,
        2 * 3,
        2 * 3 + 1,
        2 * 3 + 2,
        11 * 3,
        11 * 3 + 1,
        11 * 3 + 2,
        0,
        1,
        2,
        5 * 3,
        5 * 3 + 1,
    ]
    assert [table.slot(p) for p in range(14)] == table.slot_mapping(0, 14)


@pytest.mark.parametrize("have,free,ask", [(0, 0, 1), (0, 1, 5), (4, 0, 1), (4, 1, 5), (2, 1, 7)])
def test_append_that_does_not_fit_raises_and_changes_nothing(have, free, ask):
    bs = 4
    pool = BlockAllocator(ceil_div(have, bs) + free)
    table = BlockTable(bs, pool)
    table.append_tokens(list(range(have)))
    assert pool.num_free_blocks == free
    need = ceil_div(have + ask, bs) - ceil_div(have, bs)
    assert need > free  # the case is built not to fit
    assert table.num_blocks_needed(ask) == need
    before = (table_state(table), pool_state(pool))
    with pytest.raises(NoFreeBlocksError, match=f"needs {need} blocks"):
        table.append_tokens(list(range(ask)))
    assert (table_state(table), pool_state(pool)) == before


def test_append_that_exactly_fits_uses_the_last_block():
    pool = BlockAllocator(2)
    table = BlockTable(4, pool)
    table.append_tokens([1, 2, 3, 4, 5])
    slots, _ = table.append_tokens([6, 7, 8])  # fills block 2, needs nothing new
    assert pool.num_free_blocks == 0
    assert slots == expected_slots(table.blocks, 4, 5, 8)
    with pytest.raises(NoFreeBlocksError):
        table.append_tokens([9])


def test_free_returns_every_block_and_empties_the_table():
    pool = BlockAllocator(10)
    a, b = BlockTable(2, pool), BlockTable(2, pool)
    a.append_tokens(list(range(7)))
    b.append_tokens(list(range(3)))
    b_blocks = list(b.blocks)
    a.free()
    assert a.blocks == [] and a.token_ids == [] and a.num_tokens == 0
    assert pool.num_free_blocks == 10 - len(b_blocks)
    assert all(pool.ref_count(x) == 1 for x in b_blocks)
    # The freed table can start again from scratch.
    slots, _ = a.append_tokens([42, 43, 44])
    assert slots == expected_slots(a.blocks, 2, 0, 3)
    a.free()
    b.free()
    assert pool.num_free_blocks == 10
    assert all(pool.ref_count(x) == 0 for x in range(10))


def test_free_releases_tail_first():
    """The order matters for prefix caching (tails evicted before parents)."""
    released = []

    class Recording(BlockAllocator):
        def _release(self, block):
            released.append(block)
            super()._release(block)

    pool = Recording(8)
    table = BlockTable(2, pool)
    table.append_tokens(list(range(7)))
    blocks = list(table.blocks)
    table.free()
    assert released == blocks[::-1]


def test_blocks_filled_one_decode_token_at_a_time_become_findable_prefixes():
    pool = PrefixCachingBlockAllocator(8, 4)
    table = BlockTable(4, pool)
    tokens = [5, 3, 8, 1, 9, 9, 2, 7, 4, 6]
    for n, token in enumerate(tokens):
        table.append_tokens([token])
        full = (n + 1) // 4
        found = pool.match_prefix(tokens)
        assert [e.block for e in found] == table.blocks[:full], f"after {n + 1} tokens"


def assert_room_is_the_private_free_tail(table, pool, bs):
    """``room`` (a decode's fast path) is 0 or the free slots of a last block the table
    alone holds, and ``next_slot`` is then the slot of the next position (the oracle)."""
    free = len(table.blocks) * bs - table.num_tokens
    if table.room:
        assert table.room == free
        assert pool.ref_counts[table.blocks[-1]] == 1
        n = table.num_tokens
        assert table.next_slot == expected_slots(table.blocks, bs, n, n + 1)[0]


@pytest.mark.parametrize("caching", [False, True])
def test_fast_decode_path_matches_the_slot_oracle_through_forks_truncates_and_frees(caching):
    bs, rng = 4, random.Random(7)
    pool = PrefixCachingBlockAllocator(64, bs) if caching else BlockAllocator(64)
    tables = [BlockTable(bs, pool)]
    for _ in range(400):
        table = rng.choice(tables)
        op = rng.random()
        if op < 0.6 or not table.blocks:  # a decode: the fast path when it has room
            n, token = table.num_tokens, rng.randrange(3)
            if table.room > 1:
                slot = table.take_slot(token)
            else:
                slot = table.append_tokens([token])[0][0]
            assert slot == expected_slots(table.blocks, bs, n, n + 1)[0]
            assert table.token_ids[-1] == token
        elif op < 0.7:
            table.append_tokens([rng.randrange(3) for _ in range(rng.randrange(1, 7))])
        elif op < 0.8 and len(tables) < 6:
            tables.append(table.fork())
        elif op < 0.9:
            lowest = len(table.identities) * bs
            table.truncate(rng.randrange(lowest, table.num_tokens + 1))
        else:
            table.free()
        for t in tables:
            assert_room_is_the_private_free_tail(t, pool, bs)
    # Distinct live tables never share a slot they may still write (copy-on-write).
    writable = [t.next_slot for t in tables if t.room]
    assert len(writable) == len(set(writable))

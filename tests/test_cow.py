"""Lesson 03 — fork and copy-on-write (paper §4.4): parallel sampling and beam search.

The oracle is a shadow of the cache engine (``memory_shadow.Shadow``): a dict slot ->
"the KV of which token with which prefix is stored here".  The test carries out every
slot mapping and every ``(src, dst)`` copy the memory layer returns, exactly as the cache
engine would, and then reads each sequence back through its block table.  Wrong sharing,
a missing copy or a write into a shared block shows up as a sequence reading someone
else's KV.
"""

import random

import pytest

from memory_shadow import Shadow, ceil_div
from minipaged.core.memory import BlockAllocator, BlockTable, KVCacheManager, NoFreeBlocksError


def pool_state(pool):
    return (list(pool._free), [pool.ref_count(b) for b in range(pool.num_blocks)])


def forked(num_blocks, num_tokens, bs=4):
    """A pool, a table holding tokens ``0 .. num_tokens - 1``, and a fork of it."""
    pool = BlockAllocator(num_blocks)
    parent = BlockTable(bs, pool)
    parent.append_tokens(list(range(num_tokens)))
    return pool, parent, parent.fork()


# -- block-table level ------------------------------------------------------------------


def test_fork_shares_every_block_and_allocates_nothing():
    pool = BlockAllocator(8)
    parent = BlockTable(4, pool)
    parent.append_tokens(list(range(10)))
    free_before = pool.num_free_blocks
    child = parent.fork()
    assert child.blocks == parent.blocks and child.blocks is not parent.blocks
    assert child.token_ids == parent.token_ids and child.token_ids is not parent.token_ids
    assert all(pool.ref_count(b) == 2 for b in parent.blocks)
    assert pool.num_free_blocks == free_before
    grandchild = child.fork()
    assert all(pool.ref_count(b) == 3 for b in parent.blocks)
    assert grandchild.blocks == parent.blocks


def test_fork_of_an_empty_table():
    pool = BlockAllocator(2)
    child = BlockTable(4, pool).fork()
    assert child.blocks == [] and child.token_ids == []
    slots, copies = child.append_tokens([1])
    assert copies == [] and pool.num_free_blocks == 1


def test_append_into_a_shared_partial_block_copies_it_first():
    bs = 4
    pool, parent, child = forked(8, 6, bs)  # blocks: [full, 2 of 4]
    p_blocks, p_tokens = list(parent.blocks), list(parent.token_ids)
    shared_last = parent.blocks[-1]
    assert child.num_blocks_needed(1) == 1  # the copy, no new block
    free_before = pool.num_free_blocks
    slots, copies = child.append_tokens([99])
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == shared_last and dst != src and dst not in p_blocks
    assert child.blocks == p_blocks[:-1] + [dst]
    assert slots == [dst * bs + 2]  # position 6: offset 2 of the copy
    assert pool.num_free_blocks == free_before - 1
    assert pool.ref_count(src) == 1 and pool.ref_count(dst) == 1
    assert pool.ref_count(p_blocks[0]) == 2  # the full block stays shared
    # The other sequence is untouched.
    assert parent.blocks == p_blocks and parent.token_ids == p_tokens
    # The parent now holds its last block alone: it writes in place, no copy.
    slots, copies = parent.append_tokens([7])
    assert copies == [] and slots == [shared_last * bs + 2]


def test_append_when_the_shared_last_block_is_full_needs_no_copy():
    bs = 4
    pool, parent, child = forked(8, 8, bs)  # two full blocks
    assert child.num_blocks_needed(1) == 1  # a fresh block, no copy
    slots, copies = child.append_tokens([50, 51])
    assert copies == []
    assert child.blocks[:2] == parent.blocks
    new = child.blocks[2]
    assert new not in parent.blocks and slots == [new * bs, new * bs + 1]
    assert all(pool.ref_count(b) == 2 for b in parent.blocks)
    assert pool.ref_count(new) == 1


def test_cow_then_crossing_into_new_blocks_counts_both():
    bs = 4
    pool, parent, child = forked(10, 5, bs)  # [full, 1 of 4]
    # 9 new tokens: 3 fill the copied last block, 6 need two fresh blocks; +1 copy.
    assert child.num_blocks_needed(9) == 3
    free_before = pool.num_free_blocks
    slots, copies = child.append_tokens(list(range(100, 109)))
    assert len(copies) == 1 and free_before - pool.num_free_blocks == 3
    assert slots == [child.blocks[p // bs] * bs + p % bs for p in range(5, 14)]
    assert all(s // bs not in parent.blocks for s in slots)


def test_cow_without_a_free_block_raises_and_changes_nothing():
    bs = 4
    pool, parent, child = forked(2, 6, bs)  # uses both blocks
    before = (list(parent.blocks), list(child.blocks), list(child.token_ids), pool_state(pool))
    with pytest.raises(NoFreeBlocksError):
        child.append_tokens([1])  # would fit in the partial block, but it is shared
    assert (
        list(parent.blocks),
        list(child.blocks),
        list(child.token_ids),
        pool_state(pool),
    ) == before


def test_appending_nothing_to_a_shared_partial_block_copies_nothing():
    pool = BlockAllocator(4)
    parent = BlockTable(4, pool)
    parent.append_tokens([1, 2])
    child = parent.fork()
    before = (list(child.blocks), list(parent.blocks), pool_state(pool))
    assert child.num_blocks_needed(0) == 0
    assert child.append_tokens([]) == ([], [])
    assert (list(child.blocks), list(parent.blocks), pool_state(pool)) == before


def test_three_holders_copy_until_one_is_left():
    bs = 2
    pool = BlockAllocator(10)
    a = BlockTable(bs, pool)
    a.append_tokens([1, 2, 3])
    b, c = a.fork(), a.fork()
    last = a.blocks[-1]
    assert pool.ref_count(last) == 3
    _, copies_b = b.append_tokens([4])
    assert [src for src, _ in copies_b] == [last] and pool.ref_count(last) == 2
    _, copies_c = c.append_tokens([5])
    assert [src for src, _ in copies_c] == [last] and pool.ref_count(last) == 1
    _, copies_a = a.append_tokens([6])
    assert copies_a == []  # the last holder writes in place
    assert len({a.blocks[-1], b.blocks[-1], c.blocks[-1]}) == 3
    assert pool.ref_count(a.blocks[0]) == 3


def test_freeing_the_parent_leaves_the_child_intact():
    pool, parent, child = forked(6, 6)
    blocks = list(child.blocks)
    parent.free()
    assert child.blocks == blocks and all(pool.ref_count(b) == 1 for b in blocks)
    _, copies = child.append_tokens([9])
    assert copies == []  # sole holder now
    child.free()
    assert pool.num_free_blocks == 6


# -- parallel sampling and beam search through the manager --------------------------------


@pytest.mark.parametrize(
    "bs,prompt_len,n,steps",
    [(4, 10, 4, 6), (4, 8, 3, 5), (1, 5, 3, 4), (16, 20, 4, 30), (3, 7, 2, 9)],
)
def test_parallel_sampling_shares_the_prompt(bs, prompt_len, n, steps):
    mgr = KVCacheManager(num_gpu_blocks=64, block_size=bs)
    sh = Shadow(mgr)
    prompt = [1000 + i for i in range(prompt_len)]
    sh.allocate("s0", prompt)
    prompt_blocks = mgr.block_table("s0")
    for i in range(1, n):
        sh.fork("s0", f"s{i}")
    sh.check()
    copies_seen = []
    for step in range(steps):
        for i in range(n):  # each sample draws its own token
            alloc = sh.append(f"s{i}", [10 * step + i])
            copies_seen += [(step, i, src) for src, _ in alloc.copies]
            for slot in alloc.slot_mapping:  # no write ever lands in a shared block
                assert mgr.gpu.ref_count(slot // bs) == 1
        sh.check()
    partial = prompt_len % bs != 0
    prompt_last = ceil_div(prompt_len, bs) - 1
    # Only the shared partial prompt block is copied, by every sample but the last to write.
    expected = [(0, i, None) for i in range(n - 1)] if partial else []
    assert [(s, i, None) for s, i, _ in copies_seen] == expected
    assert all(src == prompt_blocks[prompt_last] for _, _, src in copies_seen)
    first_blocks = mgr.block_table("s0")
    full = prompt_len // bs
    total = prompt_len + steps
    # Memory: full prompt blocks once, everything else once per sample.
    assert mgr.gpu.num_used_blocks == full + n * (ceil_div(total, bs) - full)
    for i in range(n):
        assert mgr.block_table(f"s{i}")[:full] == first_blocks[:full]
    for i in range(n):
        sh.free(f"s{i}")
    sh.check()
    assert mgr.gpu.num_free_blocks == 64


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("bs", [1, 2, 4])
def test_beam_search_like_forking_keeps_every_beam_correct(seed, bs):
    """Each step, every beam proposes tokens; the best ``width`` candidates fork from
    their parent (one parent may win several times, others none) and old beams go."""
    rng = random.Random(seed)
    width = 3
    mgr = KVCacheManager(num_gpu_blocks=200, block_size=bs)
    sh = Shadow(mgr)
    sh.allocate("b0", [rng.randrange(50) for _ in range(rng.randint(1, 9))])
    beams = ["b0"]
    ancestry = {"b0": {}}  # beam -> {ancestor: its length when it forked}
    next_id = 1
    for _ in range(12):
        candidates = [
            (rng.random(), beam, tok) for beam in beams for tok in rng.sample(range(50), 2)
        ]
        winners = sorted(candidates, reverse=True)[:width]
        if rng.random() < 0.3:  # sometimes one beam takes every slot
            winners = [(0, beams[0], t) for t in rng.sample(range(50), width)]
        new_beams = []
        for _, parent, tok in winners:
            child = f"b{next_id}"
            next_id += 1
            sh.fork(parent, child)
            ancestry[child] = {**ancestry[parent], parent: len(sh.tokens[parent])}
            alloc = sh.append(child, [tok])
            for slot in alloc.slot_mapping:
                assert mgr.gpu.ref_count(slot // bs) == 1
            for src, dst in alloc.copies:
                assert mgr.gpu.ref_count(dst) == 1 and mgr.gpu.ref_count(src) >= 1
            new_beams.append(child)
        for old in beams:
            sh.free(old)
            del ancestry[old]
        beams = new_beams
        sh.check()
    # Two beams share exactly the full blocks their last common ancestor had when it
    # forked; from there on each wrote only into blocks of its own.
    for a in beams:
        for b in beams:
            if a == b:
                continue
            common = set(ancestry[a]) & set(ancestry[b])
            fork_len = max(ancestry[a][x] for x in common)
            ba, bb = mgr.block_table(a), mgr.block_table(b)
            k = fork_len // bs
            assert ba[:k] == bb[:k]
            assert not set(ba[k:]) & set(bb)
    for beam in beams:
        sh.free(beam)
    assert mgr.gpu.num_free_blocks == 200

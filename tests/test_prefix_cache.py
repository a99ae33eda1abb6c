"""Lesson 04 — prefix caching (paper §4.4): hashed full blocks, shared prompts, LRU eviction.

Every test runs the allocations through a shadow cache engine (``memory_shadow.Shadow``:
slot -> the token, with its whole prefix, whose KV is stored there) and reads every
sequence back through its block table.  A wrong prefix hit (even one of identical tokens
after a different prefix) therefore fails the read-back, independently of how the cache
decided.
"""

import pytest

import minipaged.core.memory.prefix_cache as prefix_cache
from memory_shadow import Shadow
from minipaged.core.memory import KVCacheManager, NoFreeBlocksError


def snapshot(mgr):
    gpu = mgr.gpu
    return (
        mgr.stats(),
        list(gpu._free),
        list(gpu.ref_counts),
        list(gpu._evictable),
        dict(gpu._by_hash),
        dict(gpu._by_block),
        gpu.num_query_tokens,
        gpu.num_hit_tokens,
        {s: (list(t.blocks), list(t.token_ids), list(t.identities)) for s, t in mgr.tables.items()},
    )


def make(num_gpu_blocks=32, bs=4):
    mgr = KVCacheManager(num_gpu_blocks, bs, enable_prefix_caching=True)
    return mgr, Shadow(mgr, check_each_op=True)


def test_a_shared_prompt_prefix_reuses_the_full_blocks():
    mgr, sh = make()
    a = list(range(10))  # two full blocks and a partial one
    assert sh.allocate("a", a).num_cached_tokens == 0
    b = a[:8] + [77, 78, 79]
    assert mgr.num_cached_tokens(b) == 8
    alloc = sh.allocate("b", b)
    assert alloc.num_cached_tokens == 8
    assert len(alloc.slot_mapping) == 3  # only the new tokens get slots
    assert mgr.block_table("b")[:2] == mgr.block_table("a")[:2]
    assert mgr.block_table("b")[2] != mgr.block_table("a")[2]
    assert mgr.stats()["num_cached_blocks"] == 2  # b's 3rd block is partial: not cached


def test_identical_live_prompts_share_all_full_blocks():
    mgr, sh = make()
    p = list(range(100, 113))  # 3 full blocks + 1 token
    sh.allocate("a", p)
    used = mgr.gpu.num_used_blocks
    assert sh.allocate("b", p).num_cached_tokens == 12
    assert mgr.gpu.num_used_blocks == used + 1  # only the last, partial block is new
    assert all(mgr.gpu.ref_count(x) == 2 for x in mgr.block_table("a")[:3])


@pytest.mark.parametrize("bs", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_last_prompt_token_is_always_recomputed(bs, k):
    mgr, sh = make(bs=bs)
    p = [5 + i for i in range(k * bs)]  # exactly k full blocks
    sh.allocate("a", p)
    assert mgr.num_cached_tokens(p) == (k - 1) * bs
    assert sh.allocate("b", p).num_cached_tokens == (k - 1) * bs
    # One more token and all k blocks can be served.
    assert sh.allocate("c", p + [1]).num_cached_tokens == k * bs
    # A one-token prompt never hits.
    assert mgr.num_cached_tokens(p[:1]) == 0


def test_equal_blocks_after_a_different_prefix_do_not_match():
    mgr, sh = make()
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    sh.allocate("a", x + y + [0])
    assert mgr.num_cached_tokens(z + y + [0]) == 0
    assert mgr.num_cached_tokens(y + y + [0]) == 0
    sh.allocate("b", z + y + [0])
    assert mgr.num_cached_tokens(z + y + [3]) == 8  # b's own chain is cached now
    assert mgr.num_cached_tokens(x + y + [3]) == 8


def test_partial_blocks_are_not_cached_but_blocks_filled_by_decode_are():
    mgr, sh = make()
    sh.allocate("a", [1, 2, 3, 4, 5, 6])
    assert mgr.num_cached_tokens([1, 2, 3, 4, 5, 6, 7]) == 4
    sh.append("a", [7])
    sh.append("a", [8])  # the second block is full now, filled by decode
    assert mgr.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert mgr.num_cached_tokens([1, 2, 3, 4, 5, 6, 7, 9, 0]) == 4
    assert sh.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]).num_cached_tokens == 8


def test_blocks_a_fork_fills_are_cached_after_the_right_prefix():
    mgr, sh = make(bs=2)
    sh.allocate("p", [1, 2, 3])
    sh.fork("p", "c")
    sh.append("c", [4])  # copy-on-write, then the block [3, 4] is full
    sh.append("c", [5, 6])
    assert mgr.num_cached_tokens([1, 2, 3, 4, 5, 6, 0]) == 6
    # The same tokens at the start of a prompt were computed after no prefix: no hit.
    assert mgr.num_cached_tokens([3, 4, 5, 6, 0]) == 0
    assert mgr.num_cached_tokens([5, 6, 0]) == 0
    assert sh.allocate("q", [3, 4, 5, 6, 0]).num_cached_tokens == 0


def test_freed_cached_blocks_stay_reusable_until_evicted():
    mgr, sh = make(num_gpu_blocks=8)
    p = list(range(10))
    sh.allocate("a", p)
    a_blocks = mgr.block_table("a")
    sh.free("a")
    gpu = mgr.gpu
    assert gpu.num_free_blocks == 8  # evictable counts as free
    assert gpu.num_evictable_blocks == 2  # the two full blocks; the partial one is plain free
    assert all(gpu.ref_count(b) == 0 for b in a_blocks)
    alloc = sh.allocate("b", p[:8] + [42])
    assert alloc.num_cached_tokens == 8
    assert mgr.block_table("b")[:2] == a_blocks[:2]  # revived in place
    assert gpu.num_evictable_blocks == 0


def test_never_cached_free_blocks_are_used_before_evicting():
    mgr, sh = make(num_gpu_blocks=5)
    a = list(range(9))  # 2 cached full blocks + 1 partial
    sh.allocate("a", a)
    sh.free("a")  # 2 evictable + 3 plain free
    sh.allocate("c", [50 + i for i in range(12)])  # needs exactly the 3 plain free blocks
    assert mgr.gpu.num_evictable_blocks == 2
    assert mgr.num_cached_tokens(a) == 8
    sh.allocate("d", [90])  # now something must be evicted
    assert mgr.gpu.num_evictable_blocks == 1
    assert mgr.num_cached_tokens(a) == 4  # the tail went first, the parent is still there


def test_lru_eviction_takes_tails_before_parents_and_oldest_first():
    mgr, sh = make(num_gpu_blocks=6, bs=2)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    sh.allocate("a", a)
    sh.allocate("b", b)
    sh.free("a")  # released first: least recently used
    sh.free("b")
    assert mgr.gpu.num_evictable_blocks == 4
    cached = lambda: (mgr.num_cached_tokens(a), mgr.num_cached_tokens(b))  # noqa: E731
    assert cached() == (4, 4)
    sh.allocate("c1", [20, 21, 22])  # 2 blocks: the two plain free ones
    assert cached() == (4, 4)
    sh.allocate("c2", [30])  # evicts a's tail
    assert cached() == (2, 4)
    sh.allocate("c3", [31])  # then a's head
    assert cached() == (0, 4)
    sh.allocate("c4", [32])  # then b's tail
    assert cached() == (0, 2)
    with pytest.raises(NoFreeBlocksError):
        sh.allocate("c5", [33, 34, 35])


def test_reuse_refreshes_a_block_in_the_lru_order():
    mgr, sh = make(num_gpu_blocks=6, bs=2)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    sh.allocate("a", a)
    sh.allocate("b", b)
    sh.free("a")
    sh.free("b")
    # Using a's blocks again makes them the most recently used.
    assert sh.allocate("a2", a[:4] + [0]).num_cached_tokens == 4
    sh.free("a2")
    # LRU order is now b2, b1, a2, a1.  Three blocks: the two plain free ones, then b's tail.
    sh.allocate("c", [20, 21, 22, 23, 24, 25])
    assert (mgr.num_cached_tokens(a), mgr.num_cached_tokens(b)) == (4, 2)
    sh.allocate("d", [30])
    assert (mgr.num_cached_tokens(a), mgr.num_cached_tokens(b)) == (4, 0)


def test_lookups_are_read_only():
    mgr, sh = make(num_gpu_blocks=6)
    sh.allocate("a", list(range(9)))
    sh.free("a")
    before = snapshot(mgr)
    for prompt in (list(range(9)), list(range(5)), [3, 3, 3]):
        mgr.num_cached_tokens(prompt)
        mgr.can_allocate(prompt)
        mgr.gpu.match_prefix(prompt)
    assert snapshot(mgr) == before


def test_a_stale_match_cannot_be_acquired_after_eviction():
    mgr, sh = make(num_gpu_blocks=3)
    sh.allocate("a", list(range(9)))
    sh.free("a")
    entries = mgr.gpu.match_prefix(list(range(9)))
    assert len(entries) == 2
    sh.allocate("x", [70 + i for i in range(12)])  # needs the whole pool: evicts both
    with pytest.raises(ValueError, match="no longer holds"):
        mgr.gpu.acquire(entries[0])


def test_hit_rate_counts_prompt_tokens():
    mgr, sh = make()
    assert mgr.stats()["prefix_cache_hit_rate"] == 0.0
    sh.allocate("a", list(range(10)))  # 0 of 10
    sh.allocate("b", list(range(10)))  # 8 of 10
    sh.allocate("c", list(range(8)) + [99, 98, 97, 96, 95])  # 8 of 13
    assert mgr.stats()["prefix_cache_hit_rate"] == pytest.approx(16 / 33)
    assert mgr.gpu.hit_rate == pytest.approx(16 / 33)
    # A failed allocation is not a lookup.
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate("big", list(range(8)) + [0] * 400)
    assert mgr.gpu.hit_rate == pytest.approx(16 / 33)


def test_chunked_prefill_after_a_cached_prefix():
    mgr, sh = make()
    a = list(range(12))
    sh.allocate("a", a)
    b = a[:8] + [40, 41, 42, 43, 44, 45]
    before = snapshot(mgr)
    # 14 tokens would be valid without the cache; 8 are cached, so at most 6 are new.
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate("b", b, num_new_tokens=len(b))
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate("b", b, num_new_tokens=0)
    assert snapshot(mgr) == before
    alloc = sh.allocate("b", b, num_new_tokens=1)
    assert alloc.num_cached_tokens == 8 and mgr.num_tokens("b") == 9
    sh.append("b", b[9:12])
    sh.append("b", b[12:])
    assert mgr.num_tokens("b") == len(b)
    # The block completed in a later chunk is cached like any other.
    assert mgr.num_cached_tokens(b[:12] + [7]) == 12


def test_the_same_block_computed_twice_keeps_the_chain_findable():
    """Two sequences compute the same first block (one is mid chunked prefill when the
    other registers it); the later one's next block must still be correctly cached."""
    mgr, sh = make(bs=2)
    sh.allocate("b", [1, 2, 3, 4, 5], num_new_tokens=1)
    sh.allocate("a", [1, 2, 9])
    sh.append("b", [2])  # same content as a's first block, in another physical block
    assert mgr.block_table("b")[0] != mgr.block_table("a")[0]
    sh.append("b", [3, 4])
    assert sh.allocate("c", [1, 2, 3, 4, 6]).num_cached_tokens == 4


def test_can_allocate_counts_revived_blocks_in_a_tight_pool():
    """The only free blocks are the cached ones being reused: they count once, not twice."""
    mgr, sh = make(num_gpu_blocks=3)
    a = list(range(12))  # three full blocks: the whole pool
    sh.allocate("a", a)
    sh.free("a")
    assert mgr.gpu.num_free_blocks == 3 and mgr.gpu.num_evictable_blocks == 3
    # 2 revived + 2 fresh = 4 > 3, though 3 "free" >= 2 fresh.
    too_big = a[:8] + [50, 51, 52, 53, 54]
    assert mgr.num_cached_tokens(too_big) == 8
    assert not mgr.can_allocate(too_big)
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate("b", too_big)
    assert snapshot(mgr) == before
    # 3 revived + 1 fresh = 4 > 3.
    assert not mgr.can_allocate(a + [1])
    # Chunked: 2 revived + 1 fresh = 3 fits, even though the prompt would not.
    assert mgr.can_allocate(too_big, num_new_tokens=1)
    # 2 revived + 1 fresh (which must evict the third, unmatched block) = 3 fits.
    fits = a[:8] + [50]
    assert mgr.can_allocate(fits)
    alloc = sh.allocate("b", fits)
    assert alloc.num_cached_tokens == 8 and mgr.gpu.num_free_blocks == 0
    sh.free("b")
    # A prompt of exactly the cached blocks: its last block is recomputed in place of
    # the old copy, which is the only block left to evict.
    assert mgr.can_allocate(a[:8] + [50, 0, 0, 0])
    assert sh.allocate("c", a[:8] + [50, 0, 0, 0]).num_cached_tokens == 8


def test_can_allocate_does_not_count_blocks_held_by_live_sequences():
    mgr, sh = make(num_gpu_blocks=4)
    a = list(range(12))
    sh.allocate("a", a)  # 3 blocks held, 1 free
    assert mgr.can_allocate(a[:8] + [50])  # 2 shared live blocks + 1 fresh
    assert not mgr.can_allocate(a[:8] + [50, 51, 52, 53, 54])  # 2 fresh
    sh.allocate("b", a[:8] + [50])
    assert mgr.gpu.num_free_blocks == 0


# -- hash collisions: a collision may cost a hit, never give wrong KV -----------------------


def constant_hash(parent_hash, token_ids):
    return 7


def parent_blind_hash(parent_hash, token_ids):
    return hash(token_ids)


def token_blind_hash(parent_hash, token_ids):
    return hash(parent_hash)


COLLIDING = [constant_hash, parent_blind_hash, token_blind_hash]


@pytest.mark.parametrize("bad_hash", COLLIDING, ids=lambda f: f.__name__)
def test_colliding_hashes_never_share_wrong_kv(monkeypatch, bad_hash):
    monkeypatch.setattr(prefix_cache, "hash_block", bad_hash)
    mgr, sh = make(bs=2, num_gpu_blocks=64)
    x, y, z = [1, 2], [3, 4], [5, 6]
    prompts = [
        x + y + z + [0],
        y + y + [0],
        z + y + [0],
        x + z + [0],
        y + x + y + [0],
        x + y + [9],
        y + [0],
        x + y + z + [1],
        z + z + z + [0],
    ]
    for i, p in enumerate(prompts):
        alloc = sh.allocate(f"s{i}", p)  # read-back inside checks every hit is right
        # Whatever was served must really be a prefix that some earlier prompt had.
        cached = alloc.num_cached_tokens
        if cached:
            assert any(q[:cached] == p[:cached] for q in prompts[:i])
    # Exact repeats still hit where the hash leaves an entry for them.
    assert mgr.num_cached_tokens(x + y + z + [5]) >= 2


def test_parent_blind_hash_cannot_hand_out_a_block_computed_after_another_prefix(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", parent_blind_hash)
    mgr, sh = make(bs=2)
    sh.allocate("a", [1, 2, 3, 4, 0])  # caches [3, 4] after [1, 2]
    # [3, 4] as a first block has the same hash and the same tokens: only the parent
    # check stops it from matching a block whose KV was computed after [1, 2].
    assert mgr.num_cached_tokens([3, 4, 0]) == 0
    assert sh.allocate("b", [3, 4, 0]).num_cached_tokens == 0
    assert mgr.block_table("b")[0] != mgr.block_table("a")[1]


def test_a_block_registered_after_a_colliding_parent_is_not_chained_to_it(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", parent_blind_hash)
    mgr, sh = make(bs=2)
    x, y, z, w = [1, 2], [3, 4], [5, 6], [7, 8]
    sh.allocate("a", x + y + [0])  # caches x, then y after x
    # b's y (after z) has the hash and the tokens of a's y, but another prefix: it must
    # not take a's identity, or b's w would be chained after x + y.
    sh.allocate("b", z + y + w + [0])
    alloc = sh.allocate("c", x + y + w + [0])  # read-back checks the KV of what hits
    assert alloc.num_cached_tokens == 4


def test_constant_hash_keeps_the_first_entry_and_misses_the_rest(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", constant_hash)
    mgr, sh = make(bs=2)
    sh.allocate("a", [1, 2, 3, 4, 0])
    sh.allocate("b", [5, 6, 7, 8, 0])  # collides with a's first block at every level
    assert mgr.stats()["num_cached_blocks"] == 1
    assert mgr.num_cached_tokens([1, 2, 3, 4, 1]) == 2  # a's first block, then a miss
    assert mgr.num_cached_tokens([5, 6, 7, 8, 1]) == 0
    assert sh.allocate("c", [1, 2, 3, 4, 1]).num_cached_tokens == 2


def test_an_evicted_duplicate_parent_does_not_block_recaching():
    # b's second block is cached as the child of a's entry for [1,2] (b's own [1,2] is a
    # duplicate).  Once a's entry is evicted that child is an orphan: it must give way
    # when c computes the same content, or [3,4] could never be cached again.
    mgr, sh = make(num_gpu_blocks=6, bs=2)
    sh.allocate("b", [1, 2, 3, 4, 5], num_new_tokens=1)
    sh.allocate("a", [1, 2, 9])
    sh.append("b", [2, 3, 4, 5])  # b's [1,2] duplicates a's; b's [3,4] is cached
    sh.free("a")
    sh.allocate("x", [7] * 2 * mgr.gpu.num_free_blocks)  # evicts a's [1,2]
    sh.free("x")
    sh.allocate("c", [1, 2, 3, 4, 6])  # computes [1,2] and [3,4] again
    sh.free("c")
    assert mgr.num_cached_tokens([1, 2, 3, 4, 7]) == 4

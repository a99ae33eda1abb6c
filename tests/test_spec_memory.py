"""Lookahead slots and rollback for speculative decoding, in the memory layer.

A verifying step appends a sequence's last token and ``k`` draft guesses
(`KVCacheManager.append` with ``num_lookahead``); after verification `rollback` keeps
the accepted ones.  Oracles: the shadow cache engine (``memory_shadow.Shadow``: every
sequence reads back its own tokens, ref counts equal holders, cached blocks hold what
they claim) and block counts computed here from token counts alone.
"""

import random

import pytest

from memory_shadow import Shadow, ceil_div
from minipaged.core.memory import KVCacheManager


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_rejected_guesses_give_their_blocks_back(prefix_caching):
    bs = 4
    shadow = Shadow(KVCacheManager(16, bs, 0, prefix_caching), check_each_op=True)
    mgr = shadow.mgr
    shadow.allocate("a", list(range(10, 16)))  # 6 tokens: 2 blocks
    # The last token and 5 guesses: 12 tokens, 3 blocks.
    shadow.append_lookahead("a", [16, 90, 91, 92, 93, 94], 5)
    table = mgr.block_table("a")
    assert len(table) == 3
    assert mgr.gpu.num_free_blocks == 16 - 3
    # One guess accepted: 8 tokens kept, the third block emptied and free again.
    assert shadow.rollback("a", 8) == 1
    assert mgr.block_table("a") == table[:2]
    assert mgr.gpu.ref_count(table[2]) == 0
    assert mgr.gpu.num_free_blocks == 16 - ceil_div(8, bs)


def test_a_guess_never_enters_the_prefix_cache_until_kept():
    bs = 4
    shadow = Shadow(KVCacheManager(16, bs, 0, True), check_each_op=True)
    mgr = shadow.mgr
    shadow.allocate("a", [1, 2, 3])
    shadow.append_lookahead("a", [4, 50, 51, 52, 53], 4)  # blocks [1 2 3 4] [50 51 52 53]
    # Only the block of real tokens is findable; the guesses' block is not.
    assert mgr.num_cached_tokens([1, 2, 3, 4, 50, 51, 52, 53, 9]) == bs
    shadow.rollback("a", 6)  # 50 and 51 accepted
    shadow.append("a", [60, 61])  # the sequence goes on: its second block fills for real
    assert mgr.num_cached_tokens([1, 2, 3, 4, 50, 51, 60, 61, 9]) == 2 * bs
    assert mgr.num_cached_tokens([1, 2, 3, 4, 50, 51, 52, 53, 9]) == bs


def test_lookahead_on_a_shared_last_block_copies_it_first():
    """n > 1: a fork's guesses go to its own copy; the sibling's KV is untouched."""
    bs = 4
    shadow = Shadow(KVCacheManager(16, bs), check_each_op=True)
    shadow.allocate("a", [1, 2, 3, 4, 5, 6])
    shadow.fork("a", "b")
    alloc = shadow.append_lookahead("b", [7, 70, 71, 72], 3)
    assert len(alloc.copies) == 1
    shadow.rollback("b", 7)
    shadow.append_lookahead("a", [8, 80, 81], 2)
    shadow.rollback("a", 9)


def test_rollback_refuses_bad_counts_and_swapped_sequences():
    mgr = KVCacheManager(8, 4, 8, True)
    mgr.allocate("a", list(range(9)))
    with pytest.raises(ValueError, match="num_tokens"):
        mgr.rollback("a", 10)
    with pytest.raises(ValueError, match="num_tokens"):
        mgr.rollback("a", 7)  # would cut into a block the prefix cache holds
    with pytest.raises(ValueError, match="num_lookahead"):
        mgr.append("a", [1, 2], 2)  # the first token is never a guess
    mgr.swap_out(["a"])
    with pytest.raises(ValueError, match="swapped"):
        mgr.rollback("a", 9)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_speculation_against_an_independent_count(seed, prefix_caching):
    """Random verify-and-roll-back rounds over forked sequences: after each round a
    sequence holds exactly ceil(tokens / block_size) blocks, and the pool's used blocks
    are the distinct blocks of the tables (the shadow checks the contents)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    shadow = Shadow(KVCacheManager(200, bs, 0, prefix_caching), check_each_op=True)
    mgr = shadow.mgr
    vocab = 3  # few token ids: the prefix cache gets hits
    shadow.allocate("s0", [rng.randrange(vocab) for _ in range(rng.randint(1, 12))])
    seqs = ["s0"]
    for step in range(60):
        sid = rng.choice(seqs)
        if rng.random() < 0.15 and len(seqs) < 4:
            child = f"s{step + 1}"
            shadow.fork(sid, child)
            seqs.append(child)
            continue
        k = rng.randint(0, 5)
        guesses = [rng.randrange(vocab) for _ in range(k)]
        before = mgr.num_tokens(sid)
        shadow.append_lookahead(sid, [rng.randrange(vocab), *guesses], k)
        accepted = rng.randint(0, k)
        released = shadow.rollback(sid, before + 1 + accepted)
        assert released == ceil_div(before + 1 + k, bs) - ceil_div(before + 1 + accepted, bs)
        for s in seqs:
            assert len(mgr.block_table(s)) == ceil_div(mgr.num_tokens(s), bs)
        distinct = {b for s in seqs for b in mgr.block_table(s)}
        if not prefix_caching:
            assert mgr.gpu.num_free_blocks == 200 - len(distinct)
    for s in seqs:
        shadow.free(s)
    assert mgr.gpu.num_free_blocks == 200

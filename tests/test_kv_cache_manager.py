"""The KV cache manager: the memory layer's front door for the scheduler (paper §4.2–4.5).

Oracles: slot mappings computed here from block tables; a shadow GPU/CPU KV store
(``memory_shadow.Shadow``) that carries out copies and swap mappings; reference counts
counted from the tables; and, for every refused operation, a full snapshot of the state
before and after.
"""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory_shadow import Shadow, ceil_div
from minipaged.core.memory import (
    Allocation,
    KVCacheManager,
    NoFreeBlocksError,
    PrefixCachingBlockAllocator,
)


def snapshot(mgr):
    """Everything a refused operation must leave as it was."""

    def pool(a):
        s = {"free": list(a._free), "refs": list(a.ref_counts)}
        if isinstance(a, PrefixCachingBlockAllocator):
            s.update(
                evictable=list(a._evictable),
                by_hash=dict(a._by_hash),
                by_block=dict(a._by_block),
                lookups=(a.num_query_tokens, a.num_hit_tokens),
            )
        return s

    tables = {
        sid: (
            id(t),
            list(t.blocks),
            list(t.token_ids),
            list(t.identities),
            "cpu" if t.allocator is mgr.cpu else "gpu" if t.allocator is mgr.gpu else "?",
        )
        for sid, t in mgr.tables.items()
    }
    return {
        "stats": mgr.stats(),
        "gpu": pool(mgr.gpu),
        "cpu": pool(mgr.cpu),
        "tables": tables,
        "swaps": (mgr.num_swapped_out_blocks, mgr.num_swapped_in_blocks),
    }


# -- construction and basics -------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.5, None])
def test_block_size_is_validated(bad):
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, bad)


def test_stats_of_a_fresh_manager():
    mgr = KVCacheManager(num_gpu_blocks=7, block_size=4, num_cpu_blocks=3)
    s = mgr.stats()
    assert s["num_gpu_blocks"] == 7 and s["num_free_gpu_blocks"] == 7
    assert s["num_cpu_blocks"] == 3 and s["num_free_cpu_blocks"] == 3
    assert s["num_swapped_out_blocks"] == 0 and s["num_swapped_in_blocks"] == 0
    assert s["prefix_cache_hit_rate"] == 0.0 and s["num_cached_blocks"] == 0
    assert not mgr.prefix_caching
    assert KVCacheManager(4, 4, enable_prefix_caching=True).prefix_caching


@pytest.mark.parametrize("bs,n", [(1, 3), (4, 1), (4, 4), (4, 10), (16, 33)])
def test_allocate_gives_every_prompt_token_a_slot(bs, n):
    mgr = KVCacheManager(num_gpu_blocks=20, block_size=bs)
    prompt = [7 * i % 11 for i in range(n)]
    alloc = mgr.allocate("s", prompt)
    assert isinstance(alloc, Allocation)
    blocks = mgr.block_table("s")
    assert len(blocks) == ceil_div(n, bs)
    assert alloc.slot_mapping == [blocks[p // bs] * bs + p % bs for p in range(n)]
    assert alloc.copies == [] and alloc.num_cached_tokens == 0
    assert mgr.num_tokens("s") == n and mgr.tables["s"].token_ids == prompt
    assert mgr.num_cached_tokens(prompt) == 0  # no prefix caching
    assert mgr.stats()["num_free_gpu_blocks"] == 20 - ceil_div(n, bs)


def test_block_table_returns_a_copy():
    mgr = KVCacheManager(4, 2)
    mgr.allocate("s", [1, 2, 3])
    view = mgr.block_table("s")
    view.append(3)
    view[0] = 99
    assert mgr.block_table("s") == mgr.tables["s"].blocks and 99 not in mgr.block_table("s")


@pytest.mark.parametrize(
    "bs,prompt_len,chunks",
    [
        (4, 10, [3, 3, 4]),
        (4, 10, [4, 6]),
        (4, 10, [1] * 10),
        (2, 7, [5, 2]),
        (16, 40, [16, 16, 8]),
        (3, 9, [9]),
    ],
)
def test_chunked_prefill_then_decode(bs, prompt_len, chunks):
    mgr = KVCacheManager(num_gpu_blocks=32, block_size=bs)
    sh = Shadow(mgr)
    prompt = list(range(100, 100 + prompt_len))
    assert sum(chunks) == prompt_len
    alloc = sh.allocate("s", prompt, num_new_tokens=chunks[0])
    slots = list(alloc.slot_mapping)
    assert mgr.num_tokens("s") == chunks[0]
    done = chunks[0]
    for c in chunks[1:]:
        assert mgr.can_append("s", c)
        slots += sh.append("s", prompt[done : done + c]).slot_mapping
        done += c
        assert mgr.num_tokens("s") == done
    assert mgr.tables["s"].token_ids == prompt
    blocks = mgr.block_table("s")
    assert len(blocks) == ceil_div(prompt_len, bs)
    assert slots == [blocks[p // bs] * bs + p % bs for p in range(prompt_len)]
    for t in range(5):  # decode
        sh.append("s", [t])
    sh.check()


# -- refused operations change nothing ------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["plain", "prefix"])
def busy(request):
    """A manager with some history: shared blocks, a swapped group, cached prefixes."""
    mgr = KVCacheManager(
        num_gpu_blocks=9, block_size=4, num_cpu_blocks=4, enable_prefix_caching=request.param
    )
    sh = Shadow(mgr)
    sh.allocate("a", list(range(10)))  # 3 blocks
    sh.fork("a", "a1")
    sh.allocate("b", [50, 51, 52, 53, 54])  # 2 blocks
    sh.fork("b", "b1")
    sh.swap_out(["b", "b1"])
    sh.allocate("c", list(range(9)))  # with caching: shares a's 2 full blocks
    sh.free("c")
    sh.check()
    return mgr, sh


def test_refused_allocate_changes_nothing(busy):
    mgr, sh = busy
    free = mgr.gpu.num_free_blocks
    too_big = [300 + i for i in range(4 * free + 1)]  # one token more than fits
    assert not mgr.can_allocate(too_big)
    assert mgr.can_allocate(too_big[:-1])
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate("new", too_big)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate("new", too_big, num_new_tokens=len(too_big))
    with pytest.raises(ValueError, match="already has a block table"):
        mgr.allocate("a", [1, 2])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        mgr.allocate("new", [])
    for bad in (0, -1, len(too_big) + 1):
        with pytest.raises(ValueError, match="num_new_tokens"):
            mgr.allocate("new", too_big, num_new_tokens=bad)
    assert snapshot(mgr) == before
    sh.check()


@pytest.mark.parametrize("bad", [1.5, 2.0, "2"])
def test_a_non_int_chunk_is_refused_before_a_cached_prefix_is_taken(bad):
    """Regression: a float chunk used to be accepted by the range check, take the cached
    prefix, then fail slicing the prompt, leaving blocks held by no table."""
    mgr = KVCacheManager(8, 2, enable_prefix_caching=True)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    mgr.free("a")
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate("b", [1, 2, 3, 4, 5, 6], num_new_tokens=bad)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.can_allocate([1, 2, 3, 4, 5, 6], num_new_tokens=bad)
    assert snapshot(mgr) == before
    assert mgr.gpu.num_free_blocks == 8


def test_refused_append_changes_nothing(busy):
    mgr, sh = busy
    # a and a1 share a partial last block: a1's next token needs a copy.
    while mgr.gpu.num_free_blocks:
        sh.allocate(f"fill{mgr.gpu.num_free_blocks}", [900 + mgr.gpu.num_free_blocks])
    assert mgr.tables["a"].blocks[-1] == mgr.tables["a1"].blocks[-1]
    assert not mgr.can_append("a1", 1)
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocksError):
        mgr.append("a1", [1])
    with pytest.raises(NoFreeBlocksError):
        mgr.append("a", [1, 2, 3])
    with pytest.raises(ValueError, match="swapped out"):
        mgr.append("b", [1])
    with pytest.raises(ValueError, match="nope"):
        mgr.append("nope", [1])
    assert snapshot(mgr) == before
    sh.check()


def test_refused_swaps_change_nothing(busy):
    mgr, sh = busy
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocksError):  # a's family has 3 distinct blocks; 2 CPU free
        mgr.swap_out(["a", "a1"])
    with pytest.raises(ValueError, match="duplicates"):
        mgr.swap_out(["a", "a"])
    with pytest.raises(ValueError):  # b is already on the CPU
        mgr.swap_out(["a", "b"])
    with pytest.raises(ValueError):
        mgr.swap_in(["b", "a"])
    with pytest.raises(ValueError):
        mgr.swap_in(["ghost"])
    with pytest.raises(ValueError):
        mgr.swap_out(["a", "ghost"])
    assert snapshot(mgr) == before
    # Fill the GPU so the swapped group cannot come back.
    while mgr.gpu.num_free_blocks:
        sh.allocate(f"fill{mgr.gpu.num_free_blocks}", [900 + mgr.gpu.num_free_blocks])
    assert not mgr.can_swap_in(["b", "b1"])
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocksError):
        mgr.swap_in(["b", "b1"])
    assert snapshot(mgr) == before
    sh.check()


def test_refused_fork_and_free_change_nothing(busy):
    mgr, _ = busy
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="already has a block table"):
        mgr.fork("a", "a1")
    with pytest.raises(ValueError, match="ghost"):
        mgr.fork("ghost", "x")
    with pytest.raises(ValueError, match="ghost"):
        mgr.free("ghost")
    with pytest.raises(ValueError, match="ghost"):
        mgr.block_table("ghost")
    assert snapshot(mgr) == before


def test_can_append_predicts_append_exactly():
    """Decode several sequences one token at a time until the pool runs dry."""
    bs = 3
    mgr = KVCacheManager(num_gpu_blocks=10, block_size=bs)
    sh = Shadow(mgr)
    sh.allocate("x", [1, 2, 3, 4])
    sh.fork("x", "y")
    sh.allocate("z", [5])
    refused = 0
    for step in range(40):
        for sid in ("x", "y", "z"):
            n = len(sh.tokens[sid])
            last_shared = n % bs and mgr.block_table(sid)[-1] in [
                b for other, t in mgr.tables.items() if other != sid for b in t.blocks
            ]
            need = (n % bs == 0) + bool(last_shared)  # a fresh block, and/or a copy
            assert mgr.can_append(sid, 1) == (need <= mgr.gpu.num_free_blocks)
            if mgr.can_append(sid, 1):
                sh.append(sid, [step])
            else:
                refused += 1
                before = snapshot(mgr)
                with pytest.raises(NoFreeBlocksError):
                    mgr.append(sid, [step])
                assert snapshot(mgr) == before
        sh.check()
    assert refused > 0 and mgr.gpu.num_free_blocks == 0


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_can_append_all_predicts_appending_them_one_after_another(data):
    """What the scheduler asks each step of a request whose forks share blocks: the
    oracle appends every sequence's tokens in turn, on a copy of the manager."""
    bs = data.draw(st.integers(1, 4), label="block_size")
    mgr = KVCacheManager(16, bs, enable_prefix_caching=data.draw(st.booleans()))
    mgr.allocate("s0", list(range(data.draw(st.integers(1, 3 * bs), label="prompt"))))
    for k in range(1, data.draw(st.integers(1, 4), label="forks")):
        mgr.fork(f"s{data.draw(st.integers(0, k - 1))}", f"s{k}")
        grow = data.draw(st.integers(0, bs), label="grow")
        if grow and mgr.can_append(f"s{k}", grow):
            mgr.append(f"s{k}", [50 + k] * grow)
    leave = data.draw(st.integers(0, 4), label="free blocks left")
    while mgr.num_free_gpu_blocks > leave:  # others' blocks, so the pool runs short
        mgr.allocate(f"other{mgr.num_free_gpu_blocks}", [200 + mgr.num_free_gpu_blocks] * bs)
    forks = [sid for sid in sorted(mgr.tables) if sid.startswith("s")]
    seqs = data.draw(st.lists(st.sampled_from(forks), min_size=1, unique=True))
    appends = [(sid, data.draw(st.integers(1, bs), label=sid)) for sid in seqs]
    oracle = copy.deepcopy(mgr)
    try:
        for sid, n in appends:
            oracle.append(sid, [7] * n)
        fits = True
    except NoFreeBlocksError:
        fits = False
    assert mgr.can_append_all(appends) == fits
    if mgr.can_append_any(len(appends), sum(n for _, n in appends)):
        assert fits  # the cheap bound never says yes wrongly


# -- swapping groups -------------------------------------------------------------------------


def family(mgr, sh, bs):
    """A parent and three samples that share its prompt blocks, each with a private tail."""
    sh.allocate("p", list(range(2 * bs + 1)))
    for i in range(3):
        sh.fork("p", f"k{i}")
        sh.append(f"k{i}", [40 + i] * (bs + 1))
    sh.check()
    return ["p", "k0", "k1", "k2"]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("bs", [1, 2, 4])
def test_swapping_a_group_keeps_its_sharing(bs, caching):
    mgr = KVCacheManager(
        num_gpu_blocks=40, block_size=bs, num_cpu_blocks=40, enable_prefix_caching=caching
    )
    sh = Shadow(mgr)
    group = family(mgr, sh, bs)
    old = {s: mgr.block_table(s) for s in group}
    distinct = set(b for bl in old.values() for b in bl)
    per_table = sum(len(bl) for bl in old.values())
    assert len(distinct) < per_table  # the group really shares blocks
    mapping = sh.swap_out(group)
    m = dict(mapping)
    assert len(m) == len(mapping)  # each GPU block listed once
    assert set(m) == distinct
    assert len(set(m.values())) == len(distinct)  # one CPU block per distinct GPU block
    assert all(0 <= c < mgr.cpu.num_blocks for c in m.values())
    for s in group:
        assert mgr.is_swapped(s)
        assert mgr.block_table(s) == [m[b] for b in old[s]]
    assert mgr.cpu.num_used_blocks == len(distinct)
    assert mgr.stats()["num_swapped_out_blocks"] == len(distinct)
    assert mgr.gpu.num_free_blocks == 40  # free, or evictable in the prefix cache
    sh.check()  # CPU ref counts = holders, and every sequence reads back from the CPU
    assert mgr.can_swap_in(group)
    on_cpu = {s: mgr.block_table(s) for s in group}
    back = dict(sh.swap_in(group))
    assert set(back) == set(m.values()) and len(set(back.values())) == len(distinct)
    for s in group:
        assert not mgr.is_swapped(s)
        assert mgr.block_table(s) == [back[c] for c in on_cpu[s]]
    assert mgr.cpu.num_free_blocks == 40
    assert mgr.stats()["num_swapped_in_blocks"] == len(distinct)
    sh.check()
    # The group keeps going: copy-on-write still applies to what it shares.
    for s in group:
        alloc = sh.append(s, [77])
        for slot in alloc.slot_mapping:
            assert mgr.gpu.ref_count(slot // bs) == 1
    sh.check()
    for s in group:
        sh.free(s)
    assert mgr.gpu.num_free_blocks == 40 and mgr.cpu.num_free_blocks == 40


def test_swapping_out_part_of_a_family_leaves_the_rest_on_the_gpu():
    bs = 2
    mgr = KVCacheManager(num_gpu_blocks=30, block_size=bs, num_cpu_blocks=30)
    sh = Shadow(mgr)
    family(mgr, sh, bs)
    old_k0 = mgr.block_table("k0")
    gpu_used = mgr.gpu.num_used_blocks
    mapping = sh.swap_out(["k0"])
    assert [g for g, _ in mapping] == old_k0  # k0 holds no block twice
    # Blocks k0 shared with p stay on the GPU for p; only k0's private ones are freed.
    private = [b for b in old_k0 if b not in mgr.block_table("p")]
    assert mgr.gpu.num_used_blocks == gpu_used - len(private)
    sh.check()
    sh.swap_in(["k0"])  # comes back with private copies of what it shared
    assert not set(mgr.block_table("k0")) & set(mgr.block_table("p"))
    sh.check()


def test_sharing_lets_a_group_fit_the_cpu_pool_exactly():
    bs = 2
    mgr = KVCacheManager(num_gpu_blocks=30, block_size=bs, num_cpu_blocks=0)
    sh = Shadow(mgr)
    group = family(mgr, sh, bs)
    distinct = len(set(b for s in group for b in mgr.block_table(s)))
    for cpu_blocks in (distinct - 1, distinct):
        mgr.cpu = type(mgr.cpu)(cpu_blocks, "cpu")
        if cpu_blocks < distinct:
            before = snapshot(mgr)
            with pytest.raises(NoFreeBlocksError):
                mgr.swap_out(group)
            assert snapshot(mgr) == before
        else:
            sh.swap_out(group)
            assert mgr.cpu.num_free_blocks == 0
    sh.check()


def test_forking_and_freeing_while_swapped_out():
    mgr = KVCacheManager(num_gpu_blocks=10, block_size=2, num_cpu_blocks=10)
    sh = Shadow(mgr)
    sh.allocate("a", [1, 2, 3])
    sh.swap_out(["a"])
    sh.fork("a", "b")  # a fork of a swapped sequence is swapped too, sharing its blocks
    assert mgr.is_swapped("b") and mgr.block_table("b") == mgr.block_table("a")
    sh.check()
    sh.swap_in(["a", "b"])
    assert mgr.block_table("a") == mgr.block_table("b")
    sh.swap_out(["b", "a"])
    sh.free("a")
    sh.check()
    sh.free("b")
    assert mgr.cpu.num_free_blocks == 10 and mgr.gpu.num_free_blocks == 10


def test_prefix_cache_survives_a_swap_out():
    bs = 2
    mgr = KVCacheManager(
        num_gpu_blocks=8, block_size=bs, num_cpu_blocks=8, enable_prefix_caching=True
    )
    sh = Shadow(mgr)
    prompt = [1, 2, 3, 4, 5]
    sh.allocate("a", prompt)
    sh.swap_out(["a"])
    # The GPU copies are no longer held, but their contents are still valid cache.
    assert mgr.gpu.num_used_blocks == 0 and mgr.gpu.num_evictable_blocks == 2
    assert sh.allocate("b", prompt[:4] + [9]).num_cached_tokens == 4
    sh.check()
    sh.swap_in(["a"])  # a gets blocks of its own; b keeps the cached ones
    assert not set(mgr.block_table("a")) & set(mgr.block_table("b"))
    sh.append("a", [6])
    sh.check()
    for s in ("a", "b"):
        sh.free(s)
    assert mgr.gpu.num_free_blocks == 8 and mgr.cpu.num_free_blocks == 8
    assert all(mgr.gpu.ref_count(x) == 0 for x in range(8))


def test_a_swapped_out_sequence_cannot_append_until_swapped_in():
    mgr = KVCacheManager(8, 4, num_cpu_blocks=8)
    mgr.allocate("s", [1, 2, 3])
    mgr.swap_out(["s"])
    assert mgr.can_append("s") is False
    with pytest.raises(ValueError, match="swapped out"):
        mgr.append("s", [4])
    mgr.swap_in(["s"])
    assert mgr.can_append("s") is True
    mgr.append("s", [4])
    assert mgr.num_tokens("s") == 4

"""Property tests for the memory layer: random allocate / append / fork / free / swap.

A hypothesis state machine drives a :class:`KVCacheManager` and keeps a model of its own:

* per sequence, the token ids it holds and the prompt tokens still to prefill;
* a shadow cache engine: per pool, slot -> the id of "the KV of this token after this
  prefix" (prefixes are interned, so equal ids mean equal KV).  Every slot mapping, every
  copy-on-write pair and every swap mapping the manager returns is carried out on it.

After every step each sequence must read its own tokens back through its block table,
which catches wrong sharing, a missing or wrong copy, a wrong prefix-cache hit and a
wrong swap mapping alike.  Reference counts are checked against the holders counted
from ``manager.tables``; every refused operation must leave a full snapshot unchanged.
"""

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import minipaged.core.memory.prefix_cache as prefix_cache
from memory_shadow import ceil_div, copy_blocks
from minipaged.core.memory import KVCacheManager, NoFreeBlocksError, PrefixCachingBlockAllocator

SETTINGS = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# Prompts from a small alphabet, often starting with a common prefix, so that prefixes
# repeat and the prefix cache gets hits (and near misses).
PREFIXES = [[], [0, 0, 0, 0, 0, 0, 0, 0], [1, 2, 1, 2, 1, 2], [0, 1, 0, 1, 0], [2, 2, 0]]
TOKENS = st.integers(0, 2)
PROMPTS = st.builds(
    lambda pre, tail: pre + tail, st.sampled_from(PREFIXES), st.lists(TOKENS, max_size=9)
).filter(bool)


def snapshot(mgr):
    def pool(a):
        s = [list(a._free), list(a.ref_counts)]
        if isinstance(a, PrefixCachingBlockAllocator):
            s += [
                list(a._evictable),
                dict(a._by_hash),
                dict(a._by_block),
                a.num_query_tokens,
                a.num_hit_tokens,
            ]
        return s

    tables = {
        sid: (id(t), list(t.blocks), list(t.token_ids), list(t.identities), t.allocator is mgr.cpu)
        for sid, t in mgr.tables.items()
    }
    return (
        mgr.stats(),
        pool(mgr.gpu),
        pool(mgr.cpu),
        tables,
        mgr.num_swapped_out_blocks,
        mgr.num_swapped_in_blocks,
    )


class MemoryMachine(RuleBasedStateMachine):
    caching = False

    @initialize(bs=st.sampled_from([1, 2, 3, 4]), gpu=st.integers(1, 24), cpu=st.integers(0, 16))
    def setup(self, bs, gpu, cpu):
        self.bs = bs
        self.m = KVCacheManager(gpu, bs, cpu, enable_prefix_caching=self.caching)
        self.tokens: dict[str, list[int]] = {}  # what each sequence holds
        self.kv: dict[str, list[int]] = {}  # content id of each of its tokens
        self.pending: dict[str, list[int]] = {}  # prompt tokens not yet prefilled
        self.store = {"gpu": {}, "cpu": {}}  # shadow cache engine: slot -> content id
        self.content: dict[tuple[int, int], int] = {}
        self.last_token: list[int] = []  # content id -> its token
        self.prev: list[int] = []  # content id -> id of the token before
        self.queries = self.hits = 0
        self.next_id = 0

    # -- model helpers -------------------------------------------------------------------
    def cid(self, prev, token):
        """Interned id of "the KV of ``token`` after the prefix whose last id is ``prev``"."""
        key = (prev, token)
        if key not in self.content:
            self.content[key] = len(self.last_token)
            self.last_token.append(token)
            self.prev.append(prev)
        return self.content[key]

    def extend(self, sid, new_tokens):
        prev = self.kv[sid][-1] if self.kv[sid] else -1
        for t in new_tokens:
            prev = self.cid(prev, t)
            self.kv[sid].append(prev)
        self.tokens[sid] += list(new_tokens)

    def on(self, sid):
        return "cpu" if self.m.is_swapped(sid) else "gpu"

    def seqs(self, pool):
        return sorted(s for s in self.tokens if self.on(s) == pool)

    def holders(self, pool):
        return Counter(b for s, t in self.m.tables.items() if self.on(s) == pool for b in t.blocks)

    def run(self, sid, alloc, start):
        """Carry out an allocation as the cache engine would: copies, then writes."""
        bs, store = self.bs, self.store["gpu"]
        for src, dst in alloc.copies:
            assert src != dst and self.m.gpu.ref_count(dst) == 1
            assert dst in self.m.tables[sid].blocks and src not in self.m.tables[sid].blocks
            assert self.m.gpu.ref_count(src) >= 1  # it was shared, someone still has it
        copy_blocks(alloc.copies, store, store, bs)
        assert len(alloc.slot_mapping) == len(self.tokens[sid]) - start
        for p, slot in enumerate(alloc.slot_mapping, start):
            assert self.m.gpu.ref_count(slot // bs) == 1  # no write lands in a shared block
            assert slot == self.m.tables[sid].blocks[p // bs] * bs + p % bs
            store[slot] = self.kv[sid][p]

    def new_id(self):
        self.next_id += 1
        return f"s{self.next_id}"

    # -- rules -----------------------------------------------------------------------------
    @rule(prompt=PROMPTS, chunk=st.one_of(st.none(), st.integers(1, 12)))
    def allocate(self, prompt, chunk):
        m, sid = self.m, self.new_id()
        cached = m.num_cached_tokens(prompt)
        assert cached % self.bs == 0 and 0 <= cached <= len(prompt) - 1
        assert self.caching or cached == 0
        n_new = None if chunk is None else min(chunk, len(prompt) - cached)
        can = m.can_allocate(prompt, n_new)
        refs_before = [m.gpu.ref_count(b) for b in range(m.gpu.num_blocks)]
        free_before = m.gpu.num_free_blocks
        before = snapshot(m)
        try:
            alloc = m.allocate(sid, prompt, n_new)
        except NoFreeBlocksError:
            assert not can
            assert snapshot(m) == before
            return
        assert can
        assert alloc.num_cached_tokens == cached and alloc.copies == []
        end = len(prompt) if n_new is None else cached + n_new
        blocks = m.tables[sid].blocks
        assert len(blocks) == ceil_div(end, self.bs)
        # Taken from the pool: the fresh blocks, and matched blocks nobody held.
        matched = blocks[: cached // self.bs]
        fresh = blocks[cached // self.bs :]
        assert all(refs_before[b] == 0 for b in fresh)
        assert free_before - m.gpu.num_free_blocks == len(fresh) + sum(
            refs_before[b] == 0 for b in matched
        )
        self.tokens[sid], self.kv[sid] = [], []
        self.extend(sid, prompt[:end])
        self.pending[sid] = list(prompt[end:])
        if self.caching:
            self.queries += len(prompt)
            self.hits += cached
        self.run(sid, alloc, cached)

    @precondition(lambda self: self.seqs("gpu"))
    @rule(data=st.data(), n=st.integers(1, 7))
    def append(self, data, n):
        sid = data.draw(st.sampled_from(self.seqs("gpu")), label="seq")
        if self.pending[sid]:  # continue chunked prefill
            toks = self.pending[sid][:n]
        else:  # decode (or speculative tokens)
            toks = data.draw(st.lists(TOKENS, min_size=n, max_size=n), label="tokens")
        self._append(sid, toks)

    def decoding(self):
        return [s for s in self.seqs("gpu") if not self.pending[s]]

    @precondition(lambda self: self.decoding())
    @rule(data=st.data(), k=st.integers(1, 3))
    def sample(self, data, k):
        """Parallel sampling / a beam step: fork ``k`` children, each decodes a token."""
        parent = data.draw(st.sampled_from(self.decoding()), label="parent")
        for _ in range(k):
            child = self._fork(parent)
            self._append(child, [data.draw(TOKENS, label="token")])

    def _append(self, sid, toks):
        m = self.m
        table = m.tables[sid]
        have = len(self.tokens[sid])
        last_shared = have % self.bs != 0 and self.holders("gpu")[table.blocks[-1]] > 1
        need = ceil_div(have + len(toks), self.bs) - ceil_div(have, self.bs) + last_shared
        can = m.can_append(sid, len(toks))
        assert can == (need <= m.gpu.num_free_blocks)
        old_blocks = list(table.blocks)
        before = snapshot(m)
        try:
            alloc = m.append(sid, toks)
        except NoFreeBlocksError:
            assert not can
            assert snapshot(m) == before
            return
        assert can
        assert len(alloc.copies) == int(last_shared)
        if last_shared:  # the copy replaces exactly the shared last block
            assert alloc.copies[0][0] == old_blocks[-1]
            assert table.blocks[: len(old_blocks)] == old_blocks[:-1] + [alloc.copies[0][1]]
        else:
            assert table.blocks[: len(old_blocks)] == old_blocks
        self.pending[sid] = self.pending[sid][len(toks) :]
        self.extend(sid, toks)
        self.run(sid, alloc, have)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data.draw(st.sampled_from(sorted(self.tokens)), label="parent"))

    def _fork(self, parent):
        child = self.new_id()
        pool = self.on(parent)
        free_before = getattr(self.m, pool).num_free_blocks
        self.m.fork(parent, child)
        assert getattr(self.m, pool).num_free_blocks == free_before  # sharing costs nothing
        assert self.m.block_table(child) == self.m.block_table(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.kv[child] = list(self.kv[parent])
        self.pending[child] = list(self.pending[parent])
        return child

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        pool = self.on(sid)
        alone = [b for b in set(self.m.tables[sid].blocks) if self.holders(pool)[b] == 1]
        free_before = getattr(self.m, pool).num_free_blocks
        self.m.free(sid)
        assert getattr(self.m, pool).num_free_blocks == free_before + len(alone)
        for d in (self.tokens, self.kv, self.pending):
            del d[sid]

    def group(self, data, pool):
        members = self.seqs(pool)
        return data.draw(st.lists(st.sampled_from(members), min_size=1, unique=True), label="group")

    @precondition(lambda self: self.seqs("gpu"))
    @rule(data=st.data())
    def swap_out(self, data):
        self._swap(self.group(data, "gpu"), "gpu", "cpu")

    @precondition(lambda self: self.seqs("cpu"))
    @rule(data=st.data())
    def swap_in(self, data):
        group = self.group(data, "cpu")
        distinct = len(set(b for s in group for b in self.m.tables[s].blocks))
        assert self.m.can_swap_in(group) == (distinct <= self.m.gpu.num_free_blocks)
        self._swap(group, "cpu", "gpu")

    def _swap(self, group, src, dst):
        m, bs = self.m, self.bs
        old = {s: list(m.tables[s].blocks) for s in group}
        distinct = set(b for bl in old.values() for b in bl)
        src_holders, dst_free = self.holders(src), getattr(m, dst).num_free_blocks
        before = snapshot(m)
        try:
            mapping = m.swap_out(group) if dst == "cpu" else m.swap_in(group)
        except NoFreeBlocksError:
            assert len(distinct) > dst_free
            assert snapshot(m) == before
            return
        assert len(distinct) <= dst_free
        pairs = dict(mapping)
        assert len(pairs) == len(mapping) and set(pairs) == distinct
        assert len(set(pairs.values())) == len(distinct)
        for s in group:
            assert self.on(s) == dst and m.tables[s].blocks == [pairs[b] for b in old[s]]
        # One block per distinct source block, held by every member that held the source.
        group_holders = Counter(b for bl in old.values() for b in bl)
        for b, nb in pairs.items():
            assert getattr(m, dst).ref_count(nb) == group_holders[b]
            assert getattr(m, src).ref_count(b) == src_holders[b] - group_holders[b]
        copy_blocks(mapping, self.store[src], self.store[dst], bs)

    @rule(data=st.data())
    def misuse(self, data):
        """Calls that must be refused with a ValueError, changing nothing."""
        m = self.m
        before = snapshot(m)
        calls = [
            lambda: m.append("ghost", [0]),
            lambda: m.free("ghost"),
            lambda: m.fork("ghost", "x"),
            lambda: m.swap_out(["ghost"]),
            lambda: m.allocate("x", []),
        ]
        if self.tokens:
            some = sorted(self.tokens)[0]
            calls += [
                lambda: m.allocate(some, [0]),
                lambda: m.fork(some, some),
                lambda: m.allocate("x", [0], num_new_tokens=0),
            ]
        if self.seqs("cpu"):
            s = self.seqs("cpu")[0]
            calls += [lambda: m.append(s, [0]), lambda: m.swap_out([s]), lambda: m.swap_in([s, s])]
            if self.seqs("gpu"):
                calls.append(lambda: m.swap_in([s, self.seqs("gpu")[0]]))
        call = data.draw(st.sampled_from(calls), label="call")
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError("misuse was accepted")
        assert snapshot(m) == before

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        bs = self.bs
        assert set(self.m.tables) == set(self.tokens)
        for sid, kv in self.kv.items():
            table = self.m.tables[sid]
            assert table.token_ids == self.tokens[sid]
            assert len(table.blocks) == ceil_div(len(kv), bs)
            store = self.store[self.on(sid)]
            for p, content in enumerate(kv):
                assert store.get(table.blocks[p // bs] * bs + p % bs) == content, (sid, p)

    @invariant()
    def ref_counts_equal_holders_and_pools_add_up(self):
        for name in ("gpu", "cpu"):
            pool, held = getattr(self.m, name), self.holders(name)
            assert all(pool.ref_count(b) == held.get(b, 0) for b in range(pool.num_blocks))
            assert pool.num_free_blocks == pool.num_blocks - len(held)
            assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
            free = list(pool._free)
            assert len(free) == len(set(free)) and not set(free) & set(held)
            idle = set(range(pool.num_blocks)) - set(held)
            if isinstance(pool, PrefixCachingBlockAllocator):
                evictable = set(pool._evictable)
                assert not evictable & set(free) and evictable | set(free) == idle
                # Evictable blocks are exactly the cached blocks nobody holds.
                assert evictable == set(pool._by_block) - set(held)
            else:
                assert set(free) == idle
        stats = self.m.stats()
        assert stats["num_free_gpu_blocks"] == self.m.gpu.num_free_blocks
        assert stats["num_free_cpu_blocks"] == self.m.cpu.num_free_blocks

    @invariant()
    def cached_blocks_hold_what_they_claim(self):
        if not self.caching:
            return
        gpu, bs = self.m.gpu, self.bs
        assert self.m.stats()["prefix_cache_hit_rate"] == (
            self.hits / self.queries if self.queries else 0.0
        )
        by_id = {e.entry_id: e for e in gpu._by_block.values()}
        for block, entry in gpu._by_block.items():
            assert gpu._by_hash[entry.block_hash] is entry
            ids = [self.store["gpu"].get(block * bs + o) for o in range(bs)]
            assert None not in ids
            assert tuple(self.last_token[i] for i in ids) == entry.token_ids
            assert all(self.prev[b] == a for a, b in zip(ids, ids[1:]))
            # ... and was computed after the prefix its parent entry stands for.
            if entry.parent_id == prefix_cache.ROOT_ID:
                assert self.prev[ids[0]] == -1
            elif entry.parent_id in by_id:
                parent = by_id[entry.parent_id].block
                assert self.prev[ids[0]] == self.store["gpu"][parent * bs + bs - 1]

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for sid in list(self.m.tables):
            self.m.free(sid)
        for pool in (self.m.gpu, self.m.cpu):
            assert pool.num_free_blocks == pool.num_blocks
            assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


class PrefixCachingMachine(MemoryMachine):
    caching = True


# Hash functions that collide on purpose: a collision may cost a hit, never share wrong KV.
WEAK_HASHES = [
    lambda parent_hash, token_ids: 0,  # everything collides
    lambda parent_hash, token_ids: hash(token_ids),  # blind to the prefix
    lambda parent_hash, token_ids: hash(parent_hash) % 5,  # blind to the tokens
    lambda parent_hash, token_ids: hash((parent_hash, token_ids)) % 3,
]


class CollidingHashMachine(PrefixCachingMachine):
    @initialize(weak=st.sampled_from(WEAK_HASHES))
    def weaken_the_hash(self, weak):
        self.real_hash = prefix_cache.hash_block
        prefix_cache.hash_block = weak

    def teardown(self):
        try:
            super().teardown()
        finally:
            if hasattr(self, "real_hash"):
                prefix_cache.hash_block = self.real_hash


TestMemoryMachine = MemoryMachine.TestCase
TestMemoryMachine.settings = SETTINGS
TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = SETTINGS
TestCollidingHashMachine = CollidingHashMachine.TestCase
TestCollidingHashMachine.settings = SETTINGS

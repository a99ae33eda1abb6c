"""A shadow cache engine: the independent oracle for the memory layer's tests.

The shadow is a dict per pool, slot -> "the KV of which token, after which prefix, is
stored here" (the whole token prefix as a tuple).  It carries out every slot mapping,
copy-on-write ``(src, dst)`` pair and swap mapping the :class:`KVCacheManager` returns,
exactly as the cache engine would, and then reads each sequence back through its block
table.  Wrong sharing, a missing copy, a write into a shared block, a wrong prefix-cache
hit or a wrong swap mapping all show up as a sequence reading someone else's KV, however
the manager came to its decision.
"""

from collections import Counter

import pytest


def ceil_div(a, b):
    return -(-a // b)


def copy_blocks(pairs, src, dst, bs):
    """Copy each whole block ``a`` of store ``src`` to block ``b`` of ``dst``."""
    for a, b in pairs:
        for o in range(bs):
            dst[b * bs + o] = src.get(a * bs + o)


def holders(mgr, on_cpu):
    """Per block of one pool, how many block tables hold it."""
    return Counter(
        b for sid, t in mgr.tables.items() if mgr.is_swapped(sid) == on_cpu for b in t.blocks
    )


class Shadow:
    """The cache engine as the test sees it: GPU and CPU stores, slot -> token-with-prefix.

    Drive the manager through these methods.  With ``check_each_op`` every allocate,
    append, fork, free and swap is followed by :meth:`check`.
    """

    def __init__(self, mgr, check_each_op=False):
        self.mgr, self.bs, self.check_each_op = mgr, mgr.block_size, check_each_op
        self.kv = {"gpu": {}, "cpu": {}}
        self.tokens: dict[str, list[int]] = {}
        self.queries = self.hits = 0  # prompt tokens looked up / served by the prefix cache

    def _done(self, result=None):
        if self.check_each_op:
            self.check()
        return result

    def write(self, sid, all_tokens, start, alloc):
        """Carry out ``alloc`` for the tokens ``all_tokens[start:]`` of ``sid``."""
        bs, store = self.bs, self.kv["gpu"]
        copy_blocks(alloc.copies, store, store, bs)  # copies first, then the step writes
        assert len(alloc.slot_mapping) == len(all_tokens) - start
        for p, slot in enumerate(alloc.slot_mapping, start):
            assert self.mgr.gpu.ref_count(slot // bs) == 1  # never into a shared block
            store[slot] = tuple(all_tokens[: p + 1])
        self.tokens[sid] = list(all_tokens)

    def allocate(self, sid, prompt, num_new_tokens=None):
        alloc = self.mgr.allocate(sid, prompt, num_new_tokens)
        cached = alloc.num_cached_tokens
        assert cached % self.bs == 0 and 0 <= cached <= len(prompt) - 1
        end = len(prompt) if num_new_tokens is None else cached + num_new_tokens
        self.write(sid, prompt[:end], cached, alloc)
        self.queries += len(prompt)
        self.hits += cached
        return self._done(alloc)

    def append(self, sid, new_tokens):
        alloc = self.mgr.append(sid, new_tokens)
        old = self.tokens[sid]
        self.write(sid, old + list(new_tokens), len(old), alloc)
        return self._done(alloc)

    def append_lookahead(self, sid, new_tokens, num_lookahead):
        """Append with the last ``num_lookahead`` tokens a draft's guesses."""
        alloc = self.mgr.append(sid, new_tokens, num_lookahead)
        old = self.tokens[sid]
        self.write(sid, old + list(new_tokens), len(old), alloc)
        return self._done(alloc)

    def rollback(self, sid, num_tokens):
        released = self.mgr.rollback(sid, num_tokens)
        del self.tokens[sid][num_tokens:]
        return self._done(released)

    def fork(self, parent, child):
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self._done()

    def free(self, sid):
        self.mgr.free(sid)
        del self.tokens[sid]
        self._done()

    def swap_out(self, sids):
        mapping = self.mgr.swap_out(sids)
        copy_blocks(mapping, self.kv["gpu"], self.kv["cpu"], self.bs)
        return self._done(mapping)

    def swap_in(self, sids):
        mapping = self.mgr.swap_in(sids)
        copy_blocks(mapping, self.kv["cpu"], self.kv["gpu"], self.bs)
        return self._done(mapping)

    def check(self):
        """Every sequence reads back exactly its own tokens, ref counts = holders, and
        (with prefix caching) every cached block holds what it claims."""
        mgr, bs = self.mgr, self.bs
        assert set(self.tokens) == set(mgr.tables)
        for sid, toks in self.tokens.items():
            blocks = mgr.block_table(sid)
            store = self.kv["cpu" if mgr.is_swapped(sid) else "gpu"]
            assert mgr.num_tokens(sid) == len(toks)
            assert len(blocks) == ceil_div(len(toks), bs)
            for p in range(len(toks)):
                assert store.get(blocks[p // bs] * bs + p % bs) == tuple(toks[: p + 1]), (sid, p)
        for pool, on_cpu in ((mgr.gpu, False), (mgr.cpu, True)):
            held = holders(mgr, on_cpu)
            for block in range(pool.num_blocks):
                assert pool.ref_count(block) == held.get(block, 0), (pool.device, block)
            assert pool.num_free_blocks == pool.num_blocks - len(held)
        if mgr.prefix_caching:
            # Every cached block holds exactly the tokens it claims, after the right prefix.
            for block, entry in mgr.gpu._by_block.items():
                stored = [self.kv["gpu"].get(block * bs + o) for o in range(bs)]
                assert None not in stored
                assert tuple(s[-1] for s in stored) == entry.token_ids
            rate = self.hits / self.queries if self.queries else 0.0
            assert mgr.stats()["prefix_cache_hit_rate"] == pytest.approx(rate)

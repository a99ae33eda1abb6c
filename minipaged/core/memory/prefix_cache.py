"""Prefix caching: full KV blocks found again by their content (paper §4.4, "shared prefix").

Two prompts that begin with the same tokens produce the same keys and values for that
beginning, so their *full* blocks can be the same physical blocks.  Each full block is
named by a hash chained with its parent block's hash,

    block_hash = hash((parent_block_hash, token_ids_of_this_block)),

so a block's hash stands for the whole prefix up to and including it.  The first block's
parent is the request's *extra key* (vLLM's ``extra_keys``): its LoRA adapter, since an
adapter changes every key and value, so the same prompt under two adapters (or under
one and the base model) never shares a block, while under one adapter it does.  A block
that holds part of an image's placeholder (whose token ids are the same whatever the
image) is keyed on that image too (`MultiModalKey`, vLLM's
``generate_block_hash_extra_keys``): its parent hash is chained with the hashes and
offsets of the images it overlaps, so two prompts with different images part ways at
the first block an image reaches, and the blocks before it are shared.  The hash only
*finds* a candidate; a candidate is accepted only if its stored tokens and extra key
equal ours and its parent is the entry we matched one block earlier.  Entries get ids that are never
reused, so an accepted chain is exactly our prefix: a hash collision costs a miss, never
wrong KV.

An entry whose parent has been evicted can never be matched again (lookups walk the
chain from the first block); when the same content is registered anew, the orphan
gives way to it.

A cached block whose last holder lets go is not returned to the free list at once: it
becomes *evictable* and stays findable until a new allocation needs the space.  Then
the least recently used one goes first.  Sequences release their blocks tail first, so
among blocks released together the tail of a chain is evicted before its parents.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import NamedTuple

from .allocator import BlockAllocator

ROOT_ID = -1
"""The entry id that stands for "no parent": the first block of every prompt."""


# Named tuples, not frozen dataclasses: one of each is made every time a block fills,
# and a tuple is built several times faster (a frozen dataclass sets each field through
# ``object.__setattr__``); with caching on by default, that is every decode's cost.
class CachedBlock(NamedTuple):
    """One entry of the prefix cache: a full physical block and what is in it."""

    block: int
    block_hash: int
    token_ids: tuple[int, ...]
    entry_id: int
    parent_id: int
    # The adapter whose KV it holds (None: the base model), and the images it overlaps.
    extra_key: object = None


class BlockIdentity(NamedTuple):
    """What a block table remembers about one of its full blocks.

    ``entry_id`` is the cache entry holding this content (possibly another physical
    block with the same tokens), or ``None`` when the content cannot be cached.
    """

    block_hash: int
    entry_id: int | None


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def root_hash(extra_key) -> int | None:
    """The "parent hash" of a prompt's first block: None, or its extra key's hash."""
    return None if extra_key is None else hash(("extra_key", extra_key))


class MultiModalKey(NamedTuple):
    """A request with images' extra key: its adapter's id (or None), which keys every
    block, and its images as ``(mm_hash, offset, length)``, by offset, each keying only
    the blocks its placeholder ``[offset, offset + length)`` overlaps."""

    lora_id: object
    mm_items: tuple[tuple[str, int, int], ...]


def block_key(
    parent_hash: int | None, extra_key, index: int, block_size: int
) -> tuple[int | None, object]:
    """The hash block ``index`` chains on (after its parent's ``parent_hash``; None
    for the first) and its own extra key: the request's ``extra_key``, or for a
    `MultiModalKey` its adapter's id plus the ``(mm_hash, offset)`` of each image the
    block overlaps (vLLM's ``_gen_mm_extra_hash_keys``)."""
    if not isinstance(extra_key, MultiModalKey):
        return (root_hash(extra_key) if index == 0 else parent_hash), extra_key
    start, end = index * block_size, (index + 1) * block_size
    images = tuple((h, off) for h, off, n in extra_key.mm_items if off < end and start < off + n)
    chained = root_hash(extra_key.lora_id) if index == 0 else parent_hash
    if not images:
        return chained, extra_key.lora_id
    return hash((chained, images)), (extra_key.lora_id, images)


class PrefixCachingBlockAllocator(BlockAllocator):
    """A `BlockAllocator` whose full blocks can be found again by content."""

    def __init__(self, num_blocks: int, block_size: int, device: str = "gpu") -> None:
        super().__init__(num_blocks, device)
        self.block_size = block_size
        self._by_hash: dict[int, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._live_ids: set[int] = {ROOT_ID}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._entry_ids = itertools.count()
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- pool accounting: evictable blocks count as free ------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens whose KV came from the cache."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def is_cached(self, block: int) -> bool:
        return block in self._by_block

    def allocate(self) -> int:
        """A never-cached free block if there is one, else evict the LRU cached block."""
        if self._free or not self._evictable:
            return super().allocate()
        block, _ = self._evictable.popitem(last=False)
        self._forget(self._by_block[block])
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        if block in self._by_block:
            self._evictable[block] = None  # most recently used goes last
        else:
            super()._release(block)

    # -- lookup -----------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], extra_key=None) -> list[CachedBlock]:
        """The longest chain of cached full blocks that begins ``token_ids`` under
        ``extra_key`` (the request's adapter, or None; a `MultiModalKey` with images).

        The last token is never served from the cache: its logits must be computed,
        so at most ``(len - 1) // block_size`` blocks match.  Read-only.
        """
        bs = self.block_size
        matched: list[CachedBlock] = []
        parent_hash, parent_id = None, ROOT_ID
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            chained, key = block_key(parent_hash, extra_key, i, bs)
            entry = self._by_hash.get(hash_block(chained, tokens))
            if (
                entry is None
                or entry.token_ids != tokens
                or entry.parent_id != parent_id
                or entry.extra_key != key
            ):
                break
            matched.append(entry)
            parent_hash, parent_id = entry.block_hash, entry.entry_id
        return matched

    def acquire(self, entry: CachedBlock) -> None:
        """Hold a matched block: one more reference, and no longer evictable."""
        block = entry.block
        if self._by_block.get(block) is not entry:
            raise ValueError(f"block {block} no longer holds cache entry {entry.entry_id}")
        self._evictable.pop(block, None)
        self.ref_counts[block] += 1

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    # -- registration -----------------------------------------------------------------
    def register(
        self,
        block: int,
        token_ids: tuple[int, ...],
        parent: BlockIdentity | None,
        extra_key=None,
        index: int = 0,
    ) -> BlockIdentity:
        """Offer a block that just became full to the cache.

        ``parent`` is the identity of the previous block of the same sequence (``None``
        for the first); ``extra_key`` its request's (see `match_prefix`); ``index`` the
        block's place in the sequence.  Returns the identity the block table should
        remember.
        """
        parent_hash, extra_key = block_key(
            parent.block_hash if parent else None, extra_key, index, self.block_size
        )
        parent_id = parent.entry_id if parent else ROOT_ID
        block_hash = hash_block(parent_hash, token_ids)
        if parent_id is None:  # the prefix before this block is uncacheable
            return BlockIdentity(block_hash, None)
        existing = self._by_hash.get(block_hash)
        if existing is not None and existing.parent_id not in self._live_ids:
            self._uncache(existing)  # an orphan: unreachable, so it gives way
            existing = None
        if existing is not None:
            same = (
                existing.token_ids == token_ids
                and existing.parent_id == parent_id
                and existing.extra_key == extra_key
            )
            return BlockIdentity(block_hash, existing.entry_id if same else None)
        entry = CachedBlock(
            block, block_hash, token_ids, next(self._entry_ids), parent_id, extra_key
        )
        self._by_hash[block_hash] = entry
        self._by_block[block] = entry
        self._live_ids.add(entry.entry_id)
        return BlockIdentity(block_hash, entry.entry_id)

    def _forget(self, entry: CachedBlock) -> None:
        del self._by_hash[entry.block_hash]
        del self._by_block[entry.block]
        self._live_ids.discard(entry.entry_id)

    def uncache_blocks(self, blocks: set[int]) -> None:
        """Forget the cache entries of ``blocks`` (their KV is not what their tokens
        say: a load that failed); the blocks stay with their holders."""
        for block in blocks:
            if block in self._by_block:
                self._uncache(self._by_block[block])

    def _uncache(self, entry: CachedBlock) -> None:
        """Drop an entry; its block stays with its holders, or is plainly free."""
        self._forget(entry)
        if entry.block in self._evictable:
            del self._evictable[entry.block]
            self._free.append(entry.block)

"""Block tables and slot mapping: logical -> physical translation (paper §4.2, §4.3).

A sequence sees its KV cache as consecutive *logical* blocks.  Its block table says
which *physical* block holds each one, so the physical blocks can sit anywhere in the
pool.  Token ``i`` lives in logical block ``i // block_size`` at offset
``i % block_size``; its *slot* is ``physical_block * block_size + offset``.  The slot
mapping is what the attention kernels use to write new keys and values.

Appending tokens takes a new physical block only when the last one is full.  When the
last block is shared with a fork (reference count > 1), writing into it would change
the other sequence's KV, so it is copied first (copy-on-write, §4.4): the table gets
a private copy and reports the ``(src, dst)`` pair for the cache engine to execute.

Most appends are neither: a decode's one token lands in a last block with room that
the sequence alone holds.  The table keeps that case's answer ready (``room`` and
``next_slot``), so the scheduler's per-sequence, per-step work is a few integers.
"""

from __future__ import annotations

from .allocator import BlockAllocator, NoFreeBlocksError
from .prefix_cache import BlockIdentity, CachedBlock, PrefixCachingBlockAllocator

BlockCopy = tuple[int, int]
"""``(src, dst)``: copy physical block ``src`` into ``dst`` before this step runs."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks ``num_tokens`` tokens fill: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def slot_mapping(blocks: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slots of positions ``[start, end)`` of a sequence whose block table is
    ``blocks``: position ``p`` is at offset ``p % block_size`` of physical block
    ``blocks[p // block_size]`` (§4.2).  The only place the translation is computed."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


class BlockTable:
    """The logical -> physical block list of one sequence, and the token ids it holds."""

    def __init__(self, block_size: int, allocator: BlockAllocator, extra_key=None) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.allocator = allocator
        self.extra_key = extra_key  # what the prefix cache keys its blocks on, beside tokens
        self.blocks: list[int] = []
        self.token_ids: list[int] = []
        # One identity per full block, kept only when the allocator caches prefixes.
        self.identities: list[BlockIdentity] = []
        # A decode's fast path (`take_slot`): the free slots of the last block that this
        # table alone holds, and the first of them.  0 means "ask": the block is full,
        # shared (a fork), in the CPU pool, or not known to be private; the general
        # path (`append_tokens`) then decides, and sets them again.
        self.room = 0
        self.next_slot = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def _caching(self) -> bool:
        return isinstance(self.allocator, PrefixCachingBlockAllocator)

    def slot(self, position: int) -> int:
        """The cache slot of the token at ``position``."""
        return self.slot_mapping(position, position + 1)[0]

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """The cache slots of positions ``[start, end)``."""
        return slot_mapping(self.blocks, self.block_size, start, end)

    def num_blocks_needed(self, num_new_tokens: int) -> int:
        """New physical blocks that appending ``num_new_tokens`` would take (CoW included)."""
        shared = num_new_tokens > 0 and self._last_block_is_shared()
        return self._fresh_blocks_needed(num_new_tokens) + shared

    def _fresh_blocks_needed(self, num_new_tokens: int) -> int:
        free_in_last = len(self.blocks) * self.block_size - len(self.token_ids)
        return blocks_for(max(num_new_tokens - free_in_last, 0), self.block_size)

    def _last_block_is_shared(self) -> bool:
        partial = len(self.token_ids) % self.block_size != 0
        return partial and self.allocator.ref_count(self.blocks[-1]) > 1

    def append_tokens(
        self, token_ids: list[int], num_lookahead: int = 0
    ) -> tuple[list[int], list[BlockCopy]]:
        """Give ``token_ids`` slots; returns their slot mapping and any CoW copies.

        The last ``num_lookahead`` of them are provisional (a draft's guesses): a block
        holding one is not offered to the prefix cache until `truncate` keeps it full.
        All or nothing: if the pool cannot supply the blocks, raises
        `NoFreeBlocksError` and changes nothing.
        """
        if len(token_ids) == 1:
            if self.room:
                return [self._append_in_place(token_ids[0], num_lookahead)], []
            if (
                self.block_size > 1
                and len(self.token_ids) == len(self.blocks) * self.block_size
                and self.allocator.num_free_blocks  # (else the general path says why not)
            ):
                return [self._append_to_new_block(token_ids[0])], []
        shared = bool(token_ids) and self._last_block_is_shared()
        fresh = self._fresh_blocks_needed(len(token_ids))
        if fresh + shared > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"appending {len(token_ids)} tokens needs {fresh + shared} blocks, "
                f"{self.allocator.num_free_blocks} free"
            )
        copies = [self._copy_on_write()] if shared else []
        start = len(self.token_ids)
        self.blocks += [self.allocator.allocate() for _ in range(fresh)]
        self.token_ids += token_ids
        self._register_full_blocks(len(self.token_ids) - num_lookahead)
        self._update_room()
        return self.slot_mapping(start, len(self.token_ids)), copies

    def fill_placeholder(self, token_id: int) -> None:
        """The last token, appended as a placeholder (async scheduling's, provisional),
        becomes ``token_id``; a block it fills is offered to the prefix cache now."""
        self.token_ids[-1] = token_id
        self._register_full_blocks(len(self.token_ids))

    def truncate(self, num_tokens: int) -> int:
        """Keep the first ``num_tokens`` tokens (a verified draft's accepted ones) and
        let go of the rest: their slots are free again, and the blocks past the last
        kept token return to the pool.  Returns how many blocks were let go."""
        # A block offered to the prefix cache must keep its tokens: cut after it.
        lowest = len(self.identities) * self.block_size
        if not isinstance(num_tokens, int) or not lowest <= num_tokens <= len(self.token_ids):
            raise ValueError(
                f"num_tokens must be an int in [{lowest}, {len(self.token_ids)}], "
                f"got {num_tokens!r}"
            )
        keep = blocks_for(num_tokens, self.block_size)
        dropped = self.blocks[keep:]
        for block in reversed(dropped):
            self.allocator.free(block)
        del self.blocks[keep:], self.token_ids[num_tokens:]
        self._register_full_blocks(num_tokens)
        self._update_room()
        return len(dropped)

    def _register_full_blocks(self, num_tokens: int) -> None:
        """Offer the prefix cache each block the first ``num_tokens`` tokens fill, in
        order, that it was not offered yet."""
        if self._caching:
            for full in range(len(self.identities), num_tokens // self.block_size):
                self._register_block(full)

    def _update_room(self) -> None:
        """Set ``room`` and ``next_slot`` from the table as it is now."""
        free = len(self.blocks) * self.block_size - len(self.token_ids)
        private = free > 0 and self.allocator.ref_counts[self.blocks[-1]] == 1
        self.room = free if private else 0
        if private:  # the last block's first free slot
            self.next_slot = (self.blocks[-1] + 1) * self.block_size - free

    def take_slot(self, token_id: int) -> int:
        """The slot of one more token, from the last block's ``room`` (positive).  The
        scheduler runs these same lines inline for every running sequence, every step (a
        call would cost as much as the work), when ``room`` is more than 1: a token that
        fills the block goes through `append_tokens`, which offers the block to the
        prefix cache."""
        slot = self.next_slot
        self.next_slot = slot + 1
        self.room -= 1
        self.token_ids.append(token_id)
        return slot

    def _append_in_place(self, token_id: int, num_lookahead: int = 0) -> int:
        """One token into the last block's ``room``; with ``num_lookahead`` it is
        provisional: a block it fills is not offered to the prefix cache
        (`fill_placeholder` does, once the token is known)."""
        slot = self.take_slot(token_id)
        if not self.room and self._caching and not num_lookahead:
            self._register_block(len(self.blocks) - 1)
        return slot

    def _append_to_new_block(self, token_id: int) -> int:
        """One token into a fresh block, the last one being full, or none (a decode's
        every ``block_size``-th token): nothing shared to copy, no block filled for the
        prefix cache (at a block size above 1), and `_update_room`'s answer known."""
        block = self.allocator.allocate()
        self.blocks.append(block)
        self.token_ids.append(token_id)
        self.room = self.block_size - 1
        self.next_slot = block * self.block_size + 1
        return block * self.block_size

    def _copy_on_write(self) -> BlockCopy:
        src = self.blocks[-1]
        dst = self.allocator.allocate()
        self.allocator.free(src)  # one holder fewer; the other sequences keep it
        self.blocks[-1] = dst
        return src, dst

    def _register_block(self, index: int) -> None:
        parent = self.identities[-1] if self.identities else None
        tokens = tuple(self.token_ids[index * self.block_size : (index + 1) * self.block_size])
        self.identities.append(
            self.allocator.register(self.blocks[index], tokens, parent, self.extra_key, index)
        )

    def adopt_cached_prefix(self, entries: list[CachedBlock]) -> None:
        """Start an empty table with blocks found in the prefix cache (§4.4)."""
        if self.blocks:
            raise ValueError("adopt_cached_prefix needs an empty block table")
        for entry in entries:
            self.allocator.acquire(entry)
            self.blocks.append(entry.block)
            self.token_ids.extend(entry.token_ids)
            self.identities.append(BlockIdentity(entry.block_hash, entry.entry_id))
        self._update_room()

    def fork(self) -> BlockTable:
        """A child table sharing every physical block (parallel sampling, beam search)."""
        child = BlockTable(self.block_size, self.allocator, self.extra_key)
        for block in self.blocks:
            self.allocator.incref(block)
        child.blocks = list(self.blocks)
        child.token_ids = list(self.token_ids)
        child.identities = list(self.identities)
        self.room = 0  # the last block is shared now: the next write copies it first
        return child

    def free(self) -> None:
        """Let go of every block, tail first so prefix-cache eviction takes tails first."""
        for block in reversed(self.blocks):
            self.allocator.free(block)
        self.blocks.clear()
        self.token_ids.clear()
        self.identities.clear()
        self.room = 0

    def remap(self, mapping: dict[int, int], allocator: BlockAllocator) -> None:
        """Point at new physical blocks in another pool (swap out / swap in, §4.5)."""
        self.blocks = [mapping[b] for b in self.blocks]
        self.allocator = allocator
        self.room = 0  # swapped out: no slot at all; swapped in: asked again

"""Lesson 06: planning a swap, out to the CPU pool or back in (paper §4.5).

Write ``swap``, the method of `minipaged.core.memory.kv_cache_manager.KVCacheManager` behind
both ``swap_out`` and ``swap_in``.  It moves a whole request, all or nothing, from the
pool ``src`` to the pool ``dst`` (each a `BlockAllocator`: ``allocate()``,
``free(block)``, ``incref(block)``, ``num_free_blocks``, ``device``).  It may use:

* ``self._table(seq_id)``: a sequence's `BlockTable`; ``table.blocks`` lists its
  physical blocks and ``table.remap(mapping, dst)`` points it at the new ones;
* ``self._distinct_blocks(seq_ids, src)``: every block the sequences hold, each once
  (forked sequences share blocks; a shared block moves once and stays shared).

Check with ``make check LESSON=06``.
"""

from minipaged.core.memory.allocator import BlockAllocator, NoFreeBlocksError  # noqa: F401


def swap(
    self, seq_ids: list[str], src: BlockAllocator, dst: BlockAllocator
) -> list[tuple[int, int]]:
    """Move the blocks of ``seq_ids`` from ``src`` to ``dst``; return the
    ``(src_block, dst_block)`` pairs the cache engine copies.

    Refuse duplicated ``seq_ids`` with a ``ValueError``, and a ``dst`` without room
    with `NoFreeBlocksError`, before changing anything.  Then: one new block in
    ``dst`` per distinct block; each table lets go of its old blocks (tail first) and
    holds the new ones (one reference per holder, as before); the new blocks keep no
    extra reference of their own.
    """
    raise NotImplementedError("write swap() in exercises/swapping.py")

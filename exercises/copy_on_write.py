"""Lesson 03: copy-on-write (paper §4.4).

Write ``copy_on_write``, the method `minipaged.core.memory.block_table.BlockTable` calls
before it writes into a last block that another sequence shares (its reference count
is above 1).  ``self`` is the block table: ``self.blocks`` lists its physical blocks,
``self.allocator`` is the pool (``allocate()``, ``free(block)``, ``ref_count(block)``).
The caller has already checked that a free block exists.

Check with ``make check LESSON=03``.
"""


def copy_on_write(self) -> tuple[int, int]:
    """Give this table a private copy of its last block.

    Take a fresh block, let go of this table's hold on the shared one (the other
    sequences keep it), point the table's last entry at the fresh block, and return
    ``(src, dst)``: the copy the cache engine must make before the step runs.
    """
    raise NotImplementedError("write copy_on_write() in exercises/copy_on_write.py")

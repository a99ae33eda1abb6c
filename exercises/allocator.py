"""Lesson 01: the block allocator's two moves (paper §4.2).

Write ``allocate`` and ``free``, methods of `minipaged.core.memory.allocator.BlockAllocator`
(``self`` is the pool).  What they may use:

* ``self._free``: the free list, a list of block ids used as a stack (``pop()`` takes
  the lowest id first: the list starts as ``[n - 1, ..., 1, 0]``);
* ``self.ref_counts[block]``: how many holders each block has (0 = free);
* ``self.num_blocks`` and ``self.device`` (for error messages);
* ``self._check_allocated(block, op)``: raises the ``ValueError`` a bad or unallocated
  id deserves, naming ``op`` ("free");
* ``self._release(block)``: where a block goes when its last holder lets go (the free
  list here; prefix caching overrides it to keep the block findable).

Check with ``make check LESSON=01`` (or ``minipaged check 01``).
"""

from minipaged.core.memory.allocator import NoFreeBlocksError  # noqa: F401  (raise it)


def allocate(self) -> int:
    """Take a free block; its reference count becomes 1.

    Raises `NoFreeBlocksError` (saying which device's pool is empty) when none is free.
    """
    raise NotImplementedError("write allocate() in exercises/allocator.py")


def free(self, block: int) -> None:
    """One holder of ``block`` lets go; the last one returns it to the pool.

    A block that is not allocated (a double free) raises ``ValueError`` and changes
    nothing."""
    raise NotImplementedError("write free() in exercises/allocator.py")

"""The block allocator: a fixed pool of physical KV blocks (paper §4.2).

vLLM cuts the KV cache of each device into equal *physical blocks* of ``block_size``
token slots.  A block allocator hands out block ids from a free list and takes them
back; it knows nothing about tensors, sequences or tokens.  Reference counts let
several sequences hold the same physical block (copy-on-write sharing, §4.4): a block
returns to the free list only when its last holder lets go.

Every operation is O(1): the free list is a stack of ids and the reference counts an
array indexed by block id.
"""

from __future__ import annotations


class NoFreeBlocksError(RuntimeError):
    """Raised when a pool has no free block left; the caller must wait or preempt."""


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks on one device (``"gpu"`` or ``"cpu"``).

    Examples:
        >>> pool = BlockAllocator(4)
        >>> a = pool.allocate(); pool.incref(a); pool.ref_count(a)
        2
        >>> pool.free(a); pool.free(a); pool.num_free_blocks
        4
    """

    def __init__(self, num_blocks: int, device: str = "gpu") -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.device = device
        # Popping from the end hands out low ids first, which makes pictures readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Holders of each block.  Read it freely (`BlockTable` does, every decode step,
        # where `ref_count`'s check would cost a tenth of the step); change it only
        # through the methods.
        self.ref_counts: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate()` can hand out right now."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self) -> int:
        """Take a free block; its reference count becomes 1."""
        if not self._free:
            raise NoFreeBlocksError(
                f"no free block left in the {self.device} pool of {self.num_blocks} blocks"
            )
        block = self._free.pop()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more holder of an allocated block (a fork shares it)."""
        self._check_allocated(block, "incref")
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """One holder lets go; the last one returns the block to the pool."""
        self._check_allocated(block, "free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._release(block)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self.ref_counts[block]

    def _release(self, block: int) -> None:
        """Where a block goes when nobody holds it (overridden by prefix caching)."""
        self._free.append(block)

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(
                f"block must be an id in [0, {self.num_blocks}) of the "
                f"{self.device} pool, got {block!r}"
            )

    def _check_allocated(self, block: int, op: str) -> None:
        self._check_id(block)
        if self.ref_counts[block] == 0:
            raise ValueError(
                f"cannot {op} block {block}: it is not allocated "
                f"(double free, or never allocated) in the {self.device} pool"
            )

"""Contiguous KV reservation, the way systems before vLLM did it (paper §3, Fig. 2-3).

Orca-style servers give every request one contiguous range of KV slots, sized when the
request is admitted, before anyone knows how long its output will be.  Three sizing
policies appear in the paper's evaluation (§6.1):

* ``max``    - the model's maximum sequence length (what a real system must do);
* ``pow2``   - the request's final length rounded up to a power of two (at most 2x);
* ``oracle`` - exactly the final length (impossible in practice; a lower bound).

Ranges are placed first-fit in one pool of slots.  Three kinds of waste follow: slots
*reserved* for tokens the request will write later, *internal fragmentation* (slots it
will never write) and *external fragmentation* (free gaps too small for anyone).

`ContiguousReservations` puts the same rule in front of the real engine
(``LLM(memory_mode="contiguous-max")`` and so on): its scheduler
(`minipaged.core.sched.contiguous_scheduler`) admits a request only once its range can be placed,
which is what costs those systems their batch size.
"""

from __future__ import annotations

import bisect

from .block_table import blocks_for

POLICIES = ("max", "pow2", "oracle")


def reservation_size(policy: str, prompt_len: int, output_len: int, max_len: int) -> int:
    """How many slots a request reserves at admission under ``policy``."""
    final = prompt_len + output_len
    if policy == "max":
        return max_len
    if policy == "pow2":
        return min(1 << (final - 1).bit_length(), max_len)
    if policy == "oracle":
        return final
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


class ContiguousAllocator:
    """First-fit placement of contiguous slot ranges in a pool of ``num_slots``."""

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.num_slots = num_slots
        self._starts: list[int] = []  # sorted starts of reserved ranges
        self._sizes: dict[int, int] = {}

    @property
    def num_reserved_slots(self) -> int:
        return sum(self._sizes.values())

    def gaps(self) -> list[tuple[int, int]]:
        """Free ranges as ``(start, size)``, in address order."""
        gaps, cursor = [], 0
        for start in self._starts + [self.num_slots]:
            if start > cursor:
                gaps.append((cursor, start - cursor))
            cursor = start + self._sizes.get(start, 0)
        return gaps

    def reserve(self, size: int) -> int | None:
        """The start of a new range of ``size`` slots, or ``None`` if no gap is big enough."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        for start, gap in self.gaps():
            if gap >= size:
                bisect.insort(self._starts, start)
                self._sizes[start] = size
                return start
        return None

    def release(self, start: int) -> None:
        if start not in self._sizes:
            raise ValueError(f"start={start!r} is not the start of a reserved range")
        del self._sizes[start]
        self._starts.remove(start)


class ContiguousReservations:
    """Orca-style admission for an engine whose KV stays paged (paper §3, §6.1).

    Each admitted request holds one contiguous range of slots, placed first-fit in a
    `ContiguousAllocator` over the pool's ``num_blocks * block_size`` slots, from
    admission until it finishes or is aborted; a request whose range does not fit waits.
    The keys and values still go to paged blocks (the attention kernels cannot tell):
    the range only decides *who* runs, never *what* is computed.

    Sizes are rounded up to whole blocks.  A request of ``r`` reserved slots may touch
    ``ceil(r / block_size)`` blocks, so exact slot counts could promise more blocks than
    the pool has (block size 16, two ranges of 17 slots: 34 slots of 48, but 4 blocks
    of 3).  With whole blocks the ranges' blocks never add up to more than the pool,
    and since a range covers every token its request can write, a running request
    always finds its blocks free: a contiguous system never preempts.  The rounding
    costs at most ``block_size - 1`` slots a sequence, the paged system's own internal
    fragmentation; with ``block_size=1`` the ranges are exactly Orca's.

    A request that may run ``width`` sequences (``n`` completions, ``beam_width`` beams)
    reserves one range ``width`` times as long, as if its sequences lay side by side.
    """

    def __init__(self, policy: str, num_blocks: int, block_size: int, max_len: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("max_len", max_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.policy, self.block_size, self.max_len = policy, block_size, max_len
        self.allocator = ContiguousAllocator(num_blocks * block_size)
        self.starts: dict[str, int] = {}  # request id -> start of its range

    def num_slots(self, prompt_len: int, max_tokens: int, width: int = 1) -> int:
        """The slots a request reserves: its policy's size for a final length of
        ``prompt_len + max_tokens`` (cut at ``max_len``, where the engine stops it), in
        whole blocks, ``width`` times."""
        output = min(max_tokens, self.max_len - prompt_len)
        size = reservation_size(self.policy, prompt_len, output, self.max_len)
        return width * blocks_for(size, self.block_size) * self.block_size

    def reserve(self, request_id: str, num_slots: int) -> bool:
        """Place ``request_id``'s range first-fit; False (and nothing held) if no gap is
        big enough."""
        if request_id in self.starts:
            raise ValueError(f"request_id {request_id!r} already holds a reservation")
        start = self.allocator.reserve(num_slots)
        if start is None:
            return False
        self.starts[request_id] = start
        return True

    def release(self, request_id: str) -> None:
        """Give the range back; a request that was never admitted holds none."""
        if request_id in self.starts:
            self.allocator.release(self.starts.pop(request_id))

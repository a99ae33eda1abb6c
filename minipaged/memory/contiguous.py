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
"""

from __future__ import annotations

import bisect

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
        self._starts: list[int] = []   # sorted starts of reserved ranges
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

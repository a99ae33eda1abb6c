"""Lesson 11: the Orca baselines' contiguous reservations (paper §3 and §6.1: Orca
(Max), Orca (Pow2), Orca (Oracle)).

Write ``reservation_size``, how many KV slots a request reserves when it is admitted,
and ``reserve``, the method of `minipaged.core.memory.contiguous.ContiguousAllocator` that
places such a range first-fit in the pool.  The engine's contiguous memory modes
(``LLM(memory_mode="contiguous-max")`` and the others, lesson 11's Fig. 12) and the
memory simulation (lesson 00's Fig. 2) both run on them.  Check with ``make check
LESSON=11``: the tests size reservations by hand, place and free ranges by hand, and
replay small workloads whose admissions, waste and external fragmentation were counted
by hand.

Hint: ``reservation_size`` is three cases on ``prompt_len + output_len`` (``max``:
the model's ``max_len`` whatever the request; ``pow2``: the next power of two, capped at
``max_len``; ``oracle``: exactly the final length), and a ``ValueError`` naming the
policies for any other.  ``reserve`` walks ``self.gaps()`` (the free ranges, in address
order) and takes the first that is big enough; ``bisect.insort`` keeps ``self._starts``
sorted, and ``self._sizes`` maps a start to its size.
"""

import bisect  # noqa: F401  (use it)

from minipaged.core.memory.contiguous import POLICIES  # noqa: F401  (use it)


def reservation_size(policy: str, prompt_len: int, output_len: int, max_len: int) -> int:
    """How many slots a request of ``prompt_len`` prompt tokens and ``output_len``
    output tokens reserves at admission under ``policy`` (one of ``POLICIES``).

    >>> reservation_size("pow2", 20, 5, 64), reservation_size("oracle", 20, 5, 64)
    (32, 25)
    """
    raise NotImplementedError("write reservation_size() in exercises/contiguous_reservation.py")


def reserve(self, size: int) -> int | None:
    """The start of a new range of ``size`` slots, placed in the lowest free gap that
    holds it (first fit), or ``None`` if no gap is big enough.  ``size`` must be a
    positive int (else ``ValueError`` naming it)."""
    raise NotImplementedError("write reserve() in exercises/contiguous_reservation.py")

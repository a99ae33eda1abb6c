"""Lesson 02: slot mapping, logical positions to physical cache slots (paper §4.2, §4.3).

Write ``slot_mapping``, which `minipaged.core.memory.block_table` uses wherever a token's
key and value must be stored.  Check with ``make check LESSON=02``.
"""


def slot_mapping(blocks: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slots of positions ``[start, end)`` of a sequence whose block table is
    ``blocks`` (``blocks[i]`` is the physical block holding its logical block ``i``).

    Position ``p`` is at offset ``p % block_size`` of physical block
    ``blocks[p // block_size]``; its slot counts from the start of the pool, so
    ``slot = physical_block * block_size + offset``.

    >>> slot_mapping([7, 2], 4, 3, 6)
    [31, 8, 9]
    """
    raise NotImplementedError("write slot_mapping() in exercises/slot_mapping.py")

"""Lesson 18: eight 4-bit integers to an int32 and back, as GPTQ's and AWQ's checkpoints
store them (`minipaged.models.quantization.formats`; AutoGPTQ's and AutoAWQ's layouts).

Write ``pack`` and ``unpack``, which `formats.pack_gptq`, `formats.pack_awq`,
`formats.unpack_gptq` and `formats.unpack_awq` use for ``qweight`` and ``qzeros``, then
check with ``make check LESSON=18``: the tests pack random group-wise INT4 weights in
both layouts (GPTQ's with and without act-order's ``g_idx``), read the int32s back with
the test file's own nibble reader, in the order each format documents, and compare the
dequantized weights; then your ``unpack`` must return the integers exactly.

Hint: value ``j`` of a pack of eight sits in bits ``4 * slot .. 4 * slot + 3`` of its
int32, where ``order[slot] == j`` (GPTQ: ``order`` is 0..7, AWQ: ``AWQ_ORDER``).  Shift
and mask with int64 arithmetic, then map values of 2**31 and above to their negative
int32 (``x - 2**32``): an int32 holds the top nibble's high bit as its sign.  To unpack,
shift right and ``& 15`` (an arithmetic shift of a negative int32 keeps the sign bits,
the mask drops them).
"""

import torch

from minipaged.models.quantization.formats import BITS, PACK  # noqa: F401  (use them)


def pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """4-bit ``values`` (integers 0..15, any integer dtype) -> int32, eight times
    shorter along ``dim``: each run of eight consecutive values along ``dim`` becomes
    one int32, value ``order[slot]`` of the eight in bits ``4 * slot`` upwards."""
    raise NotImplementedError("write pack() in exercises/int4_packing.py")


def unpack(packed: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """The inverse of ``pack``: int32 ``packed`` -> its 4-bit values as uint8, eight
    times longer along ``dim``, slot ``i`` of each int32 at position ``order[i]`` of
    its eight."""
    raise NotImplementedError("write unpack() in exercises/int4_packing.py")

"""Lesson 14: quantizing a key or value for the cache, fp8 and int8 (vLLM's
``kv_cache_dtype``; Micikevicius et al. 2022 for the fp8 formats).

Write ``quantize``, which `minipaged.ops.kv_quant` uses to store every key and value
in a quantized cache (the read back, ``q.float() * scale``, is given there), then check
with ``make check LESSON=14``: the tests write tokens through your function and read
them back, by every attention backend, against the oracle on the dequantized cache, and
check the round trip's error against the format's precision.

Hint: divide by the scale in float32.  A cast to fp8 turns a value past the format's
largest into NaN (``torch.float8_e4m3fn`` has no infinity), and a cast to int8 wraps
around: clamp first, to ``torch.finfo(dtype).max`` for fp8, to ``INT8_MAX`` (127) for
int8, which also needs rounding to the nearest integer (a cast truncates).
"""

import torch

from minipaged.ops.kv_quant import INT8_MAX  # noqa: F401  (use it)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` stored in ``dtype`` (an fp8 dtype, or ``torch.int8``): rounded to
    the nearest value the format holds, and clamped to its range rather than overflowing.
    ``scale`` broadcasts against ``x`` (one number for fp8, one per token and head for
    int8)."""
    raise NotImplementedError("write quantize() in exercises/fp8_round_trip.py")

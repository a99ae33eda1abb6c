"""How close is close enough: attention-output tolerances, by dtype, in one place.

Every attention test compares a backend against the float64 oracle with
``assert_close``; a failure lists the worst elements so a bad block or head stands out.
"""

from __future__ import annotations

import torch

# (atol, rtol).  fp16 keeps ~11 significant bits and bf16 ~8, so one rounding of an
# output near 1 already costs ~1e-3 and ~1e-2; the rest is headroom for summation order.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing attention outputs computed in ``dtype``."""
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype must be one of {list(TOLERANCES)}, got {dtype}")
    return TOLERANCES[dtype]


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, worst: int = 5
) -> None:
    """Fail unless ``|actual - expected| <= atol + rtol * |expected|`` everywhere.

    ``dtype`` picks the tolerance (default: ``actual.dtype``).  A NaN or inf on either
    side always fails.  The error message lists the ``worst`` elements.
    """
    atol, rtol = tolerance(dtype or actual.dtype)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    err = (a - e).abs()
    excess = (err - (atol + rtol * e.abs())).nan_to_num(nan=float("inf"))
    excess = excess.masked_fill(~(a.isfinite() & e.isfinite()), float("inf"))
    bad = int((excess > 0).sum())
    if bad == 0:
        return
    top = excess.flatten().topk(min(worst, bad)).indices
    rows = []
    for idx in zip(*(i.tolist() for i in torch.unravel_index(top, a.shape))):
        rows.append(
            f"  at {idx}: actual {a[idx].item():.6g}, expected {e[idx].item():.6g}, "
            f"abs err {err[idx].item():.3g}"
        )
    raise AssertionError(
        f"{bad} of {a.numel()} elements differ beyond atol={atol}, "
        f"rtol={rtol}; worst:\n" + "\n".join(rows)
    )

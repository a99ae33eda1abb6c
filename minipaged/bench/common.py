"""What the benchmarks share: the timing harness and the table printer.

torch is imported by the functions that use it: the memory benchmark, counts from a
simulation, prints its table without it.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def one_cpu_thread(device):
    """On a CPU, run torch on one thread.  A tiny model's tensors are too small for
    torch's thread pool to help, and where other processes compete for the cores its
    threads wait for each other: 10 to 70 times slower, and erratic."""
    import torch

    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- timing ---------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the GPU, so that a clock read after it counts the work launched before."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``fn()`` and the seconds it took, the GPU synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def free_memory(device: torch.device) -> None:
    """Give the last engine's or model's memory back before the next one allocates:
    an engine sizes its KV pool by the memory free when it starts."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


# -- tables ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """One column of `format_table`: its header, the value of a row (a key of the row's
    dict, or a function of the row) and how to write it (``str.format``, e.g.
    ``"{:.1%}"``).  A missing value (None) is written ``-``."""

    header: str
    value: str | Callable[[dict], object]
    fmt: str = "{}"

    def get(self, row: dict):
        return row[self.value] if isinstance(self.value, str) else self.value(row)


def format_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A markdown table, padded so that it lines up in a terminal too; a column of
    numbers is right-aligned."""
    values = [[c.get(row) for c in columns] for row in rows]
    cells = [[c.header for c in columns]]
    cells += [
        ["-" if v is None else c.fmt.format(v) for c, v in zip(columns, line)] for line in values
    ]
    widths = [max(3, *(len(line[i]) for line in cells)) for i in range(len(columns))]
    right = [
        all(_is_number(line[i]) for line in values if line[i] is not None)
        for i in range(len(columns))
    ]
    rule = ["-" * (w - 1) + ":" if r else ":" + "-" * (w - 1) for w, r in zip(widths, right)]
    lines = [
        [(s.rjust if r else s.ljust)(w) for s, w, r in zip(line, widths, right)] for line in cells
    ]
    return "\n".join(f"| {' | '.join(line)} |" for line in [lines[0], rule, *lines[1:]])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

"""What the benchmarks share: the timing harness, a system's result row, and the table
printer.

torch is imported by the functions that use it: the memory benchmark, counts from a
simulation, prints its table without it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minipaged.core.memory.workloads import RequestSpec


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), where the OS says."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def check_num_threads(num_threads: int) -> int:
    """``num_threads``, or a ``ValueError`` unless it is one of 1 to `usable_cores`."""
    most = len(usable_cores())
    if not isinstance(num_threads, int) or not 1 <= num_threads <= most:
        raise ValueError(
            f"num_threads must be an int in [1, {most}] (the cores this process may use), "
            f"got {num_threads!r}"
        )
    return num_threads


def one_cpu_thread(device):
    """On a CPU, run torch on one thread.  A tiny model's tensors are too small for
    torch's thread pool to help, and where other processes compete for the cores its
    threads wait for each other: 10 to 70 times slower, and erratic."""
    return cpu_threads(device, 1)


@contextlib.contextmanager
def cpu_threads(device, num_threads: int):
    """On a CPU, run torch on ``num_threads`` threads (then as before); elsewhere
    change nothing."""
    import torch

    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(num_threads)
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


# On a CPU each timed call starts cold (`time_us`): written before it, a buffer larger
# than any last-level cache; at least this many calls and this much time timed.
CPU_FLUSH_BYTES = 256 << 20
CPU_MIN_CALLS = 5
CPU_MIN_RUN_S = 0.2


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """The median time of ``fn()`` on ``device``, in microseconds."""
    if device.type == "cuda":
        # Imported here: there are no Triton wheels for some CPU-only platforms.
        import triton.testing

        # do_bench zeroes a 256 MB buffer before every call, flushing L2 (50 MB on an
        # H100): each call starts cold, as a layer's attention does after the rest of
        # the model ran, so its K/V really comes from HBM.
        return triton.testing.do_bench(fn, return_mode="median") * 1e3
    # On every thread torch uses, as the engine runs it, and each call cold too: a
    # buffer larger than any CPU's last-level cache is written before it, as do_bench
    # does on a GPU.  Timed warm, the K/V of a serving shape (tens of MB) stays partly
    # in the L3 from one call to the next, and the kernel seemed to read faster than
    # memory streams.  `bench attention` measures the read bandwidth the same way.
    import torch

    flush = torch.empty(CPU_FLUSH_BYTES // 4, dtype=torch.float32)
    fn()  # first-call work (allocations, a lazy build) is not timed
    times: list[float] = []
    while len(times) < CPU_MIN_CALLS or sum(times) < CPU_MIN_RUN_S:
        flush.fill_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def free_memory(device: torch.device) -> None:
    """Give the last engine's or model's memory back before the next one allocates:
    an engine sizes its KV pool by the memory free when it starts."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


# -- a system's run ------------------------------------------------------------------
@dataclass
class SystemRun:
    """One system's result row, and how many tokens it made for each request it ran:
    ``generated`` what it computed, ``output`` what counts (the wanted tokens)."""

    row: dict
    generated: list[int]
    output: list[int]


def system_row(
    system: str, requests: Sequence[RequestSpec], output: list[int], elapsed: float, **extra
) -> dict:
    """A system's row: ``requests`` done in ``elapsed`` seconds, ``output`` tokens each
    counted, rates over them, and ``extra`` columns."""
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {
        "system": system,
        "num_requests": len(requests),
        "output_tokens_per_s": sum(output) / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "elapsed_s": elapsed,
        "output_tokens": sum(output),
        "prompt_tokens": prompt_tokens,
        "total_tokens_per_s": (prompt_tokens + sum(output)) / elapsed,
        **extra,
    }


def check_lengths(system: str, generated: list[int], requests: Sequence[RequestSpec]) -> None:
    """Raise ``RuntimeError`` unless every request generated its wanted output length:
    with ``ignore_eos`` anything else is a bug, and its tokens/s would be a lie."""
    wrong = [
        (i, g, r.output_len)
        for i, (g, r) in enumerate(zip(generated, requests))
        if g != r.output_len
    ]
    if wrong:
        i, got, wanted = wrong[0]
        raise RuntimeError(
            f"{system}: request {i} generated {got} tokens, wanted {wanted} "
            f"({len(wrong)} requests wrong)"
        )


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

"""What the benchmarks share."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def one_cpu_thread(device):
    """On a CPU, run torch on one thread.  A tiny model's tensors are too small for
    torch's thread pool to help, and where other processes compete for the cores its
    threads wait for each other: 10 to 70 times slower, and erratic."""
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

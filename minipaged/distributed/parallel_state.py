"""Ranks, the process group, and the collectives tensor parallelism needs (paper §4.6).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) splits every layer over
``tensor_parallel_size`` ranks, one process each.  A rank computes with its slice of the
weights and meets the others only in collectives: an **all-reduce** that sums the
partial outputs of a row-parallel layer, a **gather** of the vocabulary slices of the
logits to the driver, and a **broadcast** of each step's plan from the driver.  Expert
parallelism (vLLM's ``enable_expert_parallel``) splits a mixture-of-experts layer's
experts over the same ranks instead of slicing each one, and moves tokens to them: an
**all-to-all**, or an **all-gather** then a **reduce-scatter** (``all2all_backend``).

One tensor-parallel group per process: ``torch.distributed``'s default group, over
``gloo`` on a CPU and ``nccl`` on CUDA.  `TensorParallelGroup` is what a layer holds: its
rank, the group's size, and the collectives, each timed (`COMM`), so benchmarks can say
what communication costs.  With ``size == 1`` every collective is the identity and
``torch.distributed`` is never touched.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "COMM",
    "SINGLE",
    "CommStats",
    "RankInfo",
    "TensorParallelGroup",
    "control_group",
    "destroy_tensor_parallel",
    "dist_backend",
    "free_port",
    "init_from_environment",
    "init_tensor_parallel",
    "kv_heads_per_rank",
]

# How long a collective may wait for a peer before gloo gives up.  A dead peer is noticed
# sooner (its sockets close); this bounds a live peer that stopped answering.
TIMEOUT = timedelta(minutes=10)
# The driver's messages (each step's plan, the set-up calls) travel on a group of their
# own: gloo on any device (vLLM's CPU group), and with no practical deadline, since a
# worker waits there for as long as the driver has nothing to run (an idle server).
CONTROL_TIMEOUT = timedelta(days=3650)
_control: dist.ProcessGroup | None = None


@dataclass
class CommStats:
    """Seconds spent in collectives in this process, and how many ran, by kind."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


COMM = CommStats()


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel group: ``rank`` of ``size``, and
    whether its mixture-of-experts layers split their experts over the group
    (``expert_parallel``) and move tokens with ``all2all_backend``.

    The default, ``TensorParallelGroup()``, is no parallelism at all.  Collectives block
    until every rank has called them; on CUDA they are timed after a device sync, so
    the time is the collective's, not the queued kernels'.
    """

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    all2all_backend: str = "alltoall"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over all ranks, in place (Megatron's ``g`` operator)."""
        if self.size > 1:
            with _timed("all_reduce", x.device):
                dist.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``x`` (same shape on all) concatenated along ``dim`` on rank 0;
        None on the other ranks."""
        if self.size == 1:
            return x
        with _timed("gather", x.device):
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows ``x[sum(send_counts[:r]) : ...]`` go to rank ``r``; returns the rows every
        rank sent here, in rank order (``recv_counts[r]`` from rank ``r``)."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        with _timed("all_to_all", x.device):
            dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape on all) stacked along dim 0, on every rank."""
        if self.size == 1:
            return x
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        with _timed("all_gather", x.device):
            dist.all_gather_single(out, x.contiguous())
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over all ranks, split along dim 0 in ``size`` equal parts:
        rank ``r`` gets part ``r``."""
        if self.size == 1:
            return x
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        with _timed("reduce_scatter", x.device):
            dist.reduce_scatter_single(out, x.contiguous())
        return out

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` (any picklable object), on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        with _timed("broadcast", torch.device("cpu")):
            dist.broadcast_object_list(box, src=0, group=_control)
        return box[0]


SINGLE = TensorParallelGroup()  # no parallelism: every collective is the identity


class _timed:
    def __init__(self, kind: str, device: torch.device) -> None:
        self.kind, self.cuda = kind, device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        COMM.add(self.kind, time.perf_counter() - self.start)


def dist_backend(device: torch.device) -> str:
    """``nccl`` between GPUs, ``gloo`` between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tensor_parallel(
    rank: int,
    size: int,
    port: int,
    device: torch.device,
    expert_parallel: bool = False,
    all2all_backend: str = "alltoall",
) -> TensorParallelGroup:
    """Join the group of ``size`` processes that meet at ``127.0.0.1:port`` (rank 0
    listens there); blocks until all have joined."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process is already in a torch.distributed group: one "
            "tensor-parallel LLM per process (shut the other one down first)"
        )
    if device.type == "cuda":  # NCCL's object collectives use the current device
        torch.cuda.set_device(rank if device.index is None else device.index)
    dist.init_process_group(
        dist_backend(device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=TIMEOUT,
    )
    _init_control_group()
    return TensorParallelGroup(rank, size, expert_parallel, all2all_backend)


def init_from_environment(
    device: torch.device, expert_parallel: bool = False, all2all_backend: str = "alltoall"
) -> tuple[TensorParallelGroup, dist.Store]:
    """Join the group a launcher started this process in: ``torch.distributed``'s
    ``env://`` rendezvous, from the ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` that ``torchrun`` sets (on CUDA, rank ``RANK`` computes on GPU
    ``LOCAL_RANK`` of its host).  Returns the group and the rendezvous's key-value store;
    blocks until every rank has joined."""
    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group")
    store, rank, size = next(dist.rendezvous("env://", timeout=TIMEOUT))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(
        dist_backend(device), store=store, rank=rank, world_size=size, timeout=TIMEOUT
    )
    _init_control_group()
    return TensorParallelGroup(rank, size, expert_parallel, all2all_backend), store


def _init_control_group() -> None:
    global _control
    _control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def control_group() -> dist.ProcessGroup | None:
    """The group the driver's messages travel on (`CONTROL_TIMEOUT`); None outside one."""
    return _control


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs, to name it when it fails: its host's name, the address it
    reaches the rendezvous from (hosts may share a name, never an address), its pid."""

    rank: int
    host: str
    address: str
    pid: int

    @classmethod
    def here(cls, rank: int, peer: str) -> RankInfo:
        """This process as rank ``rank``, which reaches the other ranks at ``peer``."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # a UDP connect sends nothing: it only asks the routing table
                s.connect((peer, 9))
                address = s.getsockname()[0]
            except OSError:
                address = "?"
        return cls(rank, socket.gethostname(), address, os.getpid())

    def __str__(self) -> str:
        return f"rank {self.rank} on {self.host} ({self.address}, pid {self.pid})"


def destroy_tensor_parallel() -> None:
    global _control
    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the control group too
    _control = None


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: its share, or, with more ranks than KV heads, one,
    replicated on ``size // num_kv_heads`` ranks (vLLM's rule)."""
    return max(1, num_kv_heads // size)

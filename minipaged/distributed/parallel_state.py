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

Pipeline parallelism (vLLM's ``pipeline_parallel_size``, GPipe, Huang et al. 2019) cuts
the model's layers into consecutive stages instead; `PipelineStage` is a stage's place
in the pipeline and its **point-to-point** ops: ``send`` the activations to the next
stage, ``recv`` them from the previous one.  With both, the default group holds
``tensor_parallel_size * pipeline_parallel_size`` ranks in vLLM's layout (rank =
``stage * tensor_parallel_size + tp_rank``) and each stage's ranks form a
tensor-parallel group of their own (`split_pipeline`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "COMM",
    "NO_PIPELINE",
    "SINGLE",
    "TIMELINE",
    "CommStats",
    "PipelineStage",
    "RankInfo",
    "TensorParallelGroup",
    "destroy_tensor_parallel",
    "dist_backend",
    "free_port",
    "init_from_environment",
    "init_tensor_parallel",
    "kv_heads_per_rank",
    "pp_layer_counts",
    "split_pipeline",
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
    group: dist.ProcessGroup | None = None  # None: the default group (no pipeline)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over all ranks, in place (Megatron's ``g`` operator)."""
        if self.size > 1:
            with _timed("all_reduce", x.device):
                dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``x`` (same shape on all) concatenated along ``dim`` on rank 0;
        None on the other ranks."""
        if self.size == 1:
            return x
        with _timed("gather", x.device):
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(x.contiguous(), parts, group=self.group, group_dst=0)
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
            dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape on all) stacked along dim 0, on every rank."""
        if self.size == 1:
            return x
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        with _timed("all_gather", x.device):
            dist.all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over all ranks, split along dim 0 in ``size`` equal parts:
        rank ``r`` gets part ``r``."""
        if self.size == 1:
            return x
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        with _timed("reduce_scatter", x.device):
            dist.reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` (any picklable object), on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        with _timed("broadcast", torch.device("cpu")):
            dist.broadcast_object_list(box, group=self._objects_group(), group_src=0)
        return box[0]

    def gather_object(self, obj) -> list | None:
        """Every rank's ``obj`` (picklable), in rank order, on rank 0; None elsewhere."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, group=self._objects_group(), group_dst=0)
        return out

    def _objects_group(self) -> dist.ProcessGroup | None:
        """Where objects travel: the whole group's (the driver's messages) on the
        control group (`CONTROL_TIMEOUT`), a stage's on its own."""
        return _control if self.group is None else self.group


SINGLE = TensorParallelGroup()  # no parallelism: every collective is the identity


class _timed:
    """Time a block into ``COMM`` (the totals), or into a `Timeline` (the intervals)."""

    def __init__(
        self, kind: str, device: torch.device, timeline: Timeline | None = None, comm: bool = True
    ) -> None:
        self.kind, self.cuda, self.timeline, self.comm = kind, device.type == "cuda", timeline, comm

    def __enter__(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        if self.comm:
            COMM.add(self.kind, end - self.start)
        if self.timeline is not None:
            self.timeline.events.append((self.kind, self.start, end))


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


# -- pipeline parallelism ---------------------------------------------------------------
class Timeline:
    """What this process did, as ``(kind, start, end)`` intervals of ``time.perf_counter``
    (one clock for every process of a machine): ``"forward"`` for a stage's compute,
    ``"send"`` and ``"recv"`` for the time its point-to-point ops waited.  Gathered from
    every rank, it is the pipeline's timeline: what each stage did, and when it idled.
    Only the last ``MAX_EVENTS`` are kept, so a server that never reads it stays small."""

    MAX_EVENTS = 100_000

    def __init__(self) -> None:
        self.events: deque[tuple[str, float, float]] = deque(maxlen=self.MAX_EVENTS)
        self.bytes_sent = 0  # activations and logits this process sent

    @contextlib.contextmanager
    def record(self, kind: str, device: torch.device):
        """Time the block as ``kind`` (after a device sync on CUDA, as `_timed`)."""
        with _timed(kind, device, self, comm=False):
            yield

    def take(self) -> dict:
        """The events and bytes so far, and start afresh."""
        taken = {"events": list(self.events), "bytes_sent": self.bytes_sent}
        self.events.clear()
        self.bytes_sent = 0
        return taken


TIMELINE = Timeline()


def pp_layer_counts(num_layers: int, size: int) -> list[int]:
    """How many of ``num_layers`` decoder layers each of ``size`` stages holds: an even
    share, and the remainder one each on the stages before the last, counting back
    (vLLM's ``get_pp_indices``: the last stage also runs the norm, the LM head and the
    sampling)."""
    counts = [num_layers // size] * size
    for i in range(2, num_layers % size + 2):
        counts[-i] += 1
    return counts


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``rank`` of ``size``: which layers it holds, and the point-to-point ops
    that carry a step's activations to the next stage.  ``tp_size``: ranks per stage,
    so stage ``s``'s tensor-parallel rank ``t`` is global rank ``s * tp_size + t`` and
    talks to the same ``t`` of the stages beside it.  The first stage embeds the
    tokens, the last projects and samples them (its tensor-parallel rank 0 sends the
    logits to the driver, global rank 0).  ``NO_PIPELINE``: one stage, all layers."""

    rank: int = 0
    size: int = 1
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """The indices of the decoder layers this stage holds (`pp_layer_counts`)."""
        counts = pp_layer_counts(num_layers, self.size)
        start = sum(counts[: self.rank])
        return range(start, start + counts[self.rank])

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def send(self, x: torch.Tensor):
        """Start sending ``x`` to the next stage; returns the work to ``wait`` on, so
        the stage computes its next micro-batch meanwhile."""
        TIMELINE.bytes_sent += x.nbytes
        return dist.isend(x.contiguous(), self._peer(self.rank + 1))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """The previous stage's activations, once they arrive (the wait is timed)."""
        x = torch.empty(shape, dtype=dtype, device=device)
        with _timed("recv", x.device, TIMELINE):
            dist.recv(x, self._peer(self.rank - 1))
        return x

    def wait(self, sends: list) -> None:
        """Wait until every send of ``sends`` is done (timed as ``send``)."""
        with _timed("send", torch.device("cpu"), TIMELINE):
            for work in sends:
                work.wait()

    def send_logits(self, logits: torch.Tensor) -> None:
        """The last stage's sampled rows' logits, to the driver."""
        TIMELINE.bytes_sent += logits.nbytes
        with _timed("send", logits.device, TIMELINE):
            dist.send(logits.contiguous(), 0)

    def recv_logits(self, shape: tuple[int, int], device) -> torch.Tensor:
        """The driver's wait for the last stage's logits."""
        x = torch.empty(shape, dtype=torch.float32, device=device)
        with _timed("recv", x.device, TIMELINE):
            dist.recv(x, self._peer(self.size - 1))
        return x


NO_PIPELINE = PipelineStage()


def split_pipeline(
    world: TensorParallelGroup, tp_size: int, pp_size: int
) -> tuple[TensorParallelGroup, PipelineStage]:
    """This rank's tensor-parallel group and pipeline stage, in the default group
    ``world`` of ``tp_size * pp_size`` ranks.  Every rank creates every stage's group
    (``new_group`` is a collective of the whole world), then keeps its own."""
    if pp_size == 1:
        return world, NO_PIPELINE
    stage, tp_rank = divmod(world.rank, tp_size)
    tp = replace(world, rank=0, size=1)
    if tp_size > 1:
        for s in range(pp_size):
            group = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
            if s == stage:
                tp = replace(world, rank=tp_rank, size=tp_size, group=group)
    return tp, PipelineStage(stage, pp_size, tp_size, tp_rank)

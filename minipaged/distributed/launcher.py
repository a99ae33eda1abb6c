"""Ranks a launcher started: tensor parallelism across hosts under ``torchrun`` (vLLM's
``distributed_executor_backend="external_launcher"``).

The engine's own launcher (`minipaged.distributed.executor.WorkerGroup`) spawns its
workers on its machine and talks to them over pipes.  Across hosts there is no parent
process: ``torchrun --nnodes N --nproc-per-node M`` starts every rank, each running the
same command, and they meet in ``torch.distributed``'s ``env://`` rendezvous
(`init_from_environment`).  Then each rank takes the part the engine gives it:

- **rank 0** is the driver: it builds the engine (scheduler, KV cache manager,
  sampler, and for ``serve`` the HTTP port) over a `LaunchedGroup`, which answers
  what a `WorkerGroup` answers;
- **every other rank** is a worker (`run_launched_worker`): it runs the same
  `minipaged.distributed.worker.run_rank` as a spawned worker, with the driver's set-up
  calls coming by broadcast and its answers going back by gather (`GroupChannel`)
  instead of a pipe; when the driver says goodbye it exits 0, so the ``LLM(...)`` of
  a script, ``generate`` and ``serve`` never return on these ranks.

Faults.  The driver cannot see another host's processes, so each worker beats in the
rendezvous's key-value store (`Heartbeat`); when a step fails (a killed rank's sockets
close, and the collective waiting on it raises at once), the driver names the rank whose
heartbeat stopped, with its host and pid (`RankInfo`), and leaves the group, which ends
the other ranks' waits: they exit 1, and ``torchrun`` on every host exits with them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback
import weakref

import torch

from minipaged.config import EngineConfig
from minipaged.distributed.executor import DriverGroup, worker_args
from minipaged.distributed.parallel_state import (
    NO_PIPELINE,
    PipelineStage,
    RankInfo,
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_from_environment,
    split_pipeline,
)
from minipaged.distributed.worker import run_rank

__all__ = ["GroupChannel", "Heartbeat", "LaunchedGroup", "join_launched", "run_launched_worker"]

# A worker's heartbeat interval, and how long the driver watches for heartbeats after a
# failed step before it names a rank dead (room for a busy machine's scheduling).
HEARTBEAT_S = 0.25
DEAD_AFTER_S = 2.0
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def join_launched(
    config: EngineConfig, path, device: torch.device, attention_backend: str
) -> LaunchedGroup:
    """Join the ranks the launcher started: rank 0 returns the driver's `LaunchedGroup`;
    any other rank serves as a worker until the driver shuts down, then exits 0."""
    args = worker_args(config, path, device, attention_backend)
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    size = tp_size * pp_size
    if missing := [name for name in LAUNCHER_VARIABLES if name not in os.environ]:
        unset = "none is" if missing == list(LAUNCHER_VARIABLES) else f"{', '.join(missing)} not"
        raise ValueError(
            "distributed_executor_backend='external_launcher' runs under a launcher that "
            f"sets {', '.join(LAUNCHER_VARIABLES)} (torchrun does); {unset} set here"
        )
    if int(os.environ["WORLD_SIZE"]) != size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} x pipeline_parallel_size={pp_size} needs "
            f"{size} ranks; the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']} "
            "(torchrun: nnodes x nproc-per-node)"
        )
    # torchrun sets OMP_NUM_THREADS for each rank: keep what it chose.
    args = dataclasses.replace(args, num_threads=torch.get_num_threads())
    device = _rank_device(device)
    world, store = init_from_environment(device, args.expert_parallel, args.all2all_backend)
    tp, pp = split_pipeline(world, tp_size, pp_size)
    if world.rank != 0:
        run_launched_worker(world, tp, pp, store, args, device)
        raise SystemExit(0)
    return LaunchedGroup.start(world, tp, pp, store)


def _rank_device(device: torch.device) -> torch.device:
    """GPU ``LOCAL_RANK`` of this host on CUDA (torchrun numbers each host's ranks)."""
    if device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def run_launched_worker(
    world: TensorParallelGroup,
    tp: TensorParallelGroup,
    pp: PipelineStage,
    store,
    args,
    device: torch.device,
) -> None:
    """A launched worker's life: tell the driver where it runs, beat, then `run_rank`
    until the driver's goodbye.  ``SystemExit(1)`` if the set-up fails or the driver
    goes away mid-step (its traceback, or why, on stderr: this host's log)."""
    me = RankInfo.here(world.rank, os.environ["MASTER_ADDR"])
    heartbeat = Heartbeat(store, world.rank)
    channel = GroupChannel(world)
    try:
        channel.send(("ok", me))
        if not run_rank(world, tp, pp, channel, args, device):
            raise SystemExit(f"minipaged: tensor-parallel worker {me} failed to set up")
    except RuntimeError as error:  # the driver died or left mid-step
        traceback.print_exc()
        raise SystemExit(
            f"minipaged: tensor-parallel worker {me} lost the driver (rank 0): {error}"
        ) from None
    finally:
        heartbeat.stop()
        destroy_tensor_parallel()


class GroupChannel:
    """A launched worker's line to the driver, as a spawned worker's pipe is: the
    driver's calls come by broadcast, the answers go back by gather."""

    def __init__(self, world: TensorParallelGroup) -> None:
        self.world = world

    def recv(self):
        return self.world.broadcast_object()

    def send(self, answer) -> None:
        if answer[0] == "error":  # also on this host's log, should the gather never complete
            print(answer[1], file=sys.stderr, flush=True)
        self.world.gather_object(answer)


class Heartbeat:
    """A worker's pulse: a counter in the rendezvous's store, raised every
    ``HEARTBEAT_S`` by a thread of its own until `stop` (or the process dies)."""

    def __init__(self, store, rank: int) -> None:
        self.store, self.key = store, pulse_key(rank)
        self._stopped = threading.Event()
        threading.Thread(target=self._beat, name="minipaged-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                self.store.add(self.key, 1)
            except RuntimeError:  # the store's host is gone: so is the driver
                return

    def stop(self) -> None:
        self._stopped.set()


def pulse_key(rank: int) -> str:
    return f"minipaged/heartbeat/{rank}"


class LaunchedGroup(DriverGroup):
    """The driver's side of ranks a launcher started: what a `WorkerGroup` answers
    (`executor`, the set-up calls, `check`, `fail`, `shutdown`), with every message on
    the group itself and failures found by heartbeat rather than by process."""

    def __init__(
        self,
        world: TensorParallelGroup,
        store,
        tp: TensorParallelGroup | None = None,
        pp: PipelineStage = NO_PIPELINE,
    ) -> None:
        # The whole group (the plan's broadcast), this rank's tensor-parallel part of it
        # and its pipeline stage, as a `WorkerGroup`'s.
        self.world, self.store = world, store
        self.tp, self.pp = tp or world, pp
        self.ranks: list[RankInfo] = []  # ranks 1..N-1, from their hello
        self.failure: str | None = None
        self.in_step = threading.Event()  # as `WorkerGroup.in_step`
        self._finalizer = weakref.finalize(self, _goodbye, world.size, self.in_step)

    @classmethod
    def start(
        cls, world: TensorParallelGroup, tp: TensorParallelGroup, pp: PipelineStage, store
    ) -> LaunchedGroup:
        group = cls(world, store, tp, pp)
        try:
            group.ranks = group.receive()
        except BaseException as error:
            group.fail(error)
            raise
        return group

    def send(self, method: str, *args) -> None:
        self.world.broadcast_object((method, args))

    def call(self, method: str, *args) -> list:
        self.send(method, *args)
        try:
            return self.receive()
        except BaseException as error:
            self.fail(error)
            raise

    def receive(self) -> list:
        """Each worker's next answer, in rank order; raises ``RuntimeError`` naming the
        rank if one reports an error or dies."""
        try:
            answers = self.world.gather_object(None)
        except RuntimeError as error:
            raise RuntimeError(
                self._dead() or f"the tensor-parallel group failed: {error}"
            ) from error
        for rank, (status, value) in enumerate(answers[1:], start=1):
            if status == "error":
                raise RuntimeError(f"tensor-parallel worker {self._name(rank)} failed:\n{value}")
        return [value for _, value in answers[1:]]

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def fail(self, error: BaseException) -> str | None:
        """The group is broken: leave it now (which ends every other rank's wait, so
        they exit) and remember why; returns which rank died, if one did."""
        dead = None
        if self.failure is None:
            dead = self._dead()
            self.failure = (
                dead or f"the tensor-parallel group stopped: {type(error).__name__}: {error}"
            )
        if self._finalizer.detach():
            destroy_tensor_parallel()
        return dead

    def shutdown(self) -> None:
        if self.failure is None:
            self.failure = "the tensor-parallel workers were shut down"
        self._finalizer()

    def _name(self, rank: int) -> str:
        return str(self.ranks[rank - 1]) if len(self.ranks) >= rank else f"rank {rank}"

    def _dead(self) -> str | None:
        """The first worker whose heartbeat stops for ``DEAD_AFTER_S``, if one does."""
        keys = [pulse_key(rank) for rank in range(1, self.world.size)]
        try:
            last = [self.store.add(key, 0) for key in keys]
            deadline = time.monotonic() + DEAD_AFTER_S
            alive = set()
            while time.monotonic() < deadline and len(alive) < len(keys):
                time.sleep(HEARTBEAT_S)
                alive |= {i for i, key in enumerate(keys) if self.store.add(key, 0) != last[i]}
        except RuntimeError:  # the store itself is gone (its host's torchrun died)
            return None
        dead = [rank for rank in range(1, self.world.size) if rank - 1 not in alive]
        if not dead:
            return None
        return f"tensor-parallel worker {self._name(dead[0])} died (its heartbeat stopped)"


def _goodbye(size: int, in_step: threading.Event) -> None:
    """Between steps, tell the workers to leave (the broadcast of None); then leave."""
    if not in_step.is_set():
        try:
            TensorParallelGroup(0, size).broadcast_object(None)
        except RuntimeError:
            pass  # a worker died meanwhile; the others' waits end as the group closes
    destroy_tensor_parallel()

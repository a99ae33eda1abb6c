"""The multi-process executor: a step over a tensor-parallel group (paper §4.6).

`TensorParallelExecutor` is the paper's distributed execution: the engine (scheduler,
KV cache manager, sampler) runs once, in the driver, which is also rank 0;
`WorkerGroup` starts ranks 1..N-1 as processes of their own.  It answers what the
single-device `minipaged.executor.uniproc_executor.Executor` answers, for every rank:
the tightest rank's KV memory budget, each rank's pools, and each step, after the
driver broadcasts the step's plan, the same step on every shard, the driver alone
receiving the logits, gathered.  So the engine's step still reads schedule -> execute
-> sample -> update, whatever the number of ranks.

With ``pipeline_parallel_size`` P > 1 the group holds ``tensor_parallel_size * P``
ranks, a pipeline of P stages (`PipelineStage`) each split over its own tensor-parallel
ranks; the driver is stage 0's first rank, and the plan still goes to every rank.

The workers live as long as their `WorkerGroup`: `WorkerGroup.shutdown` (also run when
the group is garbage collected, and at exit) stops them; a worker that dies makes the
driver's next step raise, naming its rank, after stopping the others.
"""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
import weakref

import torch

from minipaged.config import EngineConfig
from minipaged.core.sched.output import ScheduledSeq, SchedulerOutput
from minipaged.distributed.parallel_state import (
    NO_PIPELINE,
    TIMELINE,
    RankInfo,
    TensorParallelGroup,
    destroy_tensor_parallel,
    free_port,
    init_tensor_parallel,
    pp_layer_counts,
    split_pipeline,
)
from minipaged.distributed.worker import (
    TIMELINE_REQUEST,
    SetKVConnector,
    WorkerArgs,
    rank_kv_config,
    worker_main,
)
from minipaged.executor.uniproc_executor import Executor
from minipaged.models.loader import model_class, read_config
from minipaged.worker.cache_engine import CacheEngine
from minipaged.worker.model_runner import ModelRunner

__all__ = [
    "TensorParallelExecutor",
    "WorkerGroup",
    "on_all_ranks",
    "start_workers",
    "worker_args",
]

# Seconds a worker gets to answer at start-up (loading a shard, profiling memory), to
# leave after the driver's goodbye, and to die after SIGTERM.
START_TIMEOUT = 600
EXIT_TIMEOUT = 10
SPAWN_HINT = (
    "each worker imports the script that runs the driver, as multiprocessing's "
    "spawn does, so a script must build the LLM under `if __name__ == "
    "'__main__':`"
)


class TensorParallelExecutor(Executor):
    """The driver's side of a step over ``workers``: broadcast the plan, then run rank
    0's shard like any other rank.  The workers' pools get as many blocks as the
    driver's, so the block tables hold on every rank, of its dtype; with
    ``calculate_kv_scales`` each rank sets its fp8 scales from the first batch."""

    def __init__(
        self, runner: ModelRunner, workers: WorkerGroup, calculate_kv_scales: bool = False
    ) -> None:
        super().__init__(runner)
        self.workers = workers
        self.calculate_kv_scales = calculate_kv_scales
        # Each rank's GPU pool, from allocate: its layers, and each layer's cache shape.
        self.cache_layers: list[int] = []
        self.cache_shapes: list[tuple[int, ...]] = []

    @property
    def kv_config(self):
        """The model's config as the biggest rank's KV cache sees it: its share of the
        KV heads, and the layers of the biggest pipeline stage (which sizes a block)."""
        config = self.runner.model.config
        layers = max(pp_layer_counts(config.num_hidden_layers, self.workers.pp.size))
        return rank_kv_config(config, self.workers.tp.size, layers)

    @property
    def pool_config(self):
        """The driver's own pools': its KV heads, and its stage's layers."""
        model = self.runner.model
        return rank_kv_config(model.config, self.workers.tp.size, len(model.model.stage_layers))

    def kv_memory_budget(self, config: EngineConfig, max_model_len: int) -> int:
        """Every rank profiles its own GPU, and the tightest sets the blocks of all."""
        return min(
            on_all_ranks(
                self.workers,
                self.runner,
                "kv_memory_budget",
                config.gpu_memory_utilization,
                config.max_num_batched_tokens,
                max_model_len,
            )
        )

    def allocate(
        self, num_gpu_blocks: int, num_cpu_blocks: int, kv_cache_dtype: torch.dtype
    ) -> CacheEngine:
        cache_engine = super().allocate(num_gpu_blocks, num_cpu_blocks, kv_cache_dtype)
        pools = self.workers.call(
            "allocate", num_gpu_blocks, num_cpu_blocks, kv_cache_dtype, self.calculate_kv_scales
        )
        gpu_cache = cache_engine.gpu_cache
        pools = [(len(gpu_cache), tuple(gpu_cache[0][0].shape)), *pools]
        self.cache_layers = [layers for layers, _ in pools]
        self.cache_shapes = [shape for _, shape in pools]
        return cache_engine

    def set_kv_connector(self, connector) -> None:
        """Every rank loads and saves its KV heads through a copy of ``connector``'s
        worker side (sent instead of a plan, `SetKVConnector`), rank 0 through it."""
        self.workers.check()
        self.workers.world.broadcast_object(SetKVConnector(connector))
        super().set_kv_connector(connector)

    def execute(self, batch: SchedulerOutput) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        self.workers.check()
        self.workers.in_step.set()
        try:
            self.workers.world.broadcast_object(batch.runner_view())
            return super().execute(batch)
        except BaseException as error:  # Ctrl-C too: the ranks are out of step for good
            if dead := self.workers.fail(error):
                raise RuntimeError(dead) from error
            raise
        finally:
            self.workers.in_step.clear()

    def timelines(self) -> list[dict]:
        """Every rank's `TIMELINE` since the last call (its events and bytes sent), in
        rank order; each rank starts a new one."""
        self.workers.check()
        self.workers.world.broadcast_object(TIMELINE_REQUEST)
        return self.workers.world.gather_object(TIMELINE.take())


def start_workers(
    config: EngineConfig, path, device: torch.device, attention_backend: str
) -> WorkerGroup:
    """Ranks 1..N-1 of N = ``tensor_parallel_size * pipeline_parallel_size`` > 1 (this
    process is rank 0), once the model is known to split ``tensor_parallel_size`` ways
    (its experts too, with ``enable_expert_parallel``) and into
    ``pipeline_parallel_size`` stages."""
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size * pipeline_parallel_size = {size} needs {size} GPUs, "
            f"torch sees {torch.cuda.device_count()}"
        )
    return WorkerGroup.start(size, worker_args(config, path, device, attention_backend), device)


def worker_args(
    config: EngineConfig, path, device: torch.device, attention_backend: str
) -> WorkerArgs:
    """How every rank builds its shard of the model at ``path``, which must split
    ``tensor_parallel_size`` ways and into ``pipeline_parallel_size`` stages (a
    ``ValueError`` if not)."""
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    model_config = read_config(path)
    cls = model_class(model_config)
    cls.check_parallel(model_config, tp_size, config.enable_expert_parallel)
    if config.kv_transfer_config is not None and model_config.num_key_value_heads % tp_size:
        raise ValueError(
            f"kv_transfer_config cannot run with tensor_parallel_size={tp_size} over the "
            f"model's {model_config.num_key_value_heads} KV heads in minipaged: each rank "
            "must hold its own share of them (a KV connector moves each rank's), none "
            "replicated"
        )
    check_pipeline_parallel(cls, model_config, pp_size)
    return WorkerArgs(
        str(path),
        config.dtype,
        device.type,
        attention_backend,
        config.block_size,
        num_threads(device, tp_size * pp_size),
        config.enable_expert_parallel,
        config.all2all_backend,
        (config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        if config.enable_lora
        else None,
        pp_size,
        config.quantization,
    )


def check_pipeline_parallel(cls, model_config, size: int) -> None:
    """Raise ``ValueError`` unless ``size`` stages can split the model: one whose class
    ``supports_pp`` (vLLM's ``SupportsPP``), at least one decoder layer each."""
    layers = model_config.num_hidden_layers
    if size > layers:
        raise ValueError(
            f"pipeline_parallel_size={size} must be at most the model's "
            f"num_hidden_layers ({layers}): every stage holds at least one layer"
        )
    if size > 1 and not cls.supports_pp:
        raise ValueError(
            f"pipeline_parallel_size={size} is not supported for {cls.__name__} in minipaged"
        )


def num_threads(device: torch.device, size: int) -> int:
    """Threads per rank.  On a CPU the ranks share its cores: as many threads each as
    leave none idle and none fighting (OpenMP threads that compete for a core wait on
    each other)."""
    return max(1, torch.get_num_threads() // size) if device.type == "cpu" else 1


def on_all_ranks(workers: WorkerGroup | None, runner: ModelRunner, method: str, *args) -> list:
    """``runner.method(*args)`` on every rank (rank 0's result first), at once, for set-up
    steps that run the model and so meet in its collectives (memory profiling)."""
    if workers is None:
        return [getattr(runner, method)(*args)]
    workers.send(method, *args)
    try:
        mine = getattr(runner, method)(*args)
        return [mine, *workers.receive()]
    except BaseException as error:
        workers.fail(error)
        raise


class DriverGroup:
    """What the driver asks of its workers however they were started (`WorkerGroup`:
    spawned here; `launcher.LaunchedGroup`: started by torchrun): a subclass says how
    messages travel (``send``, ``receive``) and how a failure is handled (``fail``)."""

    def executor(
        self, runner: ModelRunner, calculate_kv_scales: bool = False
    ) -> TensorParallelExecutor:
        """The driver's executor over this group, rank 0's shard run by ``runner``."""
        return TensorParallelExecutor(runner, self, calculate_kv_scales)

    def wait_loaded(self) -> None:
        """Wait for every worker to have loaded its shard."""
        try:
            self.receive()
        except BaseException as error:
            self.fail(error)
            raise


class WorkerGroup(DriverGroup):
    """Ranks 1..``size``-1 as spawned processes, and the driver's place (rank 0) in
    their ``torch.distributed`` group, ``tp``.

    ``start`` returns once every rank has joined; the workers then load their shards
    while the driver loads its own (`wait_loaded`).  Set-up calls go over a pipe per
    worker; steps go over ``tp`` (`TensorParallelExecutor`).
    """

    def __init__(self, processes: list, conns: list, num_threads: int) -> None:
        self.processes, self.conns = processes, conns
        # Where each runs (this host), to name one that fails as the launcher's ranks are.
        self.ranks = [
            RankInfo(rank, socket.gethostname(), "127.0.0.1", process.pid)
            for rank, process in enumerate(processes, start=1)
        ]
        # The whole group (the plan's broadcast), this rank's tensor-parallel part of
        # it and its pipeline stage (the same group and no pipeline without one).
        self.world = self.tp = TensorParallelGroup()
        self.pp = NO_PIPELINE
        self.failure: str | None = None
        self._threads = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        # Set while a step runs (perhaps in another thread, as in the server): the
        # workers are in its collectives then, and cannot hear a goodbye.
        self.in_step = threading.Event()
        self._finalizer = weakref.finalize(
            self, _stop, processes, conns, self._threads, self.in_step
        )

    @classmethod
    def start(cls, size: int, args: WorkerArgs, device: torch.device) -> WorkerGroup:
        """Spawn ``size - 1`` workers that build their shards as ``args`` says, and form
        the group with them (this process is rank 0)."""
        # Not fork: a forked child of a process whose torch (or CUDA) started threads
        # may deadlock on locks those threads held.
        context = multiprocessing.get_context("spawn")
        port, processes, conns = free_port(), [], []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(rank, size, port, theirs, args),
                name=f"minipaged-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        group = cls(processes, conns, args.num_threads)
        try:
            try:  # every worker has started, so joining cannot wait on a dead one
                group.receive()
            except RuntimeError as error:
                raise RuntimeError(f"{error}, before it started: {SPAWN_HINT}") from None
            group.world = init_tensor_parallel(
                0, size, port, device, args.expert_parallel, args.all2all_backend
            )
            pp_size = args.pipeline_parallel_size
            group.tp, group.pp = split_pipeline(group.world, size // pp_size, pp_size)
        except BaseException as error:
            group.fail(error)
            raise
        return group

    def send(self, method: str, *args) -> None:
        for conn in self.conns:
            conn.send((method, args))

    def call(self, method: str, *args) -> list:
        """``runner.method(*args)`` on every worker (not the driver); their results."""
        self.send(method, *args)
        try:
            return self.receive()
        except BaseException as error:
            self.fail(error)
            raise

    def receive(self) -> list:
        """Each worker's next answer, in rank order; raises ``RuntimeError`` naming the
        rank if a worker reports an error, dies or takes longer than ``START_TIMEOUT``."""
        answers = []
        for rank, process, conn in zip(self.ranks, self.processes, self.conns):
            deadline = time.monotonic() + START_TIMEOUT
            while not conn.poll(0.05):
                if not process.is_alive():
                    raise RuntimeError(_died(rank, process))
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel worker {rank} did not answer in {START_TIMEOUT} s"
                    )
            try:
                status, value = conn.recv()
            except EOFError:  # it closed its end: it is exiting
                process.join(EXIT_TIMEOUT)
                raise RuntimeError(_died(rank, process)) from None
            if status == "error":
                raise RuntimeError(f"tensor-parallel worker {rank} failed:\n{value}")
            answers.append(value)
        return answers

    def check(self) -> None:
        """Raise ``RuntimeError`` if the group has failed or a worker has died."""
        if self.failure is None:
            for rank, process in zip(self.ranks, self.processes):
                if not process.is_alive():
                    self.fail(RuntimeError(_died(rank, process)))
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def fail(self, error: BaseException) -> str | None:
        """The group is broken (a worker died, or a step was interrupted midway): stop
        every worker now and remember why; returns which rank died, if one did."""
        dead = None
        if self.failure is None:
            dead = _dead_rank(self.ranks, self.processes)
            self.failure = (
                dead or f"the tensor-parallel group stopped: {type(error).__name__}: {error}"
            )
        if self._finalizer.detach():
            _stop(self.processes, self.conns, self._threads)
        return dead

    def shutdown(self) -> None:
        """Stop the workers (idempotent); afterwards every step raises."""
        if self.failure is None:
            self.failure = "the tensor-parallel workers were shut down"
        self._finalizer()


def _stop(
    processes: list, conns: list, num_threads: int, in_step: threading.Event | None = None
) -> None:
    """Between steps, tell healthy workers to leave (the broadcast of None); then make
    sure every one is gone: SIGTERM, then SIGKILL, for any that is not."""
    goodbye = in_step is not None and not in_step.is_set()
    if goodbye and processes and all(p.is_alive() for p in processes):
        try:
            TensorParallelGroup(0, len(processes) + 1).broadcast_object(None)
        except RuntimeError:
            pass  # a worker died meanwhile; it is reaped below
    for process in processes:
        process.join(EXIT_TIMEOUT if goodbye else 0)
    for stop in ("terminate", "kill"):
        for process in processes:
            if process.is_alive():
                getattr(process, stop)()
                process.join(EXIT_TIMEOUT)
    for conn in conns:
        conn.close()
    destroy_tensor_parallel()
    torch.set_num_threads(num_threads)


def _dead_rank(ranks: list[RankInfo], processes: list, wait: float = 2.0) -> str | None:
    """Say which worker died, if one has (a collective can fail a moment before the
    dead process is reaped)."""
    deadline = time.monotonic() + wait
    while True:
        for rank, process in zip(ranks, processes):
            if not process.is_alive():
                return _died(rank, process)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _died(rank: RankInfo, process) -> str:
    return f"tensor-parallel worker {rank} died with exit code {process.exitcode}"

"""A tensor-parallel worker process: one rank's slice of the model and of the KV cache
(paper §4.6).

The paper's workers hold a shard of every layer and the KV cache of their own attention
heads; they schedule nothing.  Each step the driver broadcasts the step's plan (the
`SchedulerOutput` less the engine's objects, `SchedulerOutput.runner_view`: the block
operations to run and the diff against the persistent batch every rank's runner keeps,
`minipaged.worker.input_batch`) and every rank runs the same step on its shard: the cache engine's
swaps and copies on its own pools, then the model runner's forward pass, whose
collectives (two all-reduces per layer, the gather of the logits) meet the driver's.
The block tables are the driver's: every rank has the same number of blocks, so a
block id means the same slot on all of them.

Under pipeline parallelism the plan goes to every rank of every stage, and each runs
the block operations on the pools of its own layers; the forward pass then goes stage
to stage (`minipaged.worker.model_runner.ModelRunner`).  Between steps the driver may ask
instead for every rank's `TIMELINE` (`TIMELINE_REQUEST`), to draw the pipeline.
"""

from __future__ import annotations

import copy
import os
import signal
import traceback
from dataclasses import dataclass

import torch

from minipaged.distributed.parallel_state import (
    TIMELINE,
    PipelineStage,
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
    kv_heads_per_rank,
    split_pipeline,
)
from minipaged.models.attention import calculate_kv_scales_on_next_batch, head_dim
from minipaged.models.loader import load_model
from minipaged.worker.cache_engine import CacheEngine
from minipaged.worker.model_runner import ModelRunner

__all__ = [
    "TIMELINE_REQUEST",
    "SetKVConnector",
    "WorkerArgs",
    "rank_device",
    "rank_kv_config",
    "run_rank",
    "worker_main",
]

# Broadcast instead of a plan: every rank answers with its timeline (`gather_object`).
TIMELINE_REQUEST = "timeline"


@dataclass(frozen=True)
class SetKVConnector:
    """Broadcast instead of a plan, once: the worker side of the engine's KV connector,
    a copy of which every rank's runner then loads and saves its KV heads through."""

    connector: object


@dataclass(frozen=True)
class WorkerArgs:
    """How every rank builds its shard (the driver's settings)."""

    path: str
    dtype: str
    device: str  # "cpu" or "cuda"
    attention_backend: str
    block_size: int
    num_threads: int
    expert_parallel: bool
    all2all_backend: str
    lora: tuple[int, int, int] | None = None  # (max_loras, max_lora_rank, max_cpu_loras)
    pipeline_parallel_size: int = 1
    quantization: str | None = None  # `EngineConfig.quantization`


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``r`` computes on GPU ``r``; on a CPU, all ranks share it."""
    return torch.device("cuda", rank) if device == "cuda" else torch.device(device)


def rank_kv_config(config, size: int, num_layers: int | None = None):
    """``config`` as one rank's KV cache sees it: `kv_heads_per_rank` KV heads of the
    same ``head_dim``, and, on a pipeline stage, ``num_layers`` layers (for
    `allocate_kv_caches` and `block_bytes`)."""
    if size == 1 and num_layers in (None, config.num_hidden_layers):
        return config
    view = copy.copy(config)
    view.head_dim = head_dim(config)  # fixed before the head counts change under it
    view.num_key_value_heads = kv_heads_per_rank(config.num_key_value_heads, size)
    view.num_hidden_layers = num_layers or config.num_hidden_layers
    return view


def worker_main(rank: int, size: int, port: int, conn, args: WorkerArgs) -> None:
    """A spawned worker process's life: join the group at the driver's loopback
    ``port``, then `run_rank` with the driver's pipe, ``conn``."""
    # Ctrl-C reaches every process of the terminal's group; only the driver acts on it
    # (it stops the workers), so a worker never dies mid-collective on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(args.num_threads)
    try:
        conn.send(("hello", os.getpid()))
        device = rank_device(args.device, rank)
        world = init_tensor_parallel(
            rank, size, port, device, args.expert_parallel, args.all2all_backend
        )
        pp_size = args.pipeline_parallel_size
        tp, pp = split_pipeline(world, size // pp_size, pp_size)
    except Exception:  # noqa: BLE001 (the driver re-raises it, naming this rank)
        conn.send(("error", traceback.format_exc()))
        return
    run_rank(world, tp, pp, conn, args, device)


def run_rank(
    world: TensorParallelGroup,
    tp: TensorParallelGroup,
    pp: PipelineStage,
    conn,
    args: WorkerArgs,
    device: torch.device,
) -> bool:
    """A worker's rank, once in the group ``world`` (its tensor-parallel part ``tp``,
    its stage ``pp``): load its shard, answer the driver's set-up calls on ``conn``
    (``send`` and ``recv``), then run broadcast steps until the driver sends None.
    Returns False, having sent the traceback, if the set-up failed."""
    try:
        model = load_model(
            args.path,
            args.dtype,
            device,
            args.attention_backend,
            tp,
            pp,
            quantization=args.quantization,
        )
        runner = ModelRunner(model, args.block_size, device)
        if args.lora:
            runner.enable_lora(*args.lora)
        conn.send(("ok", None))
        cache_engine = _set_up(conn, runner, tp, args.block_size, device)
    except Exception:  # noqa: BLE001 (the driver re-raises it, naming this rank)
        conn.send(("error", traceback.format_exc()))
        return False
    try:
        while (plan := world.broadcast_object()) is not None:
            if plan == TIMELINE_REQUEST:
                world.gather_object(TIMELINE.take())
                continue
            if isinstance(plan, SetKVConnector):
                runner.set_kv_connector(plan.connector)
                continue
            cache_engine.execute(plan)
            runner.activate_loras(plan.lora_loads)
            runner.execute_model(plan, cache_engine.gpu_cache)
    finally:
        destroy_tensor_parallel()
    return True


def _set_up(
    conn, runner: ModelRunner, tp: TensorParallelGroup, block_size: int, device: torch.device
) -> CacheEngine:
    """Answer ``(method, args)`` calls on the runner until ``("allocate", (num_gpu_blocks,
    num_cpu_blocks, kv_cache_dtype, calculate_kv_scales))``, which builds this rank's
    pools and ends the set-up."""
    while True:
        method, call_args = conn.recv()
        if method == "allocate":
            model = runner.model
            config = rank_kv_config(model.config, tp.size, len(model.model.stage_layers))
            num_gpu_blocks, num_cpu_blocks, dtype, calculate_kv_scales = call_args
            cache_engine = CacheEngine(
                config, num_gpu_blocks, num_cpu_blocks, block_size, dtype, device
            )
            if calculate_kv_scales:
                calculate_kv_scales_on_next_batch(runner.model)
            gpu_cache = cache_engine.gpu_cache
            conn.send(("ok", (len(gpu_cache), tuple(gpu_cache[0][0].shape))))
            return cache_engine
        conn.send(("ok", getattr(runner, method)(*call_args)))

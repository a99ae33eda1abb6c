"""A tensor-parallel worker process: one rank's slice of the model and of the KV cache
(paper §4.6).

The paper's workers hold a shard of every layer and the KV cache of their own attention
heads; they schedule nothing.  Each step the driver broadcasts a `StepPlan` (the block
operations to run and, per scheduled sequence, the tokens to run, where they start and
its block table) and every rank runs the same step on its shard: the cache engine's
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

from minipaged.core.sched.output import ScheduledSeq, SchedulerOutput
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
from minipaged.sequence import Sequence
from minipaged.worker.cache_engine import CacheEngine
from minipaged.worker.model_runner import ModelRunner

__all__ = [
    "TIMELINE_REQUEST",
    "StepPlan",
    "StepTokens",
    "WorkerArgs",
    "rank_device",
    "rank_kv_config",
    "run_rank",
    "worker_main",
]

# Broadcast instead of a plan: every rank answers with its timeline (`gather_object`).
TIMELINE_REQUEST = "timeline"


@dataclass
class StepPlan:
    """What a worker needs of one `SchedulerOutput`: no requests, no sampling."""

    # Per sequence: (start, its tokens to run, block table, slot mapping, samples,
    # LoRA slot, the positions whose logits score prompt tokens (every rank projects
    # them), and a draft's guesses run after the tokens).
    seqs: list[tuple[int, list[int], list[int], list[int], bool, int, range, list[int]]]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    lora_loads: list

    @classmethod
    def of(cls, batch: SchedulerOutput) -> StepPlan:
        seqs = [
            (
                s.start,
                s.seq.token_ids[s.start : s.start + s.num_new_tokens - len(s.spec_token_ids)],
                s.block_table,
                s.slot_mapping,
                s.samples,
                s.lora_slot,
                s.prompt_logprob_positions,
                s.spec_token_ids,
            )
            for s in batch.seqs
        ]
        return cls(seqs, batch.swap_out, batch.swap_in, batch.copies, batch.lora_loads)

    def batch(self) -> SchedulerOutput:
        """The plan as the `SchedulerOutput` the cache engine and model runner take."""
        seqs = [
            ScheduledSeq(
                Sequence("", StepTokens(start, tokens), 0),
                None,
                start,
                len(tokens) + len(spec),
                table,
                slots,
                samples,
                lora_slot,
                positions,
                spec,
            )
            for start, tokens, table, slots, samples, lora_slot, positions, spec in self.seqs
        ]
        return SchedulerOutput(
            seqs, self.swap_out, self.swap_in, self.copies, lora_loads=self.lora_loads
        )


class StepTokens:
    """A sequence's token ids as a worker knows them: ``len`` says how long it is, but
    only the tokens from ``start`` on (this step's) can be read."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __len__(self) -> int:
        return self.start + len(self.tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            first, stop, step = index.indices(len(self))
            if first < self.start and first < stop:
                raise IndexError(f"a worker knows tokens {self.start} onwards, not {first}")
            return self.tokens[first - self.start : stop - self.start : step]
        index = index + len(self) if index < 0 else index
        if not self.start <= index < len(self):
            raise IndexError(f"a worker knows tokens {self.start}..{len(self) - 1}, not {index}")
        return self.tokens[index - self.start]


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
        model = load_model(args.path, args.dtype, device, args.attention_backend, tp, pp)
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
            batch = plan.batch()
            cache_engine.execute(batch)
            runner.activate_loras(batch.lora_loads)
            runner.execute(batch.seqs, cache_engine.gpu_cache)
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

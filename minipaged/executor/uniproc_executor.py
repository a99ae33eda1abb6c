"""The executor: where a scheduled step runs (paper §4.6's driver, on one device).

The engine asks its executor three things: how much memory the KV cache may take
(`kv_memory_budget`, a profiling step of the model), to allocate the KV pools of the
blocks it decided on (`allocate`), and, every step, to `execute` a `SchedulerOutput`: the
cache engine's block operations (swap out, swap in, copy-on-write copies, in the KV
cache manager's order), then the model runner's forward pass over its persistent batch
(`ModelRunner.execute_model`, which takes the scheduler's diff).  It returns the sequences
that sample and their logits.

`Executor` is one process.  With ``tensor_parallel_size`` > 1 the engine runs
`minipaged.distributed.executor.TensorParallelExecutor` instead, which asks the same of
every rank; this module, like the rest of the single-device path, never imports it.
"""

from __future__ import annotations

import torch

from minipaged.config import EngineConfig
from minipaged.core.sched.output import ScheduledSeq, SchedulerOutput, sampling_seqs
from minipaged.worker.cache_engine import CacheEngine
from minipaged.worker.model_runner import ModelRunner


class Executor:
    """A step on one process: block operations, then the forward pass."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache_engine: CacheEngine | None = None  # from `allocate`

    @property
    def kv_config(self):
        """The model's config as a KV block is sized: every KV head, every layer."""
        return self.runner.model.config

    @property
    def pool_config(self):
        """The model's config as this process's pools hold it (the same, on one device)."""
        return self.kv_config

    def kv_memory_budget(self, config: EngineConfig, max_model_len: int) -> int:
        """Bytes of GPU memory for KV blocks (`ModelRunner.kv_memory_budget`)."""
        return self.runner.kv_memory_budget(
            config.gpu_memory_utilization, config.max_num_batched_tokens, max_model_len
        )

    def allocate(
        self, num_gpu_blocks: int, num_cpu_blocks: int, kv_cache_dtype: torch.dtype
    ) -> CacheEngine:
        """The GPU and CPU KV pools of ``num_gpu_blocks`` and ``num_cpu_blocks`` blocks,
        of ``kv_cache_dtype`` (the model's, or fp8/int8 for a quantized cache)."""
        self.cache_engine = CacheEngine(
            self.pool_config,
            num_gpu_blocks,
            num_cpu_blocks,
            self.runner.block_size,
            kv_cache_dtype,
            self.runner.device,
        )
        return self.cache_engine

    def set_kv_connector(self, connector) -> None:
        """Load and save KV through ``connector``'s worker side (`ModelRunner`)."""
        self.runner.set_kv_connector(connector)

    def execute(self, batch: SchedulerOutput) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        """Run ``batch``; returns the sequences that sample, and their logits."""
        self.cache_engine.execute(batch)
        self.runner.activate_loras(batch.lora_loads)
        req_ids, logits = self.runner.execute_model(batch, self.cache_engine.gpu_cache)
        if not req_ids:
            return [], logits
        return sampling_seqs(batch, req_ids), logits

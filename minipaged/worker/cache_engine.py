"""The cache engine: the KV cache tensors, and the block operations the scheduler orders
(paper §4.3, §4.4, §4.5).

It owns two pools of the same layout, per layer a ``(key_cache, value_cache)`` pair of
``[num_blocks, block_size, num_kv_heads, head_dim]``: the GPU pool the model reads and
writes, and a CPU pool that swapped-out blocks wait in.  The memory layer hands out block
ids; this is where a block id becomes bytes.  Each step it runs the step's operations in
the order the KV cache manager's contract gives (swap out, swap in, copy-on-write), each
as one batched gather/scatter per layer rather than one copy per block.

A quantized cache (``kv_cache_dtype`` fp8 or int8, `minipaged.ops.kv_quant`) stores a
byte per element, so a block takes half the bytes of bf16 and the same budget holds
twice the blocks.  Its layers carry ``k_scale, v_scale`` too: int8's, one per slot and
KV head, travel with their blocks (swap, copy-on-write); fp8's, one per layer, stay.

How many blocks each pool gets is decided once, at start-up (`pool_sizes`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from minipaged.config import EngineConfig
from minipaged.core.memory.block_table import blocks_for
from minipaged.core.sched.output import SchedulerOutput
from minipaged.models.attention import allocate_kv_caches, head_dim, latent_dim

logger = logging.getLogger("minipaged")

# Per layer (key_cache, value_cache), and k_scale, v_scale for a quantized cache.
KVCaches = list[tuple[torch.Tensor, ...]]
GIB = 1 << 30
# The share of the host's available memory the KV pools in it (the CPU device's pool, the
# swap pool) may take: the rest is for activations, the tokenizer and everyone else.
HOST_KV_SHARE = 0.5


def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers: keys and values of ``block_size`` tokens
    in the cache's ``dtype``, and int8's float32 scale per token and KV head; under
    latent attention, one latent vector per token (`latent_dim`)."""
    if latent := latent_dim(config):  # one latent vector per token and layer
        return config.num_hidden_layers * block_size * latent * dtype.itemsize
    heads = 2 * config.num_hidden_layers * config.num_key_value_heads
    scale = torch.float32.itemsize if dtype == torch.int8 else 0
    return heads * block_size * (head_dim(config) * dtype.itemsize + scale)


def pool_sizes(
    config: EngineConfig,
    max_model_len: int,
    device: torch.device,
    per_block: int,
    kv_memory_budget: Callable[[], int],
    draft_per_block: int = 0,
) -> tuple[int, int]:
    """The GPU pool's and the CPU swap pool's blocks (§4.5): what was asked for, but
    never more than ``max_num_seqs`` sequences of ``max_model_len`` tokens could use,
    nor (for pools in host memory) more than half the memory available now.  On CUDA,
    without ``num_gpu_blocks``, ``kv_memory_budget()`` is the bytes the GPU has left
    for KV blocks (a profiling step of the model).

    A draft model (speculative decoding) has a pool of its own with as many blocks as
    the GPU pool, ``draft_per_block`` bytes each: a GPU block costs both, so the same
    budget holds fewer.  Swapped blocks are the target's alone."""
    most = config.max_num_seqs * blocks_for(max_model_len, config.block_size)
    gpu_per_block = per_block + draft_per_block
    host_bytes = HOST_KV_SHARE * available_memory()
    if config.num_gpu_blocks:
        num_gpu_blocks = config.num_gpu_blocks
    elif device.type == "cuda":
        num_gpu_blocks = min(_cuda_num_gpu_blocks(config, kv_memory_budget(), gpu_per_block), most)
    else:
        num_gpu_blocks = max(
            1,
            min(
                int(config.cpu_kv_space * GIB // gpu_per_block),
                most,
                int(host_bytes // gpu_per_block),
            ),
        )
    if device.type == "cpu":  # both pools share the host's memory
        host_bytes = max(0, host_bytes - num_gpu_blocks * gpu_per_block)
    return num_gpu_blocks, min(
        int(config.swap_space * GIB // per_block), most, int(host_bytes // per_block)
    )


def fit_max_model_len(
    max_model_len: int, asked: int | None, num_gpu_blocks: int, block_size: int
) -> int:
    """``max_model_len`` if one sequence that long fits the GPU pool (vLLM's start-up
    check).  If not: asked for (``asked``, the ``max_model_len`` setting), a
    ``ValueError`` naming both numbers and the settings that fix it, as vLLM raises;
    taken from the model, the pool's length instead, with a warning (as vLLM's
    ``--max-model-len auto``), so a small pool serves what it can hold."""
    capacity = num_gpu_blocks * block_size
    if max_model_len <= capacity:
        return max_model_len
    if asked is not None:
        raise ValueError(
            f"max_model_len={max_model_len} does not fit the KV cache: one sequence that "
            f"long needs {blocks_for(max_model_len, block_size)} blocks of {block_size} "
            f"tokens, and the pool has {num_gpu_blocks} ({capacity} tokens); lower "
            "max_model_len (--max-model-len) or give the pool more blocks "
            "(--num-gpu-blocks, --gpu-memory-utilization on CUDA, --cpu-kv-space on a CPU)"
        )
    logger.warning(
        "max_model_len lowered from the model's %d to %d tokens: the KV pool of %d "
        "blocks of %d tokens holds no longer sequence (--num-gpu-blocks or "
        "--max-model-len to choose)",
        max_model_len,
        capacity,
        num_gpu_blocks,
        block_size,
    )
    return capacity


def _cuda_num_gpu_blocks(config: EngineConfig, budget: int, per_block: int) -> int:
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} "
            "leaves no GPU memory for the KV cache after the weights "
            "and a full step's activations"
        )
    return num_blocks


def available_memory() -> int:
    """Bytes of host memory available now: free plus reclaimable (``MemAvailable``),
    else the free pages ``sysconf`` counts."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class CacheEngine:
    """The GPU and CPU KV pools of one model."""

    def __init__(
        self,
        config,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.gpu_cache: KVCaches = allocate_kv_caches(
            config, num_gpu_blocks, block_size, dtype, device
        )
        # Uninitialised: a CPU block is only ever read after a swap-out wrote it, and
        # untouched pages of a large pool cost no memory.  Pinned, so copies to and
        # from the GPU run at full bus speed.
        self.cpu_cache: KVCaches = [
            tuple(_cpu_twin(t, num_cpu_blocks, device.type == "cuda") for t in layer)
            for layer in self.gpu_cache
        ]

    def execute(self, out: SchedulerOutput) -> None:
        """Run a step's block operations, in the contract's order."""
        if out.swap_out:
            _copy_blocks(self.gpu_cache, self.cpu_cache, out.swap_out)
        if out.swap_in:
            _copy_blocks(self.cpu_cache, self.gpu_cache, out.swap_in)
        if out.copies:
            _copy_blocks(self.gpu_cache, self.gpu_cache, out.copies)


def _cpu_twin(tensor: torch.Tensor, num_blocks: int, pin: bool) -> torch.Tensor:
    """The swap pool's counterpart of a GPU pool tensor: ``num_blocks`` rows of a
    per-block tensor (a cache, int8's scales); a per-layer scale (fp8's) is shared."""
    if tensor.dim() == 0:
        return tensor
    shape = (num_blocks, *tensor.shape[1:])
    return torch.empty(shape, dtype=tensor.dtype, pin_memory=pin)


def _copy_blocks(src: KVCaches, dst: KVCaches, pairs: list[tuple[int, int]]) -> None:
    """``dst[d] = src[s]`` for every ``(s, d)`` pair, in every layer: keys and values,
    and the scales that belong to blocks (int8's)."""
    src_device, dst_device = src[0][0].device, dst[0][0].device
    src_ids = torch.tensor([s for s, _ in pairs], device=src_device)
    dst_ids = torch.tensor([d for _, d in pairs], device=dst_device)
    for src_layer, dst_layer in zip(src, dst):
        for src_cache, dst_cache in zip(src_layer, dst_layer):
            if src_cache.dim() == 0:  # a scale of the whole layer: no block's own
                continue
            # The gather finishes before the scatter, so overlapping pairs are safe.  A
            # blocking copy: the CPU side must not read a device-to-host copy in flight.
            dst_cache[dst_ids] = src_cache[src_ids].to(dst_device)

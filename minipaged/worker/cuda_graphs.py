"""Decode steps replayed from CUDA graphs (as vLLM and nano-vllm do).

A decode step runs one token per sequence through every layer: hundreds of small kernel
launches, each costing the CPU a few microseconds.  At small batches the GPU finishes
the work faster than Python can launch it, and sits idle.  A CUDA graph records a whole
step's launches once and replays them with one call.

Replaying reruns the recorded kernels on the recorded addresses with the recorded grid
sizes, so everything a step varies must live in fixed buffers and fixed shapes:

- one graph per batch size in `graph_batch_sizes`; a step's batch is padded up to the
  next one (`padded_batch_size`), its padding rows writing no KV (slot -1) and attending
  to one token;
- the inputs (token ids, positions, slot mapping, block tables, context lengths) are
  copied into static buffers before each replay; block tables are as wide as
  ``max_model_len`` needs;
- the decode op's launch depends on a bound on the step's longest context
  (``max_decode_context_len``): the CUDA kernels size their shared memory and choose
  between versions 1 and 2 by it, Triton its split count.  So each batch size is
  captured once per context bound of `graph_context_bounds` (1K, 4K, 16K, ... tokens,
  up to what ``max_model_len`` needs), and a step replays the graph of the smallest
  bound that holds its longest context (`context_bound`): a batch of short sequences
  launches what it needs, not what the longest possible one would.  The kernels read
  each sequence's real length from ``decode_context_lens``.

Prefill steps, and mixed steps, run eagerly: their token counts vary too much to pad.
The engine captures the graphs at start-up where they can run (`uses_decode_graphs`).
"""

from __future__ import annotations

import bisect
import math

import torch

from minipaged.config import EngineConfig
from minipaged.models.attention import AttentionMetadata
from minipaged.models.llama import sliding_window

SMALL_BATCHES = (1, 2, 4, 8)
BATCH_STEP = 16
# Context bounds captured: 1K tokens, then x4 each (4K, 16K, 64K), then the largest.
# Factor 4 keeps the graphs few (4 per batch size at a 32K context) while a step's bound
# is at most 4x its longest context.
FIRST_CONTEXT_BOUND = 1024
CONTEXT_BOUND_STEP = 4


def uses_decode_graphs(
    config: EngineConfig, device: torch.device, attention_backend: str, model_config
) -> bool:
    """On CUDA, unless ``enforce_eager``: with the kernel backends (the torch
    reference's data-dependent shapes cannot be captured), without a sliding window
    (its check reads the positions on the host), for a dense model (a mixture of
    experts counts each expert's tokens on the host to group them), and without LoRA
    (its segments are read on the host too)."""
    return (
        device.type == "cuda"
        and not config.enforce_eager
        and config.tensor_parallel_size == 1  # collectives are not captured
        and config.pipeline_parallel_size == 1  # nor a stage's sends and receives
        and not config.enable_lora  # the LoRA segments are read on the host
        and attention_backend in ("triton", "cuda")
        and sliding_window(model_config) is None
        and getattr(model_config, "num_experts", None) is None
    )


def capture_decode_graphs(runner, kv_caches, max_num_seqs: int, max_model_len: int) -> None:
    """``runner.capture_decode_graphs``, whose failure says how to run without them."""
    try:
        runner.capture_decode_graphs(kv_caches, max_num_seqs, max_model_len)
    except RuntimeError as error:
        raise RuntimeError(
            f"capturing the decode CUDA graphs failed ({error}); "
            "enforce_eager=True (--enforce-eager) runs without them"
        ) from error


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 16, up to and
    including ``max_num_seqs`` (nano-vllm's choice: padding wastes at most 15 rows)."""
    sizes = [s for s in SMALL_BATCHES if s < max_num_seqs]
    sizes += range(BATCH_STEP, max_num_seqs, BATCH_STEP)
    return [*sizes, max_num_seqs]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None if none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graph_context_bounds(max_model_len: int, block_size: int) -> list[int]:
    """The context bounds captured, ascending: `FIRST_CONTEXT_BOUND` times powers of
    `CONTEXT_BOUND_STEP` below the block tables' capacity, then the capacity itself
    (``max_model_len`` rounded up to whole blocks); each a whole number of blocks."""
    capacity = math.ceil(max_model_len / block_size) * block_size
    bounds, bound = [], FIRST_CONTEXT_BOUND
    while bound < capacity:
        bounds.append(math.ceil(bound / block_size) * block_size)
        bound *= CONTEXT_BOUND_STEP
    return sorted({*bounds, capacity})


def context_bound(max_context_len: int, bounds: list[int]) -> int:
    """The smallest of ``bounds`` that holds ``max_context_len`` tokens (a step's longest
    context never exceeds the largest: the block tables' capacity)."""
    i = bisect.bisect_left(bounds, max_context_len)
    if i == len(bounds):
        raise ValueError(
            f"max_context_len {max_context_len} exceeds the largest captured bound {bounds[-1]}"
        )
    return bounds[i]


class DecodeGraphs:
    """One CUDA graph of the model's decode forward per batch size and context bound,
    over static buffers."""

    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.context_bounds = graph_context_bounds(max_model_len, block_size)
        rows, width = self.sizes[-1], math.ceil(max_model_len / block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.replays_per_bound = dict.fromkeys(self.context_bounds, 0)
        self._capture(model, kv_caches, device)

    def _capture(self, model, kv_caches, device) -> None:
        # Largest first: the smaller graphs then fit in the memory pool it leaves.
        pool = None
        for size in reversed(self.sizes):
            for bound in reversed(self.context_bounds):
                metadata = self._metadata(size, bound)
                args = (self.input_ids[:size], self.positions[:size], kv_caches, metadata)
                model(*args)  # compiles every kernel, outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    hidden = model(*args)
                pool = graph.pool()
                self.graphs[size, bound] = graph, hidden
        torch.cuda.synchronize(device)

    def _metadata(self, size: int, bound: int) -> AttentionMetadata:
        return AttentionMetadata.decode(
            self.slot_mapping[:size],
            self.block_tables[:size],
            self.context_lens[:size],
            bound,
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor | None:
        """The hidden states of a decode-only step, by replay; None if its batch is
        larger than every graph (the caller then runs it eagerly)."""
        n = input_ids.shape[0]
        size = padded_batch_size(n, self.sizes)
        if size is None or attn.num_prefill_tokens:
            return None
        width = attn.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)  # padding rows write nowhere
        self.block_tables[:n, :width].copy_(attn.decode_block_tables)
        self.context_lens[:n].copy_(attn.decode_context_lens)
        self.context_lens[n:size].fill_(1)  # and attend to one token of any block
        bound = context_bound(attn.max_decode_context_len, self.context_bounds)
        graph, hidden = self.graphs[size, bound]
        graph.replay()
        self.num_replays += 1
        self.replays_per_bound[bound] += 1
        return hidden[:n]

"""Decode steps through one compiled graph on the CPU (vLLM's CPU backend compiles so).

A decode step runs a few rows through every layer: on a CPU, a few hundred small
torch calls, each paying Python's and the dispatcher's overhead, between the
projections that do the work.  ``torch.compile`` traces the eager model once into one
graph (TorchDynamo) and has inductor turn it into generated code: the layers' glue
(views, casts, adds) fused into a few C++ loops, each projection's weight packed once
for oneDNN (inductor's ``freezing``, which treats the weights as constants), and every
step one call of that code: the CPU's counterpart of the CUDA graphs a GPU replays
(`minipaged.worker.cuda_graphs`).  The eager model stays the readable reference, and what
runs unless ``compilation_config`` asks for mode 1.

What the graph may contain decides what compiles:

- the C++ ops (attention, the KV write, the fused norms, rotary and activation) are
  registered with torch's dispatcher, each with a shape-only version
  (`minipaged.ops.cpu_ops.register_fakes`), so the trace keeps each as one call;
- the backend and the kernel build are resolved before tracing (`bind_backends`);
- the batch size and the block tables' width are symbolic (``dynamic=True``): one graph
  serves every decode batch.  torch specializes a size of 1, so a batch of one runs
  padded to two (`pad`), the padding row writing no KV (slot -1) and attending to one
  token, and so does a block table one block wide;
- the graph is compiled at start-up on such a batch, where the engine would otherwise
  stall its first decode step for the compile (tens of seconds).

Prefill and mixed steps run eagerly, their shapes and splits varying step to step.
vLLM compiles by default; minipaged only when asked, as the compile takes about a
minute on two cores.  The engine checks first that the graph can run here
(`check_compiled_decode`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minipaged.config import EngineConfig
from minipaged.models.attention import AttentionMetadata, bind_backends
from minipaged.models.llama import sliding_window
from minipaged.ops import cpu_ops

# Batches and block tables below this size run padded to it: torch compiles a
# dimension of size 1 apart.
MIN_SIZE = 2


def check_compiled_decode(
    config: EngineConfig, device: torch.device, attention_backend: str, model_config
) -> None:
    """Raise ``ValueError`` saying why, if the decode forward cannot be one graph here."""
    reason = _why_not(config, device, attention_backend, model_config)
    if reason:
        raise ValueError(f"compilation_config mode 1 compiles {reason}")


def _why_not(config, device, attention_backend, model_config) -> str | None:
    """What keeps the decode forward from one graph, if anything: the torch reference
    reads lengths on the host, collectives and a stage's sends are not traced, LoRA's
    segments, a sliding window's check and a mixture of experts' token counts are read
    on the host."""
    checks = (
        (device.type != "cpu", f"on a CPU; on {device.type}, decode steps replay CUDA graphs"),
        (
            attention_backend != "cpu",
            f"with the 'cpu' attention backend, not {attention_backend!r}",
        ),
        (config.tensor_parallel_size > 1, "in one process, without tensor_parallel_size > 1"),
        (config.pipeline_parallel_size > 1, "in one process, without pipeline_parallel_size > 1"),
        (config.enable_lora, "without enable_lora"),
        (sliding_window(model_config) is not None, "models without a sliding window"),
        (getattr(model_config, "num_experts", None) is not None, "dense models, not experts"),
    )
    return next((reason for failed, reason in checks if failed), None)


class CompiledDecode:
    """The model's forward on decode-only steps, compiled once by inductor."""

    def __init__(self, model, kv_caches, device: torch.device) -> None:
        bind_backends(model, device)
        cpu_ops.mark_constant_for_compile()
        self.kv_caches, self.device = kv_caches, device
        # Each engine its own graphs: torch would count them against one limit per class.
        self.forward = torch.compile(model, dynamic=True, fullgraph=True, isolate_recompiles=True)
        self.num_runs = 0
        self._compile()

    def _compile(self) -> None:
        """The first call compiles, on a batch as `pad` makes it: two rows, each
        attending to one token of block 0 through a table two blocks wide, writing
        nothing."""
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        tables = torch.zeros(1, 1, dtype=torch.int32, device=self.device)
        lens = torch.ones(1, dtype=torch.int32, device=self.device)
        slots = torch.full((1,), -1, dtype=torch.long, device=self.device)
        attn = AttentionMetadata.decode(slots, tables, lens, max_context_len=1)
        input_ids, positions, attn = pad(ids, ids.clone(), attn)
        # Imported here, not at the top: inductor's config pulls in TorchDynamo, a second
        # or two of every process's start, and only a compiled engine needs it.
        from torch._inductor import config as inductor_config
        from torch.fx.experimental import _config as fx_config

        # Freezing: the weights are constants, which inductor may pack.  Duck shapes
        # off: torch would otherwise assume that two sizes equal while it traces (two
        # rows, two KV heads) stay equal, and compile again when they are not.
        with (
            inductor_config.patch(freezing=True),
            fx_config.patch(use_duck_shape=False),
        ):
            self.forward(input_ids, positions, self.kv_caches, attn)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor | None:
        """The hidden states of a decode-only step; None for a step with a prefill
        (the caller then runs it eagerly)."""
        if attn.num_prefill_tokens:
            return None
        self.num_runs += 1
        input_ids, positions, padded = pad(input_ids, positions, attn)
        return self.forward(input_ids, positions, self.kv_caches, padded)[: len(attn.slot_mapping)]


def pad(input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata):
    """A decode batch at least `MIN_SIZE` rows and block-table columns (torch compiles
    a dimension of 1 apart): each padding row token 0 at position 0, writing no KV
    (slot -1), attending to the first token of block 0; padding columns never read."""
    rows = max(0, MIN_SIZE - input_ids.shape[0])
    tables = attn.decode_block_tables
    columns = max(0, MIN_SIZE - tables.shape[1])
    if not rows and not columns:
        return input_ids, positions, attn
    padded = AttentionMetadata.decode(
        torch.cat((attn.slot_mapping, attn.slot_mapping.new_full((rows,), -1))),
        F.pad(tables, (0, columns, 0, rows)),
        torch.cat((attn.decode_context_lens, attn.decode_context_lens.new_ones(rows))),
        max(attn.max_decode_context_len, 1),
    )
    zeros = input_ids.new_zeros(rows)
    return torch.cat((input_ids, zeros)), torch.cat((positions, zeros)), padded

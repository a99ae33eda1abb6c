"""The model runner: one scheduled batch in, the logits of the sequences that sample out.

A step is one forward pass over a flat batch of tokens, no padding: each scheduled
sequence contributes its new tokens (a prompt, a chunk of one, or one decode token) at
their positions, and `AttentionMetadata` tells every layer where their keys and values
go and what they attend to (paper §4.3).  Only the last token of a sequence that reached
its end is projected to logits; a chunk that stops mid-prompt samples nothing.  The
rows of a request that asked for its prompt's logprobs are projected too, a chunk at a
time, and scored into the request (`minipaged.sample.prompt_logprobs`).  With speculative
decoding, a sequence's new tokens are its last token and a draft's guesses, and each of
their positions is projected: the target's verdict on every guess, in one pass
(`minipaged.spec_decode`).
With `capture_decode_graphs`, a step of decodes only replays a CUDA graph instead
(`minipaged.worker.cuda_graphs`); with `compile_decode`, on a CPU, it runs the model compiled
by inductor (`minipaged.worker.compiled_decode`).  With `enable_lora`, each token also gets
its adapter's LoRA term (`minipaged.models.lora`): the batch is ordered by adapter slot
within its prefills and its decodes, so each adapter's tokens form few segments.
On a pipeline stage (``pipeline_parallel_size`` > 1) the runner runs the stage's layers
only, micro-batch by micro-batch, receiving and sending the hidden states between
stages (`ModelRunner._execute_stage`).
"""

from __future__ import annotations

import torch

from minipaged.core.memory import KVCacheManager
from minipaged.core.memory.block_table import blocks_for
from minipaged.core.sched.output import ScheduledSeq
from minipaged.distributed.parallel_state import TIMELINE
from minipaged.lora_request import LoRARequest
from minipaged.models.attention import (
    AttentionMetadata,
    allocate_kv_caches,
    int_tensor,
    token_positions,
)
from minipaged.models.lora import LoRAModelManager
from minipaged.sample.prompt_logprobs import compute_prompt_logprobs
from minipaged.worker.compiled_decode import CompiledDecode
from minipaged.worker.cuda_graphs import DecodeGraphs


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.graphs: DecodeGraphs | CompiledDecode | None = None
        self.lora: LoRAModelManager | None = None

    def enable_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        """Wrap the model's projections with ``max_loras`` adapter slots."""
        self.lora = LoRAModelManager(self.model, max_loras, max_lora_rank, max_cpu_loras)

    def activate_loras(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Load each ``(slot, adapter)`` the scheduler asked for into its slot."""
        if loads:
            self.lora.activate(loads)

    def capture_decode_graphs(self, kv_caches, max_num_seqs: int, max_model_len: int) -> None:
        """Record the decode forward as CUDA graphs over ``kv_caches`` (which must
        stay the tensors every later step passes)."""
        with torch.inference_mode():
            self.graphs = DecodeGraphs(
                self.model, kv_caches, self.block_size, max_num_seqs, max_model_len, self.device
            )

    def compile_decode(self, kv_caches) -> None:
        """Compile the decode forward over ``kv_caches`` (which must stay the tensors
        every later step passes)."""
        with torch.inference_mode():
            self.graphs = CompiledDecode(self.model, kv_caches, self.device)

    @torch.inference_mode()
    def execute(
        self, seqs: list[ScheduledSeq], kv_caches
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        """Run ``seqs``; returns those that sample, and their logits: one row each, and
        one more per guess it verifies (`minipaged.core.sched.output.logit_rows`)."""
        if not seqs:
            return [], None
        # Prefills first: the trailing run of one-token sequences goes to the decode op.
        seqs = sorted(seqs, key=lambda s: (s.num_new_tokens == 1, s.lora_slot))
        if self.model.pp.size > 1:
            return self._execute_stage(seqs, kv_caches)
        hidden = self._forward(seqs, kv_caches)
        if any(s.prompt_logprob_positions for s in seqs):
            compute_prompt_logprobs(self.model, hidden, seqs)
        sampling = [s for s in seqs if s.samples]
        if not sampling:
            return [], None
        return sampling, self.model.compute_logits(hidden[sample_rows(seqs, self.device)])

    def _forward(self, seqs: list[ScheduledSeq], kv_caches, hidden=None) -> torch.Tensor:
        """The model over ``seqs``' new tokens (from ``hidden``, the previous pipeline
        stage's output, on a stage but the first): one row per token."""
        starts = [s.start for s in seqs]
        counts = [s.num_new_tokens for s in seqs]
        if self.lora is not None:
            self.lora.batch.set([s.lora_slot for s in seqs], counts)
        attn = AttentionMetadata.build(
            [s.block_table for s in seqs],
            starts,
            counts,
            self.block_size,
            self.device,
            slot_mapping=[slot for s in seqs for slot in s.slot_mapping],
            validate=False,  # the scheduler's tables and counts
        )
        input_ids = int_tensor(
            [t for s in seqs for t in s.input_token_ids()], self.device, torch.long
        )
        positions = token_positions(starts, counts, self.device)
        out = self.graphs.run(input_ids, positions, attn) if self.graphs else None
        return self.model(input_ids, positions, kv_caches, attn, hidden) if out is None else out

    def _execute_stage(
        self, seqs: list[ScheduledSeq], kv_caches
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        """One pipeline stage's part of the step (GPipe's schedule, Huang et al. 2019):
        the batch cut into one micro-batch per stage, each received from the previous
        stage, run through this stage's layers and sent on while the next one runs, so
        the stages work on different micro-batches at once.  The last stage projects
        the sampled rows and sends their logits to the driver, which returns them."""
        stage, config = self.model.pp, self.model.config
        sends, rows = [], []
        for micro in micro_batches(seqs, stage.size):
            hidden = None
            if not stage.is_first:
                shape = (sum(s.num_new_tokens for s in micro), config.hidden_size)
                hidden = stage.recv(shape, self.model.model.dtype, self.device)
            with TIMELINE.record("forward", self.device):
                hidden = self._forward(micro, kv_caches, hidden)
                if stage.is_last:
                    rows.append(hidden[sample_rows(micro, self.device)])
            if not stage.is_last:
                sends.append(stage.send(hidden))
        stage.wait(sends)
        sampling = [s for s in seqs if s.samples]
        if not sampling:
            return [], None
        if stage.is_last:
            with TIMELINE.record("forward", self.device):
                logits = self.model.compute_logits(torch.cat(rows))
            if logits is not None:  # tensor-parallel rank 0 of the stage
                stage.send_logits(logits)
            return sampling, logits
        if stage.is_first and stage.tp_rank == 0:  # the driver
            rows = sum(s.num_logit_rows for s in sampling)
            return sampling, stage.recv_logits((rows, config.vocab_size), self.device)
        return sampling, None

    @torch.inference_mode()
    def kv_memory_budget(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Bytes of GPU memory left for KV blocks (vLLM's memory profiling).

        Runs the biggest step the scheduler can form (``max_num_batched_tokens`` prompt
        tokens) over a throwaway cache just big enough, to see the activations' peak;
        what ``gpu_memory_utilization`` of the device leaves after that peak, the
        weights and memory outside torch (the CUDA context, other processes) is the budget.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        lengths = [
            min(max_model_len, max_num_batched_tokens - start)
            for start in range(0, max_num_batched_tokens, max_model_len)
        ]
        num_blocks = sum(blocks_for(length, self.block_size) for length in lengths)
        kv = KVCacheManager(num_blocks, self.block_size)
        prompts = [kv.allocate(str(i), [0] * length) for i, length in enumerate(lengths)]
        config, stage, dtype = self.model.config, self.model.pp, self.model.model.dtype
        caches = allocate_kv_caches(config, num_blocks, self.block_size, dtype, self.device)
        cache_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
        attn = AttentionMetadata.build(
            [p.block_table for p in prompts],
            [0] * len(lengths),
            lengths,
            self.block_size,
            self.device,
            slot_mapping=[slot for p in prompts for slot in p.slot_mapping],
        )
        input_ids = torch.zeros(sum(lengths), dtype=torch.long, device=self.device)
        positions = token_positions([0] * len(lengths), lengths, self.device)
        # A pipeline stage but the first starts from hidden states (any will do here).
        start = None
        if not stage.is_first:
            start = torch.zeros(len(input_ids), config.hidden_size, dtype=dtype, device=self.device)
        stage_caches = caches[: len(self.model.model.stage_layers)]
        hidden = self.model(input_ids, positions, stage_caches, attn, start)
        if stage.is_last:
            self.model.compute_logits(hidden[-len(lengths) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache_bytes
        del caches, stage_caches, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * gpu_memory_utilization - peak - outside_torch)


def sample_rows(seqs: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
    """The rows of ``seqs``' hidden states to project: each sampling sequence's last
    token, after those of the guesses it verifies."""
    rows, end = [], 0
    for s in seqs:
        end += s.num_new_tokens
        if s.samples:
            rows += range(end - s.num_logit_rows, end)
    return int_tensor(rows, device, torch.long)


def micro_batches(seqs: list[ScheduledSeq], n: int) -> list[list[ScheduledSeq]]:
    """``seqs`` cut, in order, into at most ``n`` runs of about equal token counts,
    none empty (a step of fewer sequences than stages has fewer micro-batches)."""
    total = sum(s.num_new_tokens for s in seqs)
    batches, done = [[]], 0
    for s in seqs:
        if batches[-1] and done >= total * len(batches) / n:
            batches.append([])
        batches[-1].append(s)
        done += s.num_new_tokens
    return batches

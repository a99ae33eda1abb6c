"""The model runner: one scheduled batch in, the logits of the sequences that sample out.

A step is one forward pass over a flat batch of tokens, no padding: each scheduled
sequence contributes its new tokens (a prompt, a chunk of one, or one decode token) at
their positions, and `AttentionMetadata` tells every layer where their keys and values
go and what they attend to (paper §4.3).  Only the last token of a sequence that reached
its end is projected to logits; a chunk that stops mid-prompt samples nothing.  The
rows of a request that asked for its prompt's logprobs are projected too, a chunk at a
time, and scored into the request (`minipaged.prompt_logprobs`).  With speculative
decoding, a sequence's new tokens are its last token and a draft's guesses, and each of
their positions is projected: the target's verdict on every guess, in one pass
(`minipaged.spec_decode`).
With `capture_decode_graphs`, a step of decodes only replays a CUDA graph instead
(`minipaged.cuda_graphs`).  With `enable_lora`, each token also gets its adapter's
LoRA term (`minipaged.models.lora`): the batch is ordered by adapter slot within its
prefills and its decodes, so each adapter's tokens form few segments.
"""

from __future__ import annotations

import torch

from minipaged.batch import ScheduledSeq
from minipaged.cuda_graphs import DecodeGraphs
from minipaged.lora_request import LoRARequest
from minipaged.models.attention import (
    AttentionMetadata,
    allocate_kv_caches,
    int_tensor,
    token_positions,
)
from minipaged.models.lora import LoRAModelManager
from minipaged.prompt_logprobs import compute_prompt_logprobs


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.graphs: DecodeGraphs | None = None
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

    @torch.inference_mode()
    def execute(
        self, seqs: list[ScheduledSeq], kv_caches
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        """Run ``seqs``; returns those that sample, and their logits: one row each, and
        one more per guess it verifies (`minipaged.batch.logit_rows`)."""
        if not seqs:
            return [], None
        # Prefills first: the trailing run of one-token sequences goes to the decode op.
        seqs = sorted(seqs, key=lambda s: (s.num_new_tokens == 1, s.lora_slot))
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
            [slot for s in seqs for slot in s.slot_mapping],
            validate=False,  # the scheduler's tables and counts
        )
        input_ids = int_tensor(
            [t for s in seqs for t in s.input_token_ids()], self.device, torch.long
        )
        positions = token_positions(starts, counts, self.device)
        hidden = self.graphs.run(input_ids, positions, attn) if self.graphs else None
        if hidden is None:
            hidden = self.model(input_ids, positions, kv_caches, attn)
        if any(s.prompt_logprob_positions for s in seqs):
            compute_prompt_logprobs(self.model, hidden, seqs)
        sampling, last_rows, end = [], [], 0
        for s in seqs:
            end += s.num_new_tokens
            if s.samples:  # the last token's row, after those of the guesses it verifies
                sampling.append(s)
                last_rows += range(end - s.num_logit_rows, end)
        if not sampling:
            return [], None
        rows = int_tensor(last_rows, self.device, torch.long)
        return sampling, self.model.compute_logits(hidden[rows])

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
        tables, next_block = [], 0
        for length in lengths:
            num = -(-length // self.block_size)
            tables.append(list(range(next_block, next_block + num)))
            next_block += num
        config = self.model.config
        dtype = self.model.model.embed_tokens.weight.dtype
        caches = allocate_kv_caches(config, next_block, self.block_size, dtype, self.device)
        cache_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
        attn = AttentionMetadata.build(
            tables, [0] * len(lengths), lengths, self.block_size, self.device
        )
        input_ids = torch.zeros(sum(lengths), dtype=torch.long, device=self.device)
        positions = token_positions([0] * len(lengths), lengths, self.device)
        hidden = self.model(input_ids, positions, caches, attn)
        self.model.compute_logits(hidden[-len(lengths) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache_bytes
        del caches, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * gpu_memory_utilization - peak - outside_torch)

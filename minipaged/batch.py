"""What one engine step runs: the scheduler's decision, as data (paper §4.5).

`SchedulerOutput` is what `Scheduler.schedule` hands down: the sequences to run, each a
`ScheduledSeq` (which of its tokens, and its block table), and the block operations the
cache engine must carry out before the forward pass.  The cache engine, the model runner
and the tensor-parallel workers read it; none of them needs the scheduler itself.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.lora_request import LoRARequest
from minipaged.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class ScheduledSeq:
    """Run tokens ``[start, start + num_new_tokens)`` of ``seq`` this step."""

    seq: Sequence
    group: SequenceGroup
    start: int
    num_new_tokens: int
    block_table: list[int]
    slot_mapping: list[int]  # the cache slot of each new token, from the KV cache manager
    samples: bool  # does this step reach the sequence's end, so its last logits are used?
    lora_slot: int = -1  # the slot of its LoRA adapter (minipaged.memory.lora_slots); -1: none
    # Positions whose logits score a prompt token (SamplingParams.prompt_logprobs).
    prompt_logprob_positions: range = range(0)
    # A draft's guesses, run after the sequence's real tokens (the last ones of the
    # step's ``num_new_tokens``) to be verified: their slots are lookahead slots.
    spec_token_ids: list[int] = field(default_factory=list)

    def input_token_ids(self) -> list[int]:
        """The tokens this step runs: the sequence's, then the guesses."""
        end = self.start + self.num_new_tokens - len(self.spec_token_ids)
        return self.seq.token_ids[self.start : end] + self.spec_token_ids

    @property
    def num_logit_rows(self) -> int:
        """Logit rows the step returns for it: its last token's, and one per guess."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


def logit_rows(sampling: list[ScheduledSeq]) -> list[range]:
    """The rows of a step's logits that each sampling sequence owns, in order: one, or
    one more per guess under verification."""
    rows, start = [], 0
    for s in sampling:
        rows.append(range(start, start + s.num_logit_rows))
        start += s.num_logit_rows
    return rows


@dataclass
class SchedulerOutput:
    """One step's batch and the block operations to run before it, in this order."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on the GPU
    preempted: list[SequenceGroup] = field(default_factory=list)
    # (slot, adapter): load each adapter into its slot before the forward pass.
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

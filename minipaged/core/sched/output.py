"""What one engine step runs and what it chose, as data (paper §4.5).

`SchedulerOutput` is what `Scheduler.schedule` hands down, in two views of one plan:

- the engine's: the sequences to run, each a `ScheduledSeq` (which of its tokens, for
  which request), which the sample and update phases read;
- the model runner's, a *diff* against what the runner already holds (vLLM V1's
  ``SchedulerOutput``): a sequence the runner has not seen comes once, whole
  (`NewRequestData`: its tokens and block table); a sequence it holds comes as what
  changed (`CachedRequestData`: the tokens sampled since, its new block ids and its
  ``num_computed_tokens``); then how many tokens each runs (``num_scheduled_tokens``,
  in batch order), a draft's guesses, and the sequences the runner must forget first
  (``finished_req_ids``: finished, dropped, aborted, preempted).  The runner keeps the
  rest in its persistent batch (`minipaged.worker.input_batch`), so a decode step sends
  a few integers per sequence, never a whole block table.

Then the block operations the cache engine must carry out before the forward pass.  The
cache engine, the model runner and the tensor-parallel workers read it; none of them
needs the scheduler itself.  (vLLM's "request" is a sequence here: a request with
``n`` > 1, or a beam search, runs several, each a row of the runner's batch.)

`StepSamples` is what the sample phase hands back up: a plain step's tokens as columns
(`SampledTokens`, one token per sequence, no object per row: vLLM's
``ModelRunnerOutput.sampled_token_ids``), any other new token as a `Sample` (a prompt's
forks, beam search's kept extensions), and beam search's finished and dropped beams.
Choosing changes no request; `Scheduler.update_from_output` applies the choice.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from minipaged.lora_request import LoRARequest
from minipaged.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class ScheduledSeq:
    """Run tokens ``[start, start + num_new_tokens)`` of ``seq`` this step."""

    seq: Sequence
    group: SequenceGroup
    start: int
    num_new_tokens: int
    # The sequence's block table (the scheduler's is the KV cache manager's live list:
    # read it before the next step) and the cache slot of each new token.
    block_table: list[int]
    slot_mapping: list[int]
    samples: bool  # does this step reach the sequence's end, so its last logits are used?
    lora_slot: int = -1  # the slot of its LoRA adapter (minipaged.core.memory.lora_slots); -1: none
    # Positions whose logits score a prompt token (SamplingParams.prompt_logprobs).
    prompt_logprob_positions: range = range(0)
    # A draft's guesses, run after the sequence's real tokens (the last ones of the
    # step's ``num_new_tokens``) to be verified: their slots are lookahead slots.  A
    # decode without any shares the empty tuple: no list per sequence, every step.
    spec_token_ids: list[int] | tuple[()] = ()

    def input_token_ids(self) -> list[int]:
        """The tokens this step runs: the sequence's, then the guesses."""
        end = self.start + self.num_new_tokens - len(self.spec_token_ids)
        return [*self.seq.token_ids[self.start : end], *self.spec_token_ids]

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


def sampling_seqs(out: SchedulerOutput, req_ids: list[str]) -> list[ScheduledSeq]:
    """The scheduled sequences of ``req_ids`` (those that sample, in the runner's order):
    a decode step's are all of them in the scheduler's order, told by comparing ids
    (``num_scheduled_tokens`` keeps the order of ``seqs``) instead of looking each up."""
    if len(req_ids) == len(out.seqs) and list(out.num_scheduled_tokens) == req_ids:
        return out.seqs
    by_id = {s.seq.seq_id: s for s in out.seqs}
    return [by_id[r] for r in req_ids]


@dataclass(slots=True)
class NewRequestData:
    """A sequence the runner does not hold (admitted, resumed, forked): all of it."""

    req_id: str  # the sequence's id
    token_ids: list[int]  # its tokens so far (a copy)
    block_ids: list[int]  # its block table (a copy)
    num_computed_tokens: int  # where this step's tokens start
    lora_slot: int = -1


@dataclass(slots=True)
class CachedRequestData:
    """What changed, since the step that last ran them, of sequences the runner holds
    (vLLM V1's ``CachedRequestData``), as columns of values the scheduler already has,
    so that a decode allocates nothing for it: per sequence, the tokens appended since
    (the sampled ones, all rows' in one flat list, ``num_new_tokens`` of each: vLLM's
    runner samples them itself, ours are the engine's), its new block ids (None: none,
    a decode's common case) and where this step's tokens start.  A sequence whose table
    lost blocks (a copy-on-write replaced its last one, a rollback dropped some) is in
    ``num_kept_blocks`` too: its table is rewritten from that many on (vLLM's
    ``resumed_req_ids`` replace a table whole); the others' new blocks are appended."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_kept_blocks: dict[str, int] = field(default_factory=dict)

    def add(self, req_id: str, tokens: list[int], num_computed_tokens: int) -> None:
        """``req_id``, its ``tokens`` appended since it last ran, and this step's start
        (its blocks: `add_blocks`)."""
        self.req_ids.append(req_id)
        self.new_token_ids += tokens
        self.num_new_tokens.append(len(tokens))
        self.num_computed_tokens.append(num_computed_tokens)

    def add_blocks(self, req_id: str, blocks: list[int], held: int, num_kept: int) -> None:
        """The last added sequence's table ``blocks``, of which the runner holds the
        first ``held`` and this step left the first ``num_kept`` unchanged."""
        if num_kept < held:
            self.num_kept_blocks[req_id] = held = num_kept
        self.new_block_ids.append(blocks[held:] if held < len(blocks) else None)


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
    # -- the runner's diff (module docstring) ------------------------------------------
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # Tokens each sequence runs this step, guesses included, in the batch's order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Positions whose logits score a prompt token, of the sequences that have any.
    prompt_logprob_positions: dict[str, range] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # rows the runner drops first
    preempted_req_ids: set[str] = field(default_factory=set)  # requests preempted
    # Disaggregated prefill: what the KV connector's worker side loads and saves this
    # step (its `build_connector_meta`); None without a connector.
    kv_connector_metadata: Any = None
    # A vision model's encoder: the images to encode before the forward pass, by
    # mm_hash (`MultiModalFeatureSpec`), and the cached embeddings to drop first.
    scheduled_encoder_inputs: dict[str, Any] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def runner_view(self) -> SchedulerOutput:
        """The plan without the engine's objects: what a worker process receives."""
        return replace(self, seqs=[], preempted=[])


@dataclass(slots=True)
class Sample:
    """A token chosen this step for ``seq`` of ``group``.  With ``fork`` it is the first
    token of a new sequence forked from ``seq`` (a prompt with ``n`` > 1, a beam kept
    more than once), which draws from ``generator`` from then on (a seeded request's
    completion ``i`` has its own stream)."""

    group: SequenceGroup
    seq: Sequence
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None = None
    fork: bool = False
    generator: Any = None


@dataclass(slots=True)
class SampledTokens:
    """One token for each of ``seqs`` (of ``groups``), none of them forking, as columns:
    what sampling a step's plain rows chose, for the update phase to apply row by row
    without building a `Sample` per row."""

    groups: list[SequenceGroup]
    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]

    def samples(self) -> list[Sample]:
        """The same tokens, one `Sample` each."""
        return [
            Sample(group, seq, token, logprob, top)
            for group, seq, token, logprob, top in zip(
                self.groups, self.seqs, self.token_ids, self.logprobs, self.top_logprobs
            )
        ]


@dataclass
class Verified:
    """What verifying ``seq``'s ``num_guesses`` guesses chose: the accepted ones and the
    token after them (``token_ids``), with their logprobs.  The update phase keeps the
    accepted guesses' slots, rolls back the rest, and appends the tokens up to a stop
    (``num_appended``)."""

    group: SequenceGroup
    seq: Sequence
    num_guesses: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    num_appended: int = 0


@dataclass
class StepSamples:
    """What the sample phase chose this step, for the update phase to apply."""

    tokens: list[Sample] = field(default_factory=list)
    # A plain step's tokens, as columns (one chunk per sample call), applied first.
    sampled: list[SampledTokens] = field(default_factory=list)
    # Beam search: extensions that end in EOS (set aside whole: they take no blocks)...
    finished_beams: list[Sample] = field(default_factory=list)
    # ... and live beams that no kept extension continues.
    dropped_beams: list[tuple[SequenceGroup, Sequence]] = field(default_factory=list)

    # Speculative decoding: each verified sequence's tokens (its accepted guesses and
    # one more), applied after its guesses' slots are rolled back.
    verified: list[Verified] = field(default_factory=list)

    @property
    def num_appended(self) -> int:
        """Tokens the update phase appended (after `update_from_output`)."""
        return (
            len(self.tokens)
            + sum(len(c.token_ids) for c in self.sampled)
            + sum(v.num_appended for v in self.verified)
        )

    def token_ids_by_seq(self) -> dict[int, int]:
        """Each sequence's sampled token, by sequence id: a plain step's (what async
        scheduling runs ahead of its update; no fork, beam or guesses there)."""
        by_seq = {s.seq.seq_id: s.token_id for s in self.tokens}
        for chunk in self.sampled:
            by_seq.update(zip([seq.seq_id for seq in chunk.seqs], chunk.token_ids))
        return by_seq

    def extend(self, other: StepSamples) -> None:
        self.tokens += other.tokens
        self.sampled += other.sampled
        self.verified += other.verified
        self.finished_beams += other.finished_beams
        self.dropped_beams += other.dropped_beams

"""The scheduler: which tokens of which requests run in the next step (paper §4.5).

Iteration-level scheduling, as in Orca and vLLM: every step the scheduler forms a new
batch, so a request joins the moment there is room and leaves the moment it finishes,
rather than a whole batch waiting for its longest member (*continuous batching*).

A step has two budgets: ``max_num_seqs`` sequences and ``max_num_batched_tokens`` new
tokens.  A decode costs one token; a prompt costs all of its tokens, so a long prompt is
cut into chunks that run in successive steps beside other requests' decodes (*chunked
prefill*).  One `schedule()` call, first come first served:

1. **Running** requests, oldest first, each get their next tokens.  When the GPU pool
   cannot hold them, the most recently arrived request is preempted (§4.5), whole (its
   sequences share blocks, so all of them go: all-or-nothing), until the older one fits;
   if the request itself is the newest, it is the one preempted.  Preemption either
   **swaps** the request's blocks to the CPU pool or frees them so the request is
   **recomputed** later (its generated tokens then run as part of a longer prompt).
2. **Swapped** requests come back, oldest first, as soon as their blocks fit.
3. **Waiting** requests are admitted, oldest first, only if nothing was preempted this
   step and nothing is still swapped out, and only when the blocks for their first
   chunk can be had (with prefix caching, cached full blocks of the prompt are reused
   and only the rest is computed, §4.4).

With LoRA adapters, a request runs only while it holds its adapter's slot
(`minipaged.core.memory.lora_slots`): one whose adapter can get none waits, and later
requests may pass it; a swapped one comes back only with its slot.

The paper's baseline, Orca's contiguous reservations (``memory_mode`` other than
``"paged"``), is a subclass with one more admission rule
(`minipaged.core.sched.contiguous_scheduler`); `make_scheduler` gives an engine the one its
``memory_mode`` asks for.

The scheduler holds every request from `add` until it retires or is aborted
(``requests``, by id), and the update phase changes memory only through it (`fork`,
`append_token`, `free_seq`, `retire`), so the event trace sees every block operation.
Whether tokens fit, it asks the KV cache manager (`can_append_any`, `can_append_all`,
`can_allocate_all`), never the allocator under it.

The scheduler decides; it does not touch tensors.  Its output lists the sequences to run
and the block operations the cache engine must execute first (swap out, swap in,
copy-on-write copies), as the KV cache manager's contract orders them; for the model
runner, it is a diff against the runner's persistent batch (vLLM V1's): the scheduler
remembers, per sequence the runner holds, how many of its tokens and blocks it has sent
(``_held``), so a running sequence costs a step a few integers, and every sequence whose
blocks are freed or swapped out is named once in the next output's ``finished_req_ids``.

With async scheduling, the engine asks for the next decode step while this one runs
(`schedule_ahead`): each sequence's token not sampled yet is a placeholder, in the KV
cache manager's table (kept out of the prefix cache) and in the runner's diff;
`write_sampled` gives the runner the sampled token before the step launches, and
`fill_placeholders` the KV cache manager once the step before is updated (vLLM's
``AsyncScheduler``).

With a vision model, admission asks the encoder cache too (`EncoderCacheManager`): a
request waits until its images fit there, then holds them until it finishes or is
preempted by recompute; the first chunk that reaches an image's placeholder schedules
its encoder run (``scheduled_encoder_inputs``), unless its embeddings are cached.  A
step encodes at most ``max_num_encoder_input_tokens`` encoder tokens: a chunk that
reaches an image that is not encoded and does not fit what is left of them is cut just
before its placeholder, so the text before it still runs (vLLM's
``_try_schedule_encoder_inputs``); so is, with ``disable_chunked_mm_input``, a chunk
that would end inside an image.  A readmitted request's later sequence that a sibling's
blocks just cached up to such an image runs nothing that step: it holds its cached
prefix and runs from the next (vLLM would leave it waiting).

With a KV connector (``kv_transfer_config``, disaggregated prefill), admission asks
it too: the prompt tokens past the prefix-cache hit that another engine computed
(`KVConnectorBase_V1.get_num_new_matched_tokens`) get blocks like the rest but count as
computed, and the step's `SchedulerOutput` carries what the workers must load into those
blocks and save of the prompts it finishes (``kv_connector_metadata``).

Standard library only.
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from minipaged.config import PREEMPTION_MODES
from minipaged.core.memory import Allocation, KVCacheManager
from minipaged.core.memory.block_table import blocks_for
from minipaged.core.memory.kv_cache_manager import PLACEHOLDER_TOKEN_ID
from minipaged.core.memory.lora_slots import LoRASlots
from minipaged.core.sched.encoder_cache_manager import EncoderCacheManager
from minipaged.core.sched.output import (
    NewRequestData,
    Sample,
    SampledTokens,
    ScheduledSeq,
    SchedulerOutput,
    StepSamples,
    Verified,
)
from minipaged.sampling_params import BeamSearchParams, SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.trace import Trace

if TYPE_CHECKING:  # the engine builds it; the scheduler never imports a connector
    from minipaged.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


def make_scheduler(
    kv: KVCacheManager,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    preemption_mode: str = "recompute",
    trace: Trace | None = None,
    memory_mode: str = "paged",
    max_model_len: int | None = None,
) -> Scheduler:
    """The scheduler of ``memory_mode``: vLLM's paged one, or Orca's contiguous baseline
    (`minipaged.core.sched.contiguous_scheduler`, a subclass, so imported only when asked for)."""
    args = (kv, max_num_seqs, max_num_batched_tokens, preemption_mode, trace, max_model_len)
    if memory_mode == "paged":
        return Scheduler(*args)
    from minipaged.core.sched.contiguous_scheduler import ContiguousScheduler  # noqa: PLC0415

    return ContiguousScheduler(*args, memory_mode=memory_mode)


class Scheduler:
    """Queues of requests over a `KVCacheManager`; `schedule()` once per engine step.

    ``max_model_len``: the longest sequence, where the engine stops it (None: no limit).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        trace: Trace | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}"
            )
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.trace = trace or Trace()
        # Every request from `add` until it retires or is aborted, by id; each is in
        # exactly one queue, kept in arrival order, oldest first.
        self.requests: dict[str, SequenceGroup] = {}
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.lora_slots = LoRASlots(0)  # the engine gives it max_loras with enable_lora
        # The runner's side of the diff: per sequence it holds, [tokens, blocks] sent;
        # and the sequences it must drop at the next step.
        self._held: dict[str, list[int]] = {}
        self._finished_req_ids: set[str] = set()
        # The update phase's requests that lost a sequence: only these may have finished.
        self._finishing: set[SequenceGroup] = set()
        # The update phase's stop checks: the engine's EOS tokens, and the front end's
        # check of stop strings on the text so far (which detokenizes; None: no text).
        self.eos_token_ids: set[int] = set()
        # Does the engine pool (a pooling runner)?  Then a request finishes once its
        # prompt's embedding is in, which the update phase checks for.
        self.pools = False
        self.check_stop_strings: Callable[[SequenceGroup, Sequence], str | None] | None = None
        # Disaggregated prefill: the scheduler's side of the KV connector (None: off),
        # and where prompt tokens' KV came from: computed here, or loaded through it.
        self.connector: KVConnectorBase_V1 | None = None
        self.num_computed_prompt_tokens = 0
        self.num_external_computed_tokens = 0
        # A vision model's encoder cache (`EncoderCacheManager`; None: a text model),
        # its encoder tokens per step (the engine sets it) and this step's left of them.
        self.encoder_cache: EncoderCacheManager | None = None
        self.max_num_encoder_input_tokens = 0
        self._encoder_budget = 0
        self.disable_chunked_mm_input = False  # a chunk never ends inside an image

    # -- the queues -------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.requests[group.request_id] = group
        _insert(self.waiting, group, SequenceStatus.WAITING)
        self.trace.record("arrive", group.request_id, num_prompt_tokens=len(group.prompt_token_ids))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Drop a request wherever it is and free its blocks; None if it is not here."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return None
        if group.status is SequenceStatus.RUNNING:
            self.lora_slots.release(group.lora_id)
        self._queue(group.status).remove(group)
        self._release(group, "abort")
        group.status = SequenceStatus.FINISHED
        self.trace.record("abort", request_id)
        return group

    def requests_holding(self, blocks: set[int]) -> list[str]:
        """The running requests whose block tables hold any of ``blocks``."""
        return [
            group.request_id
            for group in self.running
            if any(
                blocks.intersection(self.kv.block_table(s.seq_id)) for s in group.unfinished_seqs
            )
        ]

    def retire(self, group: SequenceGroup) -> None:
        """Take a finished request off the running queue (its blocks are already free)."""
        del self.requests[group.request_id]
        self.running.remove(group)
        group.status = SequenceStatus.FINISHED
        self.lora_slots.release(group.lora_id)
        if group.mm_features:
            self.encoder_cache.release(group.request_id)
        self.trace.record("finish", group.request_id)

    def _queue(self, status: SequenceStatus) -> list[SequenceGroup]:
        queues = {
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.SWAPPED: self.swapped,
        }
        return queues[status]

    def append_token(
        self, group: SequenceGroup, seq: Sequence, token_id: int, logprob: float
    ) -> None:
        """Give ``seq`` the token sampled for it; the next step computes its KV."""
        seq.append_token(token_id, logprob)
        if self.trace.enabled:
            self.trace.record("sample", group.request_id, seq.seq_id, token_id=token_id)

    def fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        """A new sequence sharing all of ``parent``'s blocks, copy-on-write (§4.4)."""
        child = parent.fork(group.new_seq_id(), index=len(group.seqs))
        self.kv.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        self.trace.record(
            "fork",
            group.request_id,
            child.seq_id,
            parent=parent.seq_id,
            blocks=self.kv.block_table(child.seq_id),
        )
        return child

    def free_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """Give back a finished or dropped sequence's blocks (shared ones stay with the rest)."""
        if self.trace.enabled:
            self.trace.record(
                "free", group.request_id, seq.seq_id, blocks=self.kv.block_table(seq.seq_id)
            )
        if self.connector is not None:
            self.connector.request_finished(seq, self.kv.block_table(seq.seq_id))
        self.kv.free(seq.seq_id)
        self._forget(seq.seq_id)

    def _forget(self, seq_id: str) -> None:
        """The runner drops ``seq_id``'s row at the next step (its blocks are gone or
        moved); if it runs again, it is sent whole."""
        if self._held.pop(seq_id, None) is not None:
            self._finished_req_ids.add(seq_id)

    def check_fits(self, prompt_len: int, params: SamplingParams | BeamSearchParams) -> None:
        """Refuse (``ValueError``) a request that could never run: more sequences than a
        step takes, or more blocks than the whole GPU pool (all-or-nothing preemption
        must be able to make room for any one request alone)."""
        name, width = width_of(params)
        if width > self.max_num_seqs:
            raise ValueError(
                f"{name}={width} is more than max_num_seqs={self.max_num_seqs} can ever run at once"
            )
        longest = prompt_len + params.max_tokens
        if self.max_model_len is not None:
            longest = min(longest, self.max_model_len)
        needed = width * blocks_for(longest, self.kv.block_size)
        if needed > self.kv.num_gpu_blocks:
            raise ValueError(
                f"max_tokens={params.max_tokens} with {name}={width} may need "
                f"{needed} KV blocks, more than the pool's {self.kv.num_gpu_blocks}"
                " (num_gpu_blocks)"
            )

    def num_running_seqs(self) -> int:
        """Seats taken: a request about to fork into ``n`` holds ``n`` already."""
        return sum(g.num_seats for g in self.running)

    # -- the update phase (vLLM's ``Scheduler.update_from_output``) ---------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, samples: StepSamples
    ) -> list[SequenceGroup]:
        """Apply what the sample phase chose for ``scheduler_output``: the one place a
        step changes its requests.  Each token is appended (a prompt with ``n`` > 1, or
        a beam kept more than once, forking first), the stop conditions are checked, a
        finished sequence gives its blocks back at once (shared blocks only lose a
        holder), and a finished request retires.  Returns the step's requests that have
        news for the output processor to turn into outputs: those that finished and
        those that stream (those aborted since it was scheduled, one that failed
        alone, left out)."""
        for v in samples.verified:  # speculative decoding's accepted guesses and more
            self._apply_verified(v)
        for s in samples.finished_beams:  # from the beam as it was when ranked
            s.group.completed_beams.append(
                (s.seq.token_ids + [s.token_id], s.seq.cumulative_logprob + s.logprob)
            )
        for group, beam in samples.dropped_beams:
            self.free_seq(group, beam)
            group.seqs.remove(beam)
            self._finishing.add(group)
        # Every fork before any sequence grows: a child starts from its parent as it was.
        tokens = samples.tokens
        seqs = [self._fork_sample(s) if s.fork else s.seq for s in tokens]
        for sampled in samples.sampled:  # a plain step's tokens, as columns
            self._apply_sampled(sampled)
        traced, check_stop = self.trace.enabled, self.check_stop
        for s, seq in zip(tokens, seqs):
            if traced:
                self.append_token(s.group, seq, s.token_id, s.logprob)
            else:
                seq.append_token(s.token_id, s.logprob)
            if seq.logprobs is not None:
                seq.logprobs.append(s.top_logprobs)
            check_stop(s.group, seq)
        finished, finishing = SequenceStatus.FINISHED, self._finishing
        groups = dict.fromkeys([s.group for s in scheduler_output.seqs])
        if not finishing and not self.pools:  # most steps: nobody finished (aborted: left out)
            return [g for g in groups if g.streams and g.status is not finished]
        groups = [g for g in groups if g.status is not finished]
        for group in groups:
            if group.embedding is not None and not group.is_finished:
                # A pooling request is done once its prompt is: its blocks go back now.
                self._finish_seq(group, group.seqs[0], "stop", None)
            if group in finishing and group.is_finished:
                self.retire(group)
        groups = [g for g in groups if g in finishing or g.streams]
        finishing.clear()
        return groups

    def _apply_sampled(self, sampled: SampledTokens) -> None:
        """Append each of ``sampled``'s tokens to its sequence; `check_stop` runs only
        where a stop could be: a grammar, text needed early (stop strings, a stream), an
        EOS or stop token, or the length reached (`_at_length`, inline).  For any other
        sequence it would find none: a decode step's common case, kept to a few
        comparisons per row (a call per row would cost as much as the rest)."""
        eos, check_stop, traced = self.eos_token_ids, self.check_stop, self.trace.enabled
        max_len = self.max_model_len if self.max_model_len is not None else sys.maxsize
        for group, seq, token, logprob, top in zip(
            sampled.groups, sampled.seqs, sampled.token_ids, sampled.logprobs, sampled.top_logprobs
        ):
            if traced:
                self.append_token(group, seq, token, logprob)
            else:  # `Sequence.append_token`, inline (no beam here: no candidates to drop)
                seq.token_ids.append(token)
                if logprob is not None:
                    seq.cumulative_logprob += logprob
            if seq.logprobs is not None:
                seq.logprobs.append(top)
            params, length = group.params, len(seq.token_ids)
            if (
                seq.grammar is not None
                or group.detokenizes_early
                or token in eos
                or token in params.stop_token_ids
                or length - seq.prompt_len >= params.max_tokens
                or length >= max_len
            ):
                check_stop(group, seq)

    def _apply_verified(self, v: Verified) -> None:
        """Keep the slots of ``v``'s accepted guesses, give back the rest, and append its
        tokens one at a time, each checked for a stop (the tokens after one are dropped)."""
        group, seq = v.group, v.seq
        self.rollback(group, seq, len(v.token_ids) - 1)
        seq.spec_token_ids = []
        for token, logprob, top in zip(v.token_ids, v.logprobs, v.top_logprobs):
            self.append_token(group, seq, token, logprob)
            v.num_appended += 1
            if seq.logprobs is not None:
                seq.logprobs.append(top)
            self.check_stop(group, seq)
            if seq.is_finished:
                break

    def _fork_sample(self, sample: Sample) -> Sequence:
        child = self.fork(sample.group, sample.seq)
        child.generator = sample.generator
        return child

    def check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Decide whether ``seq`` is done after its new token, first feeding it to its
        grammar (structured outputs: a token the grammar refuses is a dead end, which
        finishes the sequence with ``"abort"`` and says why in ``stop_reason``); then in
        vLLM's order: EOS (unless ``ignore_eos``), a stop token, a stop string
        (`check_stop_strings`), then ``max_tokens`` or ``max_model_len``.  A beam search
        request only has the
        last two (its EOS extensions were set aside when ranked)."""
        params, token = group.params, seq.token_ids[-1]
        grammar = seq.grammar
        if grammar is not None and not grammar.accept_token(token):
            # Only a grammar with no allowed token left lets the sampler draw this.
            self._finish_seq(group, seq, "abort", f"structured output dead end: {grammar.error}")
            return
        if group.is_beam_search:
            if self._at_length(params, seq):  # the beam joins the finished candidates
                group.completed_beams.append((list(seq.token_ids), seq.cumulative_logprob))
                self._finish_seq(group, seq, "length", None)
            return
        # A complete grammar allows only EOS next: it ends the completion even with
        # ignore_eos, which could only repeat it.
        eos = token in self.eos_token_ids and (
            not params.ignore_eos or (grammar is not None and grammar.is_terminated())
        )
        if eos or token in params.stop_token_ids:
            # The stop token stays in the token ids but not in the text (vLLM).
            self._finish_seq(group, seq, "stop", None if eos else token)
            return
        if (
            group.detokenizes_early
            and self.check_stop_strings
            and (hit := self.check_stop_strings(group, seq))
        ):
            self._finish_seq(group, seq, "stop", hit)
            return
        if self._at_length(params, seq):
            self._finish_seq(group, seq, "length", None)

    def _at_length(self, params, seq: Sequence) -> bool:
        length = len(seq.token_ids)
        return length - seq.prompt_len >= params.max_tokens or (
            self.max_model_len is not None and length >= self.max_model_len
        )

    def _finish_seq(self, group, seq, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.free_seq(group, seq)
        self._finishing.add(group)

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._encoder_budget = self.max_num_encoder_input_tokens
        token_budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._resume_swapped(out)
            if not self.swapped:
                self._admit_waiting(out, token_budget)
        # Last: this step's preemptions too (the runner drops rows before adding any).
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        if self.encoder_cache is not None:
            out.free_encoder_mm_hashes = self.encoder_cache.get_freed_mm_hashes()
        out.preempted_req_ids = {g.request_id for g in out.preempted}
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._trace_schedule(out)
        return out

    def _trace_schedule(self, out: SchedulerOutput) -> None:
        if self.trace.enabled:
            for s in out.seqs:
                self.trace.record(
                    "schedule",
                    s.group.request_id,
                    s.seq.seq_id,
                    start=s.start,
                    num_tokens=s.num_new_tokens,
                )

    # -- async scheduling (vLLM's ``AsyncScheduler``) ------------------------------------
    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``prev``, scheduled while ``prev`` runs, before its tokens are
        sampled: each sequence's next token is a placeholder (vLLM's
        ``num_output_placeholders``) that `fill_placeholders` replaces.  Only the
        common case runs ahead: every running request is one sequence that ``prev``
        ran to its end and now decodes one token, all fitting the pool, none waiting
        or swapped.  None otherwise: the engine then waits for ``prev``'s tokens and
        calls `schedule`."""
        running, prev_seqs = self.running, prev.seqs
        if len(prev_seqs) != len(running):  # one may have finished while ``prev`` ran ahead
            finished = SequenceStatus.FINISHED
            prev_seqs = [s for s in prev_seqs if s.group.status is not finished]
        if (
            self.waiting
            or self.swapped
            or not running
            or len(prev_seqs) != len(running)
            or len(running) > self.max_num_batched_tokens
        ):
            return None
        in_prev = {id(s.group) for s in prev_seqs if _runs_ahead(s)}
        if len(in_prev) != len(running) or any(id(g) not in in_prev for g in running):
            return None
        if not self._roomy(running, len(running)) and not self._fits(
            [(g.seqs[0], 1) for g in running]
        ):
            return None  # it would preempt: that waits for the tokens
        out = SchedulerOutput()
        cached, held_of = out.scheduled_cached_reqs, self._held
        for group in running:
            seq = group.seqs[0]
            start = len(seq.token_ids)  # the placeholder's position
            held = held_of.get(seq.seq_id)
            if held is None or held[0] != start:
                return None  # (nothing appended yet: the first check runs before any)
            slot, copies, blocks, num_kept = self.kv.append_placeholder(seq.seq_id)
            for src, dst in copies:
                out.copies.append((src, dst))
                self.trace.record("cow", group.request_id, seq.seq_id, src=src, dst=dst)
            if self.trace.enabled:
                self.trace.record(
                    "append",
                    group.request_id,
                    seq.seq_id,
                    num_tokens=1,
                    num_lookahead=0,
                    blocks=list(blocks),
                )
            seq.num_computed_tokens = start + 1
            lora_slot = self.lora_slots.slot_of.get(group.lora_id, -1) if group.lora_request else -1
            out.seqs.append(
                ScheduledSeq(seq, group, start, 1, blocks, [slot], True, lora_slot, NO_POSITIONS)
            )
            cached.add(seq.seq_id, [PLACEHOLDER_TOKEN_ID], start)
            cached.add_blocks(seq.seq_id, blocks, held[1], num_kept)
            held[0], held[1] = start + 1, len(blocks)
            out.num_scheduled_tokens[seq.seq_id] = 1
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        return out

    def write_sampled(self, out: SchedulerOutput, samples: StepSamples) -> None:
        """Before ``out`` (a `schedule_ahead`) launches, while the step before it is not
        updated yet: each placeholder's input token becomes the one ``samples`` chose
        for its sequence.  A sequence that sampled none (its request failed alone)
        runs token 0 for nothing; its row is dropped when ``out`` is sampled."""
        tokens = samples.token_ids_by_seq()
        new_token_ids = out.scheduled_cached_reqs.new_token_ids
        for i, s in enumerate(out.seqs):  # one token each: the i-th is row i's
            new_token_ids[i] = tokens.get(s.seq.seq_id, 0)

    def fill_placeholders(self, out: SchedulerOutput) -> None:
        """Once the step before ``out`` is updated (``out`` already running): each
        surviving sequence's placeholder in the KV cache manager becomes its token.  A
        sequence that finished (or was aborted) meanwhile, its blocks already freed,
        ran one token for nothing: ``out``'s sampling drops its row (`drop_aborted`),
        and the device wrote its key and value into a freed slot before any later step
        can reuse it (one stream, in order)."""
        for s in out.seqs:
            seq = s.seq
            if seq.finish_reason is None and len(seq.token_ids) == s.start + 1:
                self.kv.fill_placeholder(seq.seq_id, seq.token_ids[s.start])
        self._trace_schedule(out)  # what runs

    def cancel_ahead(self, out: SchedulerOutput) -> None:
        """Undo a `schedule_ahead` that will not run: give back its placeholders'
        slots, and let the runner drop its sequences (sent whole if they run again)
        with the rows ``out`` was to drop."""
        for s in out.seqs:
            seq = s.seq
            if self.kv.has_block_table(seq.seq_id):
                self.kv.rollback(seq.seq_id, s.start)
                seq.num_computed_tokens = min(seq.num_computed_tokens, s.start)
                self._forget(seq.seq_id)
        self._finished_req_ids |= out.finished_req_ids

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue, self.running = self.running, []
        roomy = self._roomy(queue, budget)
        i, running = 0, self.running
        # The decodes in a row, run in one `_decode` call, in order, before anything
        # else allocates.  Each takes at most one block, so while fewer are pending than
        # the blocks free (``spare``) when the last ran, the next fits too; past that,
        # they run, and the next one's check sees what they took.
        decodes: list[tuple[SequenceGroup, Sequence]] = []
        spare = self.kv.num_free_gpu_blocks
        while i < len(queue) and budget > 0:
            group = queue[i]
            seqs = group.seqs
            if len(seqs) == 1:  # the common case: one sequence, decoding
                seq = seqs[0]
                if (
                    seq.num_computed_tokens == len(seq.token_ids) - 1
                    and seq.finish_reason is None
                    and not seq.spec_token_ids
                    # (a prompt's last token may be an image's: `_fit_encoder` decides)
                    and not (group.mm_features and seq.num_computed_tokens < seq.prompt_len)
                ):
                    # What _plan and _fits would find for it, without building the plan.
                    fits = roomy or len(decodes) < spare
                    if not fits:
                        self._decode(decodes, out)
                        decodes, spare = [], self.kv.num_free_gpu_blocks
                        fits = self.kv.can_append_slot(seq.seq_id)
                    if fits:
                        decodes.append((group, seq))
                        budget -= 1
                        running.append(group)
                        i += 1
                        continue
            if decodes:
                self._decode(decodes, out)
                decodes = []
            plan = _plan(group, budget)
            if group.mm_features:
                plan = self._fit_encoder_plan(group, plan)
            while not roomy and not self._fits(plan):
                victim = queue.pop()  # the most recent arrival goes first
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                budget -= self._append(group, plan, out)
                self.running.append(group)
                i += 1
            spare = self.kv.num_free_gpu_blocks
        if decodes:
            self._decode(decodes, out)
        # Requests the token budget did not reach keep their place, and their blocks.
        self.running.extend(queue[i:])
        return budget

    def _resume_swapped(self, out: SchedulerOutput) -> None:
        if not self.swapped:
            return
        seats = self.max_num_seqs - self.num_running_seqs()
        while self.swapped:
            group = self.swapped[0]
            seq_ids = [s.seq_id for s in group.unfinished_seqs]
            if (
                group.num_seats > seats
                or not self.kv.can_swap_in(seq_ids)
                or not self.lora_slots.can_acquire(group.lora_id)
            ):
                return
            self.swapped.pop(0)
            self._hold_adapter(group, out)
            out.swap_in += self.kv.swap_in(seq_ids)
            self.trace.record("swap_in", group.request_id, blocks=self._tables(seq_ids))
            # It runs from the next step on: this step's batch is already formed.
            _insert(self.running, group, SequenceStatus.RUNNING)
            seats -= group.num_seats

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return
        seats = self.max_num_seqs - self.num_running_seqs()
        i = 0
        while i < len(self.waiting) and budget > 0:
            group = self.waiting[i]
            if not self.lora_slots.can_acquire(group.lora_id):
                i += 1  # it waits for a slot for its adapter; later requests may go first
                continue
            if group.num_seats > seats or not self._can_admit(group, budget):
                return
            if group.mm_features and not self.encoder_cache.can_allocate(group.mm_features):
                return  # its images wait for room in the encoder cache
            self.waiting.pop(i)
            if group.mm_features:
                self.encoder_cache.acquire(group.request_id, group.mm_features)
            self._hold_adapter(group, out)
            budget -= self._allocate(group, out, budget)
            _insert(self.running, group, SequenceStatus.RUNNING)
            seats -= group.num_seats

    def _hold_adapter(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """``group`` runs from now on: hold its adapter's slot, loading it if need be."""
        slot, load = self.lora_slots.acquire(group.lora_id)
        if load:
            out.lora_loads.append((slot, group.lora_request))
            self.trace.record("lora_load", group.request_id, slot=slot)

    # -- block operations -------------------------------------------------------------
    def _append(
        self, group: SequenceGroup, plan: list[tuple[Sequence, int]], out: SchedulerOutput
    ) -> int:
        used = 0
        for seq, n in plan:
            start = seq.num_computed_tokens
            if n == 1 and start == len(seq.token_ids) - 1 and not seq.spec_token_ids:
                self._decode([(group, seq)], out)
                used += 1
                continue
            # Past the sequence's own tokens: a draft's guesses, in lookahead slots.
            spec = seq.spec_token_ids[: max(0, start + n - len(seq.token_ids))]
            tokens = (
                seq.token_ids[start : start + n - len(spec)] + spec
                if spec
                else (seq.token_ids[start : start + n])
            )
            num_blocks = len(self.kv.live_block_table(seq.seq_id))
            allocation = self.kv.append(seq.seq_id, tokens, len(spec), live=True)
            if allocation.copies:  # the last block was replaced by its copy
                num_blocks -= 1
            if self.trace.enabled:
                self.trace.record(
                    "append",
                    group.request_id,
                    seq.seq_id,
                    num_tokens=n,
                    num_lookahead=len(spec),
                    blocks=list(allocation.block_table),
                )
            self._run(group, seq, start, n, allocation, out, spec, num_blocks)
            used += n
        return used

    def _allocate(self, group: SequenceGroup, out: SchedulerOutput, budget: int) -> int:
        used, seqs = 0, group.unfinished_seqs
        for k, seq in enumerate(seqs):
            # Planned again per sequence: with prefix caching, a sibling allocated just
            # before may have cached more of this one's tokens.
            cached = self.kv.num_cached_tokens(
                seq.token_ids, group.cache_key, group.reads_prefix_cache
            )
            external = self._num_external_tokens(group, seq, cached)
            start = cached + external
            if group.mm_features:
                n = self._fit_encoder(
                    group, start, min(len(seq.token_ids) - start, budget - used), {}
                )
                if not n:  # a sibling cached its tokens up to an image that does not fit
                    self._hold_cached_prefix(group, seq, start)
                    continue
            else:
                n = min(len(seq.token_ids) - start, budget - used - _later(seqs, k))
            allocation = self.kv.allocate(
                seq.seq_id, seq.token_ids, external + n, group.cache_key, group.reads_prefix_cache
            )
            if external:  # loaded, not computed: their slots are the connector's
                allocation.slot_mapping = allocation.slot_mapping[external:]
                self.num_external_computed_tokens += external
            if self.connector is not None:
                self.connector.update_state_after_alloc(seq, allocation.block_table, external)
            self.trace.record(
                "allocate",
                group.request_id,
                seq.seq_id,
                num_tokens=n,
                num_cached_tokens=cached,
                blocks=allocation.block_table,
            )
            self._run(group, seq, start, n, allocation, out)
            used += n
        return used

    def _hold_cached_prefix(self, group: SequenceGroup, seq: Sequence, cached: int) -> None:
        """Give ``seq`` its ``cached`` prompt tokens' blocks and no slot: it runs from the
        next step on (vLLM's scheduler leaves such a request waiting).  (The KV cache
        manager allocates at least one token: its slot goes back at once.)"""
        self.kv.allocate(seq.seq_id, seq.token_ids, 1, group.cache_key, group.reads_prefix_cache)
        self.kv.rollback(seq.seq_id, cached)
        seq.num_computed_tokens = cached
        self.trace.record(
            "allocate",
            group.request_id,
            seq.seq_id,
            num_tokens=0,
            num_cached_tokens=cached,
            blocks=self.kv.block_table(seq.seq_id),
        )

    def _run(
        self, group, seq, start, n, allocation: Allocation, out, spec=(), num_kept_blocks=0
    ) -> None:
        """Put ``n`` tokens of ``seq`` from ``start`` on in this step's batch, with the
        slots and copy-on-write copies the KV cache manager gave them; the last of
        them may be the guesses ``spec`` (which `rollback` later keeps or gives back).
        ``num_kept_blocks``: the leading blocks of its table this step left unchanged."""
        for src, dst in allocation.copies:
            out.copies.append((src, dst))
            self.trace.record("cow", group.request_id, seq.seq_id, src=src, dst=dst)
        # The step computes them before anyone reads (the guesses: see rollback).
        seq.num_computed_tokens = start + n - len(spec)
        if start < seq.prompt_len:
            self.num_computed_prompt_tokens += min(start + n, seq.prompt_len) - start
            if group.mm_features:
                self._schedule_encoder(group, start, n, out)
        lora_slot = self.lora_slots.slot_of.get(group.lora_id, -1) if group.lora_request else -1
        positions = (
            range(0) if group.prompt_logprobs is None else group.prompt_logprob_positions(start, n)
        )
        spec = list(spec)
        out.seqs.append(
            ScheduledSeq(
                seq,
                group,
                start,
                n,
                allocation.block_table,
                allocation.slot_mapping,
                seq.num_computed_tokens == len(seq.token_ids),
                lora_slot,
                positions,
                spec,
            )
        )
        self._send(seq, start, n, allocation.block_table, out, num_kept_blocks, lora_slot)
        if spec:
            out.scheduled_spec_decode_tokens[seq.seq_id] = spec
        if positions:
            out.prompt_logprob_positions[seq.seq_id] = positions

    def _decode(self, decodes: list[tuple[SequenceGroup, Sequence]], out: SchedulerOutput) -> None:
        """`_run` for decodes, the step's common case, flattened and batched (every
        running sequence takes one each step): per ``(group, seq)``, one token, its slot,
        and the diff of a sequence the runner most likely holds.  Kept to a few
        operations per sequence (at 256 sequences, 100 ns here is 26 us a step): most
        tokens take their slot from the table's ``room`` inline (`BlockTable.take_slot`)."""
        tables, append_slot, traced = self.kv.tables, self.kv.append_slot, self.trace.enabled
        held_of, add_seq = self._held.get, out.seqs.append
        cached, num_scheduled = out.scheduled_cached_reqs, out.num_scheduled_tokens
        add_id, add_token = cached.req_ids.append, cached.new_token_ids.append
        add_count, add_blocks = cached.num_new_tokens.append, cached.new_block_ids.append
        add_computed = cached.num_computed_tokens.append
        for group, seq in decodes:
            seq_id, tokens = seq.seq_id, seq.token_ids
            start = len(tokens) - 1
            table = tables[seq_id]
            blocks = table.blocks
            if table.room > 1:  # `BlockTable.take_slot`: no new block, no copy, none filled
                slot = table.next_slot
                table.next_slot = slot + 1
                table.room -= 1
                table.token_ids.append(tokens[start])
                num_kept = len(blocks)
                if traced:
                    self._record_append(group, seq_id, (), blocks, out)
            else:
                slot, copies, blocks, num_kept = append_slot(seq_id, tokens[start])
                self._record_append(group, seq_id, copies, blocks, out)
            seq.num_computed_tokens = start + 1
            if start < seq.prompt_len or group.lora_request or group.prompt_logprobs is not None:
                lora_slot, positions = self._decode_extras(group, seq, start, out)
            else:  # the common case: a plain decode
                lora_slot, positions = -1, NO_POSITIONS
            add_seq(ScheduledSeq(seq, group, start, 1, blocks, [slot], True, lora_slot, positions))
            held = held_of(seq_id)
            if held is None:
                self._send(seq, start, 1, blocks, out, num_kept, lora_slot)
            else:  # `CachedRequestData.add` and `add_blocks`, inline for the common case
                sent, had = held
                add_id(seq_id)
                if sent == start:  # one new token: the one sampled for it last step
                    add_token(tokens[start])
                    add_count(1)
                else:
                    cached.new_token_ids += tokens[sent:]
                    add_count(start + 1 - sent)
                if num_kept == had == len(blocks):  # no block new or replaced
                    add_blocks(None)
                else:
                    cached.add_blocks(seq_id, blocks, had, num_kept)
                add_computed(start)
                held[0], held[1] = start + 1, len(blocks)
                num_scheduled[seq_id] = 1
            if positions:
                out.prompt_logprob_positions[seq_id] = positions

    def _record_append(self, group, seq_id, copies, blocks, out: SchedulerOutput) -> None:
        """A decode's copy-on-write copies, for the cache engine, and its trace events."""
        for src, dst in copies:
            out.copies.append((src, dst))
            self.trace.record("cow", group.request_id, seq_id, src=src, dst=dst)
        if self.trace.enabled:
            self.trace.record(
                "append",
                group.request_id,
                seq_id,
                num_tokens=1,
                num_lookahead=0,
                blocks=list(blocks),
            )

    def _decode_extras(self, group, seq: Sequence, start: int, out) -> tuple[int, range]:
        """A decode's rarer parts: its adapter's slot, the positions scoring a prompt
        token, and, for a prompt's last token, its count and its images."""
        if start < seq.prompt_len:  # a prompt's last chunk of one token
            self.num_computed_prompt_tokens += 1
            if group.mm_features:
                self._schedule_encoder(group, start, 1, out)
        lora_slot = self.lora_slots.slot_of.get(group.lora_id, -1) if group.lora_request else -1
        positions = (
            NO_POSITIONS
            if group.prompt_logprobs is None
            else group.prompt_logprob_positions(start, 1)
        )
        return lora_slot, positions

    def _schedule_encoder(self, group: SequenceGroup, start: int, n: int, out) -> None:
        """Run the encoder this step on each image whose placeholder the tokens
        ``[start, start + n)`` reach and whose embeddings are not cached (vLLM's
        ``_try_schedule_encoder_inputs``); an image the prefix cache covered whole is
        never reached, so never encoded."""
        for feature in group.mm_features:
            if feature.mm_position.overlap(start, start + n) and self.encoder_cache.needs_compute(
                feature.identifier
            ):
                out.scheduled_encoder_inputs[feature.identifier] = feature
                self._encoder_budget -= feature.num_embeds

    def _fit_encoder(self, group: SequenceGroup, start: int, n: int, counted: dict) -> int:
        """How many of the ``n`` tokens from ``start`` can run this step: all, or those
        before the placeholder of the first image they reach that is not encoded and
        whose encoder tokens do not fit what is left of ``max_num_encoder_input_tokens``
        (vLLM's ``_try_schedule_encoder_inputs`` cuts ``num_new_tokens`` so), or, with
        ``disable_chunked_mm_input``, of the first image they would end inside of.
        ``counted``: the images (hash -> tokens) this plan already takes from the budget."""
        left = self._encoder_budget - sum(counted.values())
        for feature in group.mm_features:  # in prompt order
            pos, h = feature.mm_position, feature.identifier
            if pos.offset >= start + n:
                break
            if pos.offset + pos.length <= start:
                continue
            if self.disable_chunked_mm_input and start <= pos.offset:
                if start + n < pos.offset + pos.length:
                    return pos.offset - start
            if h in counted or self.encoder_cache.is_computed(h):
                continue
            if feature.num_embeds > left:
                return max(pos.offset - start, 0)
            left -= feature.num_embeds
            counted[h] = feature.num_embeds
        return n

    def _fit_encoder_plan(self, group: SequenceGroup, plan: list[tuple[Sequence, int]]):
        """A running request's plan, each chunk cut by `_fit_encoder`; a sequence cut to
        nothing waits for the next step."""
        counted: dict[str, int] = {}
        fitted = [
            (seq, self._fit_encoder(group, seq.num_computed_tokens, n, counted)) for seq, n in plan
        ]
        return [(seq, n) for seq, n in fitted if n]

    def _send(self, seq, start, n, blocks, out, num_kept_blocks, lora_slot) -> None:
        """The runner's diff for ``seq``: whole if the runner does not hold it, else the
        tokens and blocks it has not seen."""
        seq_id, held = seq.seq_id, self._held.get(seq.seq_id)
        if held is None:
            self._held[seq_id] = [len(seq.token_ids), len(blocks)]
            out.scheduled_new_reqs.append(
                NewRequestData(seq_id, list(seq.token_ids), list(blocks), start, lora_slot)
            )
        else:
            cached = out.scheduled_cached_reqs
            cached.add(seq_id, seq.token_ids[held[0] :], start)
            cached.add_blocks(seq_id, blocks, held[1], num_kept_blocks)
            held[0], held[1] = len(seq.token_ids), len(blocks)
        out.num_scheduled_tokens[seq_id] = n

    def rollback(self, group: SequenceGroup, seq: Sequence, num_accepted: int) -> None:
        """After verification: keep the KV of the first ``num_accepted`` guesses ``seq``
        ran this step (now its tokens, computed), give back the slots of the rest."""
        seq.num_computed_tokens += num_accepted
        released = self.kv.rollback(seq.seq_id, seq.num_computed_tokens)
        if self.trace.enabled:
            self.trace.record(
                "rollback",
                group.request_id,
                seq.seq_id,
                num_accepted=num_accepted,
                num_released_blocks=released,
                blocks=self.kv.block_table(seq.seq_id),
            )

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Evict a whole request (§4.5): swap it out if asked and the CPU pool has room,
        else free its blocks and recompute it later."""
        seq_ids = [s.seq_id for s in group.unfinished_seqs]
        self.num_preemptions += 1
        out.preempted.append(group)
        swap = self.preemption_mode == "swap" and self.kv.can_swap_out(seq_ids)
        self.trace.record("preempt", group.request_id, mode="swap" if swap else "recompute")
        self.lora_slots.release(group.lora_id)
        if swap:
            out.swap_out += self.kv.swap_out(seq_ids)
            for seq_id in seq_ids:  # its blocks moved: the runner drops it
                self._forget(seq_id)
            self.trace.record("swap_out", group.request_id, blocks=self._tables(seq_ids))
            _insert(self.swapped, group, SequenceStatus.SWAPPED)
        else:
            self._release(group, None)
            _insert(self.waiting, group, SequenceStatus.WAITING)

    def _release(self, group: SequenceGroup, finish_reason: str | None) -> None:
        """Free every block the request holds; with a reason, its sequences end too."""
        for seq in group.unfinished_seqs:
            if self.kv.has_block_table(seq.seq_id):
                self.free_seq(group, seq)
            seq.num_computed_tokens = 0
            seq.finish_reason = finish_reason
        if group.mm_features:
            self.encoder_cache.release(group.request_id)

    def _roomy(self, queue: list[SequenceGroup], budget: int) -> bool:
        """Can every running sequence take its next tokens, whatever they are?  True on
        most steps, which then skip checking request by request."""
        return self.kv.can_append_any(sum([len(group.seqs) for group in queue]), budget)

    def _fits(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Can the GPU pool take every sequence's next tokens?"""
        return self.kv.can_append_all([(seq.seq_id, n) for seq, n in plan])

    def _can_admit(self, group: SequenceGroup, budget: int) -> bool:
        """Can every sequence of a waiting request get its first chunk's tokens and
        blocks now?"""
        plan = self._admission_plan(group, budget)
        return plan is not None and self.kv.can_allocate_all(
            [(seq.token_ids, n) for seq, n in plan], group.cache_key, group.reads_prefix_cache
        )

    def _admission_plan(self, group: SequenceGroup, budget: int):
        """First-chunk sizes for a waiting request's sequences, or None if the token
        budget, or the encoder budget (`_fit_encoder`), cannot give each of them at
        least one token this step."""
        plan, seqs, counted = [], group.unfinished_seqs, {}
        for k, seq in enumerate(seqs):
            cached = self.kv.num_cached_tokens(
                seq.token_ids, group.cache_key, group.reads_prefix_cache
            )
            external = self._num_external_tokens(group, seq, cached)
            n = len(seq.token_ids) - cached - external
            if group.mm_features:
                # Its sequences after the first may run nothing this step (`_allocate`):
                # none needs budget kept for it.
                n = self._fit_encoder(group, cached + external, min(n, budget), counted)
                if not n and k:
                    plan.append((seq, 1))  # the slot `_hold_cached_prefix` gives back
                    continue
            else:
                n = min(n, budget - _later(seqs, k))
            if n < 1:
                return None
            plan.append((seq, external + n))  # the blocks take the loaded tokens too
            budget -= n
        return plan

    def _num_external_tokens(self, group: SequenceGroup, seq: Sequence, cached: int) -> int:
        """Prompt tokens of ``seq`` past its ``cached`` ones that the KV connector can
        load (0 without one, or for a request whose KV it cannot stand for: one with a
        LoRA adapter, or asking for its prompt's logprobs, which needs them computed)."""
        if self.connector is None or group.lora_request is not None:
            return 0
        if not group.reads_prefix_cache:
            return 0
        return self.connector.get_num_new_matched_tokens(seq, cached)[0]

    def _tables(self, seq_ids: list[str]) -> dict[str, list[int]]:
        return {s: self.kv.block_table(s) for s in seq_ids}


NO_POSITIONS = range(0)  # a sequence's positions scoring prompt tokens, most often


def _plan(group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
    """A running request's tokens this step: each sequence's uncomputed tokens (one for
    a decode, a chunk of a prompt), as far as the token budget goes; a decode also runs
    its draft's guesses, each a token of the budget (vLLM cuts them to fit too)."""
    plan = []
    for seq in group.seqs:  # (not group.unfinished_seqs: this runs for every request)
        uncomputed = len(seq.token_ids) - seq.num_computed_tokens
        n = min(uncomputed, budget)
        if n > 0 and seq.finish_reason is None:
            if uncomputed == 1 and seq.spec_token_ids:
                n += min(len(seq.spec_token_ids), budget - 1)
            plan.append((seq, n))
            budget -= n
    return plan


def _runs_ahead(s: ScheduledSeq) -> bool:
    """Can the step after this one schedule ``s``'s next token before it is sampled?"""
    group = s.group
    return (
        s.samples
        and not s.spec_token_ids
        and group.width == 1
        and len(group.seqs) == 1
        and not group.is_beam_search
        and not group.mm_features
        and group.embedding is None
    )


def width_of(params: SamplingParams | BeamSearchParams) -> tuple[str, int]:
    """The parameter that sets how many sequences a request runs at once, and its value."""
    name = "beam_width" if isinstance(params, BeamSearchParams) else "n"
    return name, getattr(params, name)


def _later(seqs: list[Sequence], k: int) -> int:
    """Tokens of budget to leave for the sequences after the ``k``-th: one each, so a
    recomputed group's last sequences are not starved by its first (a livelock)."""
    return len(seqs) - k - 1


def _insert(queue: list[SequenceGroup], group: SequenceGroup, status: SequenceStatus) -> None:
    """Put ``group`` in ``queue`` at its arrival position (FCFS across preemptions)."""
    group.status = status
    bisect.insort(queue, group, key=lambda g: g.arrival)

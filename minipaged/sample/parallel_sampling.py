"""Sampling, and parallel sampling over forked sequences (paper §4.4).

A request with ``n`` > 1 asks for ``n`` completions of one prompt.  The prompt is
computed once: its one row of logits gives all ``n`` completions their first token,
each drawn from its own random stream when the request has a seed, and the update phase
then forks the prompt into ``n`` sequences (the children share every block of the
prompt, copy-on-write).  From then on they are ordinary sequences that happen to share
blocks; ``n`` = 1 is the plain case of the same code.

`ParallelSampling` is the sample phase for sampling requests, as `BeamSearch` is for
beam search: it only chooses tokens (`Sample`, or a plain step's as columns,
`SampledTokens`); appending them, forking, the stop checks
and freeing are the update phase's (`OutputProcessor.update_from_output`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.core.sched.output import Sample, SampledTokens, ScheduledSeq, StepSamples
from minipaged.sample.metadata import SamplingInputBatch
from minipaged.sample.sampler import sample, seq_generator
from minipaged.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class StepRows:
    """What the sample phase reads of a step's sampling sequences, read once, column by
    column (read only: a decode step's are kept for the next, `StepRows.of`)."""

    seqs: list[Sequence]
    groups: list[SequenceGroup]
    params: list  # each group's SamplingParams (or BeamSearchParams)
    beams: list[int]  # the rows of beam search requests (`BeamSearch` ranks them)
    plain: list[int]  # the others (`ParallelSampling` draws them)
    structured: bool  # does any row have a grammar (structured outputs)?
    forks: bool  # does a prompt with n > 1 sample (its forks' first tokens)?

    @classmethod
    def of(cls, sampling: list[ScheduledSeq], last: StepRows | None = None) -> StepRows:
        """``sampling``'s rows; ``last`` (the step before's) again if it sampled the same
        sequences in the same order and none forked: a decode step's, told by one
        identity comparison per row.  (What is read here never changes for a sequence:
        its group, the group's parameters and kind, its grammar; and a group that has
        forked keeps its sequences, so no prompt of ``last`` forks again.)"""
        seqs = [s.seq for s in sampling]
        if last is not None and not last.forks and seqs == last.seqs:
            return last
        groups = [s.group for s in sampling]
        beams = [i for i, g in enumerate(groups) if g.is_beam_search]
        plain = [i for i, g in enumerate(groups) if not g.is_beam_search] if beams else None
        plain = list(range(len(seqs))) if plain is None else plain
        return cls(
            seqs,
            groups,
            [g.params for g in groups],
            beams,
            plain,
            any([s.grammar is not None for s in seqs]),
            any([groups[i].params.n > 1 and len(groups[i].seqs) == 1 for i in plain]),
        )


class ParallelSampling:
    """Draws the next token of every sampling sequence that reached its end."""

    def __init__(self, eos_token_ids: set[int], generator: torch.Generator) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = generator  # for requests without a seed, shared by all of them
        # The decoding sequences' parameters as tensors, kept across steps (the first
        # step's logits tell the vocabulary and the device).
        self.input_batch: SamplingInputBatch | None = None

    def remove(self, seq_ids) -> None:
        """Forget sequences that finished or left the runner's batch (the scheduler's
        ``finished_req_ids``); one that samples again is added back whole."""
        if self.input_batch is not None:
            self.input_batch.remove(seq_ids)

    def step(
        self, sampling: list[ScheduledSeq], logits: torch.Tensor, rows: StepRows
    ) -> StepSamples:
        """`sample` for the engine's sample phase, of ``rows.plain``: a step where no
        prompt forks (every decode step) as columns (`SampledTokens`), without a
        `Sample` per row."""
        if rows.forks:
            return StepSamples(tokens=self._sample_forking(sampling, logits, rows.plain))
        return StepSamples(sampled=[self._sample_unforked(rows, logits)])

    def sample(
        self, sampling: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]
    ) -> list[Sample]:
        """One token per sequence of ``rows``; a prompt with ``n`` > 1 draws ``n``, the
        ``n - 1`` after its own for the forks it will become, from its one row of logits."""
        scheduled = sampling if len(rows) == len(sampling) else [sampling[i] for i in rows]
        step_rows = StepRows.of(scheduled)
        if step_rows.forks:
            return self._sample_forking(sampling, logits, rows)
        if len(rows) != logits.shape[0]:
            logits = logits[rows]
        return self._sample_unforked(step_rows, logits).samples()

    def _sample_forking(
        self, sampling: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]
    ) -> list[Sample]:
        logit_rows, groups, seqs, generators, forks = [], [], [], [], []
        for i in rows:
            group, seq = sampling[i].group, sampling[i].seq
            width = group.params.n if len(group.seqs) == 1 else 1
            logit_rows += [i] * width
            groups += [group] * width
            seqs += [seq] * width
            generators.append(seq.generator)
            for index in range(1, width):  # the forks' streams, numbered as they will be
                generators.append(seq_generator(group.params, index, self.generator.device))
            forks += [False] + [True] * (width - 1)
        # Row i of the logits for each sequence: as they are when no prompt forks (no
        # copy of a [rows, vocab] tensor, 50 MB at 256 rows of a 49k vocabulary).
        if logit_rows != list(range(logits.shape[0])):
            logits = logits[logit_rows]
        out = sample(
            logits,
            [g.params for g in groups],
            generators,
            self.generator,
            [s.token_ids for s in seqs],
            [s.prompt_len for s in seqs],
            self.eos_token_ids,
        )
        return [
            Sample(group, seq, token, logprob, top, fork, generator if fork else None)
            for group, seq, token, logprob, top, fork, generator in zip(
                groups, seqs, out.token_ids, out.logprobs, out.top_logprobs, forks, generators
            )
        ]

    def _sample_unforked(self, rows: StepRows, logits: torch.Tensor) -> SampledTokens:
        """`sample` of a step where no prompt forks (every decode step): one token per
        row of ``rows.plain``, its parameters kept across steps (`SamplingInputBatch`)."""
        plain = rows.plain
        seqs, groups, params = rows.seqs, rows.groups, rows.params
        if len(plain) != len(seqs):  # beam search rows among them
            seqs, groups = [seqs[i] for i in plain], [groups[i] for i in plain]
            params, logits = [params[i] for i in plain], logits[plain]
        batch = self.input_batch
        if batch is None:
            batch = self.input_batch = SamplingInputBatch(logits.shape[1], logits.device)
        metadata = batch.metadata(batch.rows(seqs, params), self.eos_token_ids)
        out = sample(logits, params, generator=self.generator, metadata=metadata)
        # Copies: the update phase gets lists of its own, these may serve the next step.
        return SampledTokens(
            list(groups), list(seqs), out.token_ids, out.logprobs, out.top_logprobs
        )

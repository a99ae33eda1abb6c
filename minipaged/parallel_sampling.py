"""Sampling, and parallel sampling over forked sequences (paper §4.4).

A request with ``n`` > 1 asks for ``n`` completions of one prompt.  The prompt is
computed once: at its first sample the sequence forks into ``n`` (the children share
every block of the prompt, copy-on-write), and all ``n`` draw their first token from
the prompt's one row of logits, each from its own random stream when the request has a
seed.  From then on they are ordinary sequences that happen to share blocks; ``n`` = 1
is the plain case of the same code.

`ParallelSampling` is the engine's update phase for sampling requests, as `BeamSearch`
is for beam search: it asks the scheduler to fork and to append each token, so the event
trace sees every block operation, and the output processor to check each sequence's
stop conditions.
"""

from __future__ import annotations

import dataclasses

import torch

from minipaged.batch import ScheduledSeq
from minipaged.output_processor import OutputProcessor
from minipaged.sampler import sample, seq_generator
from minipaged.scheduler import Scheduler
from minipaged.sequence import Sequence, SequenceGroup


class ParallelSampling:
    """Draws the next token of every sampling sequence that reached its end."""

    def __init__(
        self,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        eos_token_ids: set[int],
        generator: torch.Generator,
    ) -> None:
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.eos_token_ids = eos_token_ids
        self.generator = generator  # for requests without a seed, shared by all of them

    def sample(self, sampling: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]) -> int:
        """Draw one token per sequence of ``rows``; a prompt with ``n`` > 1 first forks
        into ``n`` sequences, all drawing from its one row of logits.  Returns the
        number of tokens drawn."""
        logit_rows, groups, seqs = [], [], []
        for i in rows:
            group, seq = sampling[i].group, sampling[i].seq
            branch = [seq]
            if group.params.n > 1 and len(group.seqs) == 1:
                branch += [self._fork(group, seq) for _ in range(group.params.n - 1)]
            logit_rows += [i] * len(branch)
            groups += [group] * len(branch)
            seqs += branch
        # Row i of the logits for each sequence: as they are when no prompt forked (no
        # copy of a [rows, vocab] tensor, 50 MB at 256 rows of a 49k vocabulary).
        if logit_rows != list(range(logits.shape[0])):
            logits = logits[logit_rows]
        out = sample(
            logits,
            [g.params for g in groups],
            [s.generator for s in seqs],
            self.generator,
            [s.token_ids for s in seqs],
            [s.prompt_len for s in seqs],
            self.eos_token_ids,
        )
        for group, seq, token, logprob, top in zip(
            groups, seqs, out.token_ids, out.logprobs, out.top_logprobs
        ):
            self.scheduler.append_token(group, seq, token, logprob)
            if seq.logprobs is not None:
                seq.logprobs.append(top)
            self.output_processor.check_stop(group, seq)
        return len(seqs)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = self.scheduler.fork(group, parent)
        child.generator = seq_generator(group.params, child.index, self.generator.device)
        child.output_text = parent.output_text
        child.detokenizer = dataclasses.replace(parent.detokenizer)
        return child

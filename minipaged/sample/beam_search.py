"""Beam search over forked sequences (paper §4.4), as vLLM's ``beam_search`` does it.

Every step, each live beam of a request proposes its ``2 * beam_width`` most likely next
tokens; the request keeps the ``beam_width`` best extensions of all of them.  A beam kept
more than once forks (its children share its blocks, copy-on-write); a beam not kept is
freed.  Extensions ending in EOS are set aside as finished candidates, and at
``max_tokens`` the live beams join them; the best ``beam_width`` candidates, by
`beam_score`, are the request's output.

`BeamSearch` is the sample phase for beam search requests, as `ParallelSampling` is for
sampling: it only chooses (`StepSamples`); forking the beams kept more than once,
freeing the others, the length limit and the output are the update phase's
(`OutputProcessor.update_from_output`).  With structured outputs each beam's logits are
masked by its own grammar first (a fork copies its parent's matcher), so its candidates
are the tokens the grammar allows.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from minipaged.core.sched.output import Sample, ScheduledSeq, StepSamples
from minipaged.outputs import BeamSearchOutput, BeamSearchSequence
from minipaged.sample.sampler import beam_candidates
from minipaged.sequence import SequenceGroup


def beam_score(
    tokens: list[int], cum_logprob: float, eos_token_ids: set[int], length_penalty: float
) -> float:
    """vLLM's ``get_beam_search_score``: the cumulative logprob over the length (prompt
    included) to the ``length_penalty``; a final EOS is not counted, even with
    ``ignore_eos``."""
    length = len(tokens) - (tokens[-1] in eos_token_ids)
    return cum_logprob / length**length_penalty


class BeamSearch:
    """Ranks beam search requests' candidates and builds their outputs."""

    def __init__(self, eos_token_ids: set[int], tokenizer) -> None:
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer

    def rank(
        self, sampling: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]
    ) -> StepSamples:
        """Give every beam that reached its end its best next tokens; for each request
        whose live beams all have theirs, choose the next step's beams."""
        width = max(sampling[i].group.params.beam_width for i in rows)
        top = beam_candidates(logits[rows], width)
        ids, logprobs = top.token_ids.tolist(), top.logprobs.tolist()
        for j, i in enumerate(rows):
            k = 2 * sampling[i].group.params.beam_width
            # Kept on the beam until it grows: after a recompute, beams may finish their
            # prompts in different steps.  A token its grammar masked is no candidate.
            sampling[i].seq.beam_candidates = [
                (t, lp) for t, lp in zip(ids[j][:k], logprobs[j][:k]) if lp > -math.inf
            ]
        out = StepSamples()
        for group in dict.fromkeys(sampling[i].group for i in rows):
            if all(b.beam_candidates is not None for b in group.unfinished_seqs):
                self._extend(group, out)
        return out

    def _extend(self, group: SequenceGroup, out: StepSamples) -> None:
        """The ``beam_width`` best extensions of all beams: a beam kept more than once
        forks, one not kept is dropped, one ending in EOS is set aside finished."""
        params = group.params
        live, eos = [], set() if params.ignore_eos else self.eos_token_ids
        for beam in group.unfinished_seqs:
            for token, logprob in beam.beam_candidates:
                if token in eos:
                    out.finished_beams.append(Sample(group, beam, token, logprob))
                else:
                    live.append((beam.cumulative_logprob + logprob, beam, token, logprob))
        live.sort(
            key=lambda c: (
                -beam_score(
                    c[1].token_ids + [c[2]], c[0], self.eos_token_ids, params.length_penalty
                )
            )
        )
        kept = defaultdict(list)
        for _, beam, token, logprob in live[: params.beam_width]:
            kept[beam].append((token, logprob))
        for beam in group.unfinished_seqs:
            if beam not in kept:
                out.dropped_beams.append((group, beam))
                continue
            for k, (token, logprob) in enumerate(kept[beam]):
                out.tokens.append(Sample(group, beam, token, logprob, fork=k > 0))

    def output(self, group: SequenceGroup) -> BeamSearchOutput:
        """The request's best ``beam_width`` finished candidates, best first."""
        params, prompt_len = group.params, len(group.prompt_token_ids)
        eos = set() if params.ignore_eos else self.eos_token_ids
        best = sorted(
            group.completed_beams,
            reverse=True,
            key=lambda beam: beam_score(*beam, self.eos_token_ids, params.length_penalty),
        )[: params.beam_width]
        sequences = []
        for tokens, cum in best:
            generated = tokens[prompt_len:-1] if tokens[-1] in eos else tokens[prompt_len:]
            sequences.append(BeamSearchSequence(tokens, self.tokenizer.decode(generated), cum))
        return BeamSearchOutput(group.request_id, sequences)

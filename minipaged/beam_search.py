"""Beam search over forked sequences (paper §4.4), as vLLM's ``beam_search`` does it.

Every step, each live beam of a request proposes its ``2 * beam_width`` most likely next
tokens; the request keeps the ``beam_width`` best extensions of all of them.  A beam kept
more than once forks (its children share its blocks, copy-on-write); a beam not kept is
freed.  Extensions ending in EOS are set aside as finished candidates, and at
``max_tokens`` the live beams join them; the best ``beam_width`` candidates, by
`beam_score`, are the request's output.

`BeamSearch` is the engine's update phase for beam search requests: it asks the
scheduler to fork and free beams, so the event trace sees every block operation.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from minipaged.batch import ScheduledSeq
from minipaged.outputs import BeamSearchOutput, BeamSearchSequence
from minipaged.sampler import beam_candidates
from minipaged.scheduler import Scheduler
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

    def __init__(
        self, scheduler: Scheduler, eos_token_ids: set[int], max_model_len: int, tokenizer
    ) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def rank(self, sampling: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]) -> int:
        """Give every beam that reached its end its best next tokens; a request whose
        live beams all have theirs moves on to the next step's beams.  Returns the
        number of tokens the kept beams gained."""
        width = max(sampling[i].group.params.beam_width for i in rows)
        top = beam_candidates(logits[rows], width)
        ids, logprobs = top.token_ids.tolist(), top.logprobs.tolist()
        for j, i in enumerate(rows):
            k = 2 * sampling[i].group.params.beam_width
            sampling[i].seq.beam_candidates = list(zip(ids[j][:k], logprobs[j][:k]))
        generated = 0
        for group in dict.fromkeys(sampling[i].group for i in rows):
            # After a recompute, beams may finish their prompts in different steps.
            if all(b.beam_candidates is not None for b in group.unfinished_seqs):
                generated += self._extend(group)
        return generated

    def _extend(self, group: SequenceGroup) -> int:
        """Keep the ``beam_width`` best extensions of all beams; returns how many."""
        params = group.params
        live, eos = [], set() if params.ignore_eos else self.eos_token_ids
        for beam in group.unfinished_seqs:
            for token, logprob in beam.beam_candidates:
                score = beam.cumulative_logprob + logprob
                if token in eos:
                    group.completed_beams.append((beam.token_ids + [token], score))
                else:
                    live.append((score, beam, token, logprob))
            beam.beam_candidates = None
        live.sort(
            key=lambda c: (
                -beam_score(
                    c[1].token_ids + [c[2]], c[0], self.eos_token_ids, params.length_penalty
                )
            )
        )
        children = defaultdict(list)
        for _, beam, token, logprob in live[: params.beam_width]:
            children[beam].append((token, logprob))
        for beam in group.unfinished_seqs:
            if beam not in children:
                self.scheduler.free_seq(group, beam)
                group.seqs.remove(beam)
                continue
            first, *rest = children[beam]
            for token, logprob in rest:  # fork before the parent grows
                self.scheduler.fork(group, beam).append_token(token, logprob)
            beam.append_token(*first)
        self._maybe_finish(group)
        return min(params.beam_width, len(live))

    def _maybe_finish(self, group: SequenceGroup) -> None:
        """At ``max_tokens`` (or ``max_model_len``) the live beams join the finished
        candidates and give their blocks back."""
        beams = group.unfinished_seqs
        if beams and (
            beams[0].num_output_tokens < group.params.max_tokens
            and len(beams[0].token_ids) < self.max_model_len
        ):
            return
        for beam in beams:
            group.completed_beams.append((list(beam.token_ids), beam.cumulative_logprob))
            self.scheduler.free_seq(group, beam)
            beam.finish_reason = "length"

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

"""The output processor: the step's update phase, from sampled tokens to `RequestOutput`s
(paper §4.5).

`OutputProcessor.update_from_output` is the one place a step changes its requests, as
vLLM's ``Scheduler.update_from_output`` is: the sample phase only chose tokens
(`StepSamples`); here each one is appended (a prompt with ``n`` > 1, or a beam kept
more than once, forking first), the stop conditions are checked, a finished sequence
gives its blocks back, and a finished request retires.  The stop conditions, in vLLM's
order: EOS (unless ``ignore_eos``), a stop token, a stop string (its text cut where the
string begins), then ``max_tokens`` or ``max_model_len``; a beam search request only
has the last two (its EOS extensions were set aside when ranked).  A sequence that
stops gives its blocks back at once, through the scheduler; shared blocks only lose a
holder.

Then it turns the step's requests into what `LLMEngine.step` returns: each finished
request's output (its last sequence done, it leaves the scheduler), and, for requests
that stream (``output_kind`` other than ``FINAL_ONLY``), what the step added.  Text is
decoded incrementally (`minipaged.engine.detokenizer`), and only where it is needed before the
end.
"""

from __future__ import annotations

from minipaged.core.sched.output import Sample, SchedulerOutput, StepSamples, Verified
from minipaged.core.sched.scheduler import Scheduler
from minipaged.outputs import CompletionOutput, Output, RequestOutput
from minipaged.sample.beam_search import BeamSearch
from minipaged.sampling_params import RequestOutputKind, SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


class OutputProcessor:
    """The update phase over the scheduler's requests, and the outputs it builds."""

    def __init__(
        self,
        scheduler: Scheduler,
        beam_search: BeamSearch,
        eos_token_ids: set[int],
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.beam_search = beam_search
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def update_from_output(self, batch: SchedulerOutput, samples: StepSamples) -> list[Output]:
        """Apply what the sample phase chose for ``batch``, and return the step's outputs:
        the requests that finished, and the news of those that stream.  A request
        aborted since ``batch`` was scheduled (one that failed alone) is left out."""
        for v in samples.verified:  # speculative decoding's accepted guesses and more
            self._apply_verified(v)
        for s in samples.finished_beams:  # from the beam as it was when ranked
            s.group.completed_beams.append(
                (s.seq.token_ids + [s.token_id], s.seq.cumulative_logprob + s.logprob)
            )
        for group, beam in samples.dropped_beams:
            self.scheduler.free_seq(group, beam)
            group.seqs.remove(beam)
        # Every fork before any sequence grows: a child starts from its parent as it was.
        seqs = [self._fork(s) if s.fork else s.seq for s in samples.tokens]
        for s, seq in zip(samples.tokens, seqs):
            self.scheduler.append_token(s.group, seq, s.token_id, s.logprob)
            if seq.logprobs is not None:
                seq.logprobs.append(s.top_logprobs)
            self.check_stop(s.group, seq)
        return self.outputs(list(dict.fromkeys(s.group for s in batch.seqs)))

    def _apply_verified(self, v: Verified) -> None:
        """Keep the slots of ``v``'s accepted guesses, give back the rest, and append its
        tokens one at a time, each checked for a stop (the tokens after one are dropped)."""
        group, seq = v.group, v.seq
        self.scheduler.rollback(group, seq, len(v.token_ids) - 1)
        seq.spec_token_ids = []
        for token, logprob, top in zip(v.token_ids, v.logprobs, v.top_logprobs):
            self.scheduler.append_token(group, seq, token, logprob)
            v.num_appended += 1
            if seq.logprobs is not None:
                seq.logprobs.append(top)
            self.check_stop(group, seq)
            if seq.is_finished:
                break

    def _fork(self, sample: Sample) -> Sequence:
        child = self.scheduler.fork(sample.group, sample.seq)
        child.generator = sample.generator
        return child

    # -- stop checks ------------------------------------------------------------------
    def check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Decide whether ``seq`` is done after its new token, detokenizing as it goes
        where text is needed before the end (stop strings, streaming)."""
        params, token = group.params, seq.token_ids[-1]
        if group.is_beam_search:
            if self._at_length(params, seq):  # the beam joins the finished candidates
                group.completed_beams.append((list(seq.token_ids), seq.cumulative_logprob))
                self._end(group, seq, "length", None)
            return
        eos = not params.ignore_eos and token in self.eos_token_ids
        if eos or token in params.stop_token_ids:
            # The stop token stays in the token ids but not in the text (vLLM).
            self._end(group, seq, "stop", None if eos else token, seq.output_token_ids[:-1])
            return
        if params.stop or params.output_kind is not RequestOutputKind.FINAL_ONLY:
            new_text = seq.detokenizer.update(seq.output_token_ids)
            seq.output_text += new_text
            # vLLM: no stop string counts before min_tokens (stop tokens are masked).
            if seq.num_output_tokens >= params.min_tokens and (
                hit := stop_string(seq, params.stop, len(new_text))
            ):
                self._end(group, seq, "stop", hit)
                return
        if self._at_length(params, seq):
            self._end(group, seq, "length", None, seq.output_token_ids)

    def _at_length(self, params, seq: Sequence) -> bool:
        return (
            seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len
        )

    def _end(
        self,
        group: SequenceGroup,
        seq: Sequence,
        reason: str,
        stop_reason: int | str | None,
        text_token_ids: list[int] | None = None,
    ) -> None:
        """Finish ``seq``; ``text_token_ids``: the tokens whose text it ends with, decoded
        now if not yet (a request that neither streams nor stops on strings is decoded
        only here, once, which gives the same text as decoding it step by step)."""
        if text_token_ids is not None:
            seq.output_text += seq.detokenizer.update(text_token_ids, final=True)
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.free_seq(group, seq)

    # -- outputs ----------------------------------------------------------------------
    def outputs(self, groups: list[SequenceGroup]) -> list[Output]:
        """The outputs of a step's ``groups``: the requests that finished, and the news
        of those that stream."""
        outputs = []
        for group in groups:
            if group.status is SequenceStatus.FINISHED:  # aborted
                continue
            if group.is_finished:
                outputs.append(self._finish(group))
            elif streams(group) and (output := self.request_output(group)):
                outputs.append(output)
        return outputs

    def _finish(self, group: SequenceGroup) -> Output:
        self.scheduler.retire(group)
        if group.is_beam_search:
            return self.beam_search.output(group)
        return self.request_output(group)

    def request_output(self, group: SequenceGroup) -> RequestOutput | None:
        """The request's completions so far; for ``DELTA``, only what is new since the
        last output, and None if nothing is."""
        delta = group.params.output_kind is RequestOutputKind.DELTA
        seqs = sorted(group.seqs, key=lambda s: s.index)
        first = not any(s.num_reported_tokens for s in seqs)  # a stream's first output
        completions = [
            completion(s, group.params, delta)
            for s in seqs
            if not delta or s.num_output_tokens > s.num_reported_tokens
        ]
        if not completions:
            return None
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            completions,
            group.is_finished,
            group.prompt_logprobs if first or not delta else None,
        )


def completion(seq: Sequence, params: SamplingParams, delta: bool) -> CompletionOutput:
    """``seq``'s completion so far; with ``delta``, only what it has not reported yet
    (which it now has)."""
    tokens, text, logprobs = seq.output_token_ids, seq.output_text, seq.logprobs
    if not seq.is_finished and params.stop:
        # The text's tail may be the start of a stop string, to be cut if completed.
        text = text[: max(0, len(text) - max(map(len, params.stop)) + 1)]
    if delta:
        start = seq.num_reported_tokens
        tokens = tokens[start:]
        logprobs = None if logprobs is None else logprobs[start:]
        seq.num_reported_tokens += len(tokens)
        text, seq.num_reported_chars = text[seq.num_reported_chars :], len(text)
    return CompletionOutput(
        seq.index,
        text,
        list(tokens),
        None if seq.logprobs is None else seq.cumulative_logprob,  # vLLM V1's
        logprobs,
        seq.finish_reason,
        seq.stop_reason,
    )


def stop_string(seq: Sequence, stops: list[str], num_new: int) -> str | None:
    """The first of ``stops`` that the last ``num_new`` characters completed (it may
    begin in older text); the text is cut where it begins."""
    if not num_new:
        return None
    text = seq.output_text
    for stop in stops:
        index = text.find(stop, max(0, len(text) - num_new - len(stop) + 1))
        if index != -1:
            seq.output_text = text[:index]
            return stop
    return None


def streams(group: SequenceGroup) -> bool:
    """Whether ``group`` wants outputs before it finishes (beam search never does)."""
    return not group.is_beam_search and group.params.output_kind is not RequestOutputKind.FINAL_ONLY

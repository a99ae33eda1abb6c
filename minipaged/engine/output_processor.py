"""The output processor: a step's requests, after the update, as `RequestOutput`s
(paper §4.5; vLLM V1's front-end ``OutputProcessor``).

The update phase itself is the scheduler's (`Scheduler.update_from_output`, as in
vLLM): it appends the sampled tokens, checks the stop conditions, frees blocks and
retires finished requests.  What is left here is text and outputs: each finished
request's output, and, for requests that stream (``output_kind`` other than
``FINAL_ONLY``), what the step added.  Text is decoded incrementally
(`minipaged.engine.detokenizer`), and only where it is needed before the end: a stop
string is found in the text (`check_stop_strings`, which the scheduler's stop check
calls, in vLLM's order, after EOS and stop tokens and before the length; its text is
cut where the string begins), and a stream's text grows step by step; any other
request's text is decoded once, when it finishes, which gives the same text.
"""

from __future__ import annotations

from minipaged.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Output,
    RequestOutput,
)
from minipaged.sample.beam_search import BeamSearch
from minipaged.sampling_params import RequestOutputKind, SamplingParams
from minipaged.sequence import Sequence, SequenceGroup


class OutputProcessor:
    """The step's requests as outputs, and the text they need."""

    def __init__(self, beam_search: BeamSearch) -> None:
        self.beam_search = beam_search

    def check_stop_strings(self, group: SequenceGroup, seq: Sequence) -> str | None:
        """Decode ``seq``'s new token where its text is needed before the end (stop
        strings, streaming), and return the stop string it completed, if any."""
        if not group.detokenizes_early:
            return None
        params = group.params
        new_text = seq.detokenizer.update(seq.output_token_ids)
        seq.output_text += new_text
        # vLLM: no stop string counts before min_tokens (stop tokens are masked).
        if seq.num_output_tokens >= params.min_tokens:
            return stop_string(seq, params.stop, len(new_text))
        return None

    def outputs(self, groups: list[SequenceGroup]) -> list[Output]:
        """The outputs of a step's ``groups`` (`Scheduler.update_from_output`'s): the
        requests that finished, and the news of those that stream."""
        outputs = []
        for group in groups:
            if group.is_finished:
                outputs.append(self._finish(group))
            elif group.streams:
                self._finish_texts(group)
                if output := self.request_output(group):
                    outputs.append(output)
        return outputs

    def _finish(self, group: SequenceGroup) -> Output:
        if group.embedding is not None:
            return EmbeddingRequestOutput(
                group.request_id, EmbeddingOutput(group.embedding), group.prompt_token_ids
            )
        if group.is_beam_search:
            return self.beam_search.output(group)
        self._finish_texts(group)
        return self.request_output(group)

    def _finish_texts(self, group: SequenceGroup) -> None:
        """Decode the rest of each finished sequence's text, once: without a stop token
        (vLLM), and nothing more after a stop string (its text is cut already)."""
        for seq in group.seqs:
            if seq.is_finished and not seq.text_done:
                seq.text_done = True
                if isinstance(seq.stop_reason, str) or seq.finish_reason == "abort":
                    continue
                tokens = seq.output_token_ids
                if seq.finish_reason == "stop":
                    tokens = tokens[:-1]
                seq.output_text += seq.detokenizer.update(tokens, final=True)

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

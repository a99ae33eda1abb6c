"""What `LLM.generate`, `LLM.beam_search` and `LLM.embed` return (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One completion of a request.

    ``logprobs`` is None unless the request asked for them; then one
    ``{token_id: logprob}`` per generated token (`minipaged.sample.sampler.SamplerOutput`).
    ``cumulative_logprob``, their sum, is None with them (vLLM V1: only a request that
    asks for logprobs pays for normalising the logits).
    ``finish_reason`` is ``"stop"`` (EOS, a stop token or string), ``"length"``
    (``max_tokens`` or ``max_model_len``), ``"abort"``, or None while running.
    ``stop_reason`` is the stop string or token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions so far, ``index`` order.

    ``prompt_logprobs`` is None unless the request asked for them
    (``SamplingParams.prompt_logprobs``); then one entry per prompt token: None for the
    first, which nothing precedes, then ``{token_id: logprob}`` with the prompt token
    first and the most likely tokens at its position after it, as vLLM returns them.
    A stream carries them in its first output only.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One finished beam: ``tokens`` holds prompt and generated ids; ``text`` the
    generated part (without a final EOS)."""

    tokens: list[int]
    text: str
    cum_logprob: float


@dataclass
class BeamSearchOutput:
    """A beam search request's best ``beam_width`` sequences, best first."""

    request_id: str
    sequences: list[BeamSearchSequence]
    finished: bool = True


@dataclass
class EmbeddingOutput:
    """A prompt's embedding (vLLM's): its pooled hidden state, cut to the request's
    ``dimensions`` and normalized as it asked (`minipaged.models.pooler`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """A pooling request's one output, when its prompt is done (vLLM's)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


# What one engine step hands back per request.
Output = RequestOutput | BeamSearchOutput | EmbeddingRequestOutput

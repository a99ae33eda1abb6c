"""Requests and their sequences, as the scheduler and the engine track them (paper §4.4, §4.5).

A *request* (``SequenceGroup``) is one prompt and what it asked for.  It holds one or more
*sequences*: one for plain sampling; ``n`` for parallel sampling once the prompt has run
(the children are forks of the first, sharing its blocks copy-on-write); up to
``beam_width`` live beams for beam search.  The group is the unit of scheduling and of
preemption: its sequences share blocks, so they run, are swapped and are recomputed
together (§4.5, "all-or-nothing").

A sequence's tokens are its prompt followed by what it generated.  ``num_computed_tokens``
counts the leading tokens whose keys and values are in the KV cache; the rest are what the
next step must run: the whole prompt (prefill), a chunk of it (chunked prefill), all
tokens again after a recompute preemption, or the last sampled token (decode).

Standard library only: the scheduler, which uses these, is torch-free.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

from minipaged.core.memory.prefix_cache import MultiModalKey
from minipaged.lora_request import LoRARequest
from minipaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute (no blocks)
    RUNNING = "running"  # blocks on the GPU pool
    SWAPPED = "swapped"  # preempted by swap: blocks on the CPU pool
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One token stream: a prompt and one completion (or one beam)."""

    seq_id: str
    token_ids: list[int]
    prompt_len: int
    index: int = 0  # which completion of the request this is (CompletionOutput.index)
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: Any = None  # its own torch.Generator when the request has a seed
    # Its text so far, decoded a few tokens at a time (minipaged.engine.detokenizer), and how
    # much of it and of its tokens a DELTA output has already reported.
    output_text: str = ""
    text_done: bool = False  # its text decoded to the end (once it finished)
    detokenizer: Any = None
    num_reported_tokens: int = 0
    num_reported_chars: int = 0
    # Beam search: this beam's best next (token, logprob) pairs, until the group ranks them.
    beam_candidates: list[tuple[int, float]] | None = None
    # Speculative decoding: a draft's guesses at the tokens after its last one, for the
    # next step to verify (`minipaged.spec_decode`); never part of ``token_ids``.
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: its grammar's matcher, advanced by each token it appends
    # (`minipaged.structured_output.backend_guidance.GuidanceGrammar`); None: unconstrained.
    grammar: Any = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next steps must run before this sequence can sample again."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int, logprob: float | None) -> None:
        """``logprob`` None: the request asked for no logprobs (its cumulative logprob
        is not reported, `output_processor.completion`)."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
        # A beam's candidates were for the token it just got; a sampled sequence has none.
        self.beam_candidates = None

    def fork(self, seq_id: str, index: int) -> Sequence:
        """A copy that goes on from here as completion ``index``: the same tokens, KV
        progress, logprobs, text and grammar state so far (its blocks are shared by the
        KV cache manager, §4.4; its random stream is its own, set by whoever forks it)."""
        return Sequence(
            seq_id,
            list(self.token_ids),
            self.prompt_len,
            index=index,
            num_computed_tokens=self.num_computed_tokens,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            output_text=self.output_text,
            detokenizer=copy.copy(self.detokenizer),
            grammar=None if self.grammar is None else self.grammar.fork(),
        )


@dataclass(eq=False)
class SequenceGroup:
    """One request: its prompt, its parameters and its live sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    arrival: int  # arrival order; preemption takes the largest first (§4.5)
    seqs: list[Sequence] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Beam search: beams that ended with EOS, kept as (tokens, cum_logprob) (no blocks).
    completed_beams: list[tuple[list[int], float]] = field(default_factory=list)
    next_seq_index: int = 1
    lora_request: LoRARequest | None = None  # its adapter; None: the base model
    # With SamplingParams.prompt_logprobs: one entry per prompt token computed so far
    # ({token_id: logprob}, the prompt token first), None for the first token.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # A pooling request (PoolingParams): how the engine pools (PoolerConfig.pooling_type),
    # the pooled state of its first ``num_pooled`` prompt positions so far (a tensor the
    # model runner keeps, `minipaged.models.pooler`), and its embedding once the prompt is done.
    pooling_type: str | None = None
    pooled: Any = None
    num_pooled: int = 0
    embedding: list[float] | None = None
    # A multimodal request's images (`minipaged.multimodal.inputs.MultiModalFeatureSpec`),
    # in prompt order: each one's pixels, hash and placeholder range.
    mm_features: list[Any] = field(default_factory=list)

    # Set once: every step asks them of every running request.  Whether it wants
    # outputs before it finishes (``output_kind`` other than ``FINAL_ONLY``; beam search
    # never does), and whether its text is needed before then: to stream, or to look
    # for stop strings in (`OutputProcessor.check_stop_strings`).
    is_beam_search: bool = field(init=False)
    streams: bool = field(init=False)
    detokenizes_early: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_beam_search = isinstance(self.params, BeamSearchParams)
        kind = getattr(self.params, "output_kind", RequestOutputKind.FINAL_ONLY)
        self.streams = not self.is_beam_search and kind is not RequestOutputKind.FINAL_ONLY
        self.detokenizes_early = self.streams or bool(getattr(self.params, "stop", None))
        if getattr(self.params, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = [None]

    @property
    def reads_prefix_cache(self) -> bool:
        """A request that wants its prompt's logprobs computes every prompt token, as
        vLLM's does: a block served from the prefix cache would have no logits.  So does
        a pooling request that pools every token (MEAN) or the first (CLS): a cached
        block has no hidden states; LAST needs only the last token, which always runs."""
        return self.prompt_logprobs is None and self.pooling_type in (None, "LAST")

    def prompt_logprob_positions(self, start: int, num_new_tokens: int) -> range:
        """The positions, of tokens ``[start, start + num_new_tokens)`` run this step,
        whose logits give a prompt token's logprob not collected yet: position ``p``
        scores prompt token ``p + 1``.  Empty for most steps, and for every step after a
        recompute preemption re-runs a prompt whose entries are all in."""
        if self.prompt_logprobs is None:
            return range(0)
        first = max(start, len(self.prompt_logprobs) - 1)
        return range(first, min(start + num_new_tokens, len(self.prompt_token_ids) - 1))

    @property
    def width(self) -> int:
        """The most sequences this request will run at once: seats it needs in a batch."""
        return self.params.beam_width if self.is_beam_search else self.params.n

    @property
    def num_seats(self) -> int:
        """Sequences it may run at once from now on: its width until the prompt has
        forked into them, then the ones still unfinished (beams stay at the width)."""
        if self.is_beam_search or len(self.seqs) < self.width:
            return self.width
        return len(self.unfinished_seqs)

    # Both run for every request every step: they read finish_reason rather than call
    # Sequence.is_finished; a list comprehension, or a plain loop that stops at the
    # first unfinished sequence, takes half the time of all() over a generator.
    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.finish_reason is None]

    @property
    def is_finished(self) -> bool:
        for s in self.seqs:
            if s.finish_reason is None:
                return False
        return True

    def new_seq_id(self) -> str:
        seq_id = f"{self.request_id}.{self.next_seq_index}"
        self.next_seq_index += 1
        return seq_id

    @property
    def lora_id(self) -> int | None:
        """Its adapter's id (its slot's owner), or None."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def cache_key(self) -> object:
        """The prefix cache's extra key (vLLM's ``extra_keys``): what, beside the
        tokens, decides its KV: its adapter, for every block, and each image's hash
        for the blocks its placeholder overlaps, since every image's placeholder
        tokens are the same ids whatever the image (`MultiModalKey`)."""
        if not self.mm_features:
            return self.lora_id
        return mm_cache_key(self.lora_id, self.mm_features)


def mm_cache_key(lora_id: int | None, mm_features: list) -> MultiModalKey:
    """The prefix cache's extra key of a request with images (`MultiModalFeatureSpec`s,
    in prompt order): its adapter's id, and each image's hash and placeholder range."""
    return MultiModalKey(
        lora_id,
        tuple((f.identifier, f.mm_position.offset, f.mm_position.length) for f in mm_features),
    )

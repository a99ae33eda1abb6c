"""The input processor: a request checked, then made the sequence group the scheduler
queues (paper §4.4, §4.5).

`LLMEngine.add_request` hands it a prompt's token ids and the request's parameters.  A
request that is malformed or could never run is refused with ``ValueError`` before
anything changes: an unknown kind of parameters, a request id already running, an empty
prompt, token ids outside the vocabulary, a prompt longer than ``max_model_len``, more
sequences or blocks than the scheduler could ever give it (`Scheduler.check_fits`), or a
structured output whose grammar does not compile against the tokenizer.

A request starts as one sequence, its prompt: with its own random generator if it has a
seed, a detokenizer unless it is a beam search (whose text is decoded once, at the end),
room for logprobs if it asked for them, and a grammar's matcher for a structured output.
It branches later, by forks (§4.4).
"""

from __future__ import annotations

import itertools

import torch

from minipaged.core.sched.scheduler import Scheduler
from minipaged.engine.detokenizer import IncrementalDetokenizer
from minipaged.models.pooler import Pooler
from minipaged.pooling_params import PoolingParams
from minipaged.sample.sampler import seq_generator
from minipaged.sampling_params import BeamSearchParams, SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.structured_output import StructuredOutputManager

Params = SamplingParams | BeamSearchParams | PoolingParams


class InputProcessor:
    """Checks requests against the model and the scheduler (whose requests a new id must
    not be one of), and builds their groups."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        scheduler: Scheduler,
        device: torch.device,
        speculative: bool = False,
        pipelined: bool = False,
        pooler: Pooler | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        # A pooling runner's pooler (runner="pooling"): its requests are PoolingParams'
        # and only theirs.
        self.pooler = pooler
        self.speculative = speculative  # speculative decoding on: no beam search
        # Pipeline stages: the prompt's hidden states stay on the last stage, the
        # request on the driver, so no prompt logprobs.
        self.pipelined = pipelined
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.device = device
        self.structured_output = structured_output  # compiles structured outputs' grammars
        self.image_token_id: int | None = None  # a vision model's placeholder token
        self._arrivals = itertools.count()

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Params,
        prompt: str | None = None,
        mm_features: list | None = None,
    ) -> SequenceGroup:
        """The checked request as a group of one sequence, numbered in arrival order."""
        self.check(request_id, prompt_token_ids, params, mm_features)
        group = SequenceGroup(
            request_id, prompt, list(prompt_token_ids), params, next(self._arrivals)
        )
        group.mm_features = list(mm_features or ())
        wants_logprobs = getattr(params, "logprobs", None) is not None
        pooling = isinstance(params, PoolingParams)
        if pooling:
            group.pooling_type = self.pooler.config.pooling_type
        detokenizer = (
            None if group.is_beam_search or pooling else IncrementalDetokenizer(self.tokenizer)
        )
        group.seqs.append(
            Sequence(
                f"{request_id}.0",
                list(prompt_token_ids),
                len(prompt_token_ids),
                logprobs=[] if wants_logprobs else None,
                generator=seq_generator(params, 0, self.device),
                detokenizer=detokenizer,
                grammar=self._grammar(params),
            )
        )
        return group

    def _grammar(self, params: Params):
        """A structured output's matcher, its grammar compiled (and cached) on first use."""
        spec = getattr(params, "structured_outputs", None)
        return None if spec is None else self.structured_output.grammar_init(spec)

    def check(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Params,
        mm_features: list | None = None,
    ) -> None:
        if not isinstance(params, (SamplingParams, BeamSearchParams, PoolingParams)):
            raise ValueError(
                f"params must be SamplingParams, BeamSearchParams or PoolingParams, "
                f"got {type(params).__name__}"
            )
        self._check_runner(params)
        if self.speculative and isinstance(params, BeamSearchParams):
            raise ValueError(
                "beam search cannot run with speculative_config (neither can it in vLLM); "
                "start an LLM without speculative_config for it"
            )
        if self.pipelined and getattr(params, "prompt_logprobs", None) is not None:
            raise ValueError(
                "prompt_logprobs cannot run with pipeline_parallel_size > 1 in minipaged"
            )
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        bad = next(
            (t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size),
            None,
        )
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids must be ints in [0, {self.vocab_size}), got {bad!r}"
            )
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        self.scheduler.check_fits(len(prompt_token_ids), params)
        if mm_features or self.image_token_id is not None:
            self._check_mm(prompt_token_ids, params, mm_features or [])
        self._grammar(params)  # compiles against the tokenizer: ValueError if it cannot

    def _check_mm(self, prompt_token_ids: list[int], params: Params, mm_features: list) -> None:
        """Images only for a vision model and not with beam search, each placeholder
        range inside the prompt, and all of them at once within the encoder cache."""
        if self.scheduler.encoder_cache is None:
            raise ValueError("mm_features: this is a text-only model, which takes no images")
        placeholders = sum(t == self.image_token_id for t in prompt_token_ids)
        if placeholders != sum(f.mm_position.length for f in mm_features):
            raise ValueError(
                f"prompt has {placeholders} image placeholder tokens (id "
                f"{self.image_token_id}) for {len(mm_features)} images; send images with "
                "multi_modal_data, their placeholders in the prompt text"
            )
        if not mm_features:
            return
        if isinstance(params, BeamSearchParams):
            raise ValueError("BeamSearchParams: minipaged runs no beam search with images")
        for f in mm_features:
            end = f.mm_position.offset + f.mm_position.length
            if f.mm_position.offset < 0 or end > len(prompt_token_ids):
                raise ValueError(
                    f"mm_features: placeholder {f.mm_position} lies outside the prompt's "
                    f"{len(prompt_token_ids)} tokens"
                )
        self.scheduler.encoder_cache.check_fits(mm_features)

    def _check_runner(self, params: Params) -> None:
        """A pooling runner makes embeddings only, a generating one generates only (as
        in vLLM, where one model runner does one or the other)."""
        pooling = isinstance(params, PoolingParams)
        if self.pooler is None and pooling:
            raise ValueError(
                "PoolingParams: this model runs with runner='generate', which generates "
                "text and makes no embeddings; start it with runner='pooling' to embed"
            )
        if self.pooler is not None and not pooling:
            raise ValueError(
                f"{type(params).__name__}: this model runs with runner='pooling', which "
                "makes embeddings (LLM.embed, /v1/embeddings) and generates nothing"
            )
        if pooling:
            self.pooler.check(params)

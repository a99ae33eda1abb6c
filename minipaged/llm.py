"""``LLM``: offline batched generation, with vLLM's names.

    from minipaged import LLM, SamplingParams
    llm = LLM(model="smollm2")  # or a checkpoint directory, a .gguf file, a hub id
    outputs = llm.generate(["Hello", "The capital of"], SamplingParams(max_tokens=8))
    replies = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=8))
    embedder = LLM(model="smollm2", runner="pooling")  # pooler_config={"pooling_type": "MEAN"}
    vectors = [o.outputs.embedding for o in embedder.embed(["Hello", "The capital of"])]

`LLM` tokenizes prompts, checks every request before queueing any (so a bad one changes
nothing), hands them to an `LLMEngine` and steps it until they are all done, with a
progress bar.  Everything else happens in the engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence

from tqdm.auto import tqdm

from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine
from minipaged.lora_request import LoRARequest
from minipaged.multimodal.inputs import split_images
from minipaged.outputs import BeamSearchOutput, EmbeddingRequestOutput, Output, RequestOutput
from minipaged.pooling_params import PoolingParams
from minipaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Prompt = str | dict
Conversation = list[dict]


class LLM:
    """A model served by minipaged's engine.

    ``model``: a checkpoint directory, a ``.gguf`` file, ``"smollm2"`` or a Hugging Face
    hub id.  Keyword arguments: `EngineConfig`'s, vLLM's names; any other keyword vLLM
    takes (``quantization``, ``load_format``, ``cpu_offload_gb``...) is a
    ``ValueError`` that lists what minipaged supports.
    """

    def __init__(self, model: str | os.PathLike, **kwargs) -> None:
        supported = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
        if unknown := [name for name in kwargs if name not in supported]:
            raise ValueError(
                f"{unknown[0]}={kwargs[unknown[0]]!r} is not supported by "
                f"minipaged; LLM(model, ...) takes {', '.join(supported)}"
            )
        self.engine = LLMEngine(EngineConfig(model=os.fspath(model), **kwargs))
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of ``{"role": ..., "content": ...}``) or to
        each of a list of them, as vLLM's ``LLM.chat``: each is rendered with the
        tokenizer's chat template (or ``chat_template``), then generated from.  A
        vision model's messages may hold OpenAI's content parts, ``image_url`` ones
        among them (`minipaged.multimodal.inputs.split_images`)."""
        conversations = _conversations(messages)
        tokenizer = self.engine.tokenizer
        if chat_template is None and tokenizer.chat_template is None:
            raise ValueError("chat_template must be given: the tokenizer has none")
        prompts = []
        for conversation in conversations:
            conversation, images = split_images(conversation, self.engine.image_placeholder)
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            # The template writes the special tokens (BOS) itself.
            if images:
                prompts.append(
                    {
                        "prompt": text,
                        "multi_modal_data": {"image": images},
                        "add_special_tokens": False,
                    }
                )
                continue
            prompts.append(
                {
                    "prompt": text,
                    "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
                }
            )
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in prompt order.

        ``prompts``: a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}``, or a
        list of those; for a vision model (LLaVA), ``{"prompt": "... <image> ...",
        "multi_modal_data": {"image": image or [images]}}`` with PIL images, data URLs
        or local paths (under ``allowed_local_media_path``), one placeholder each.
        ``sampling_params``: one for all prompts, or one per prompt (default
        ``SamplingParams()``).  ``lora_request``: the LoRA adapter of every
        prompt, or one per prompt (None in the list: the base model); needs
        ``enable_lora=True``.
        """
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = _per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        if kind := next(
            (p.output_kind for p in params if p.output_kind is not RequestOutputKind.FINAL_ONLY),
            None,
        ):
            raise ValueError(
                f"output_kind must be FINAL_ONLY for LLM.generate, which returns "
                f"finished requests; got {kind} (stream with LLMEngine.step)"
            )
        return self._run(prompts, params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
    ) -> list[BeamSearchOutput]:
        """The ``beam_width`` most likely continuations of every prompt (§4.4): beams are
        forked sequences sharing their common prefix's blocks."""
        prompts = _as_list(prompts)
        return self._run(
            prompts,
            _per_prompt(params, len(prompts), BeamSearchParams, "params"),
            use_tqdm,
            lora_request,
        )

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order (vLLM's ``LLM.embed``); needs
        ``runner="pooling"``.  Each prompt runs once, as a prefill (chunked if long),
        its hidden states pooled as ``pooler_config`` says (`minipaged.models.pooler`);
        ``pooling_params``: one for all prompts or one per prompt (``dimensions``,
        ``normalize``)."""
        prompts = _as_list(prompts)
        params = _per_prompt(
            PoolingParams() if pooling_params is None else pooling_params,
            len(prompts),
            PoolingParams,
            "pooling_params",
        )
        return self._run(prompts, params, use_tqdm)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (``tensor_parallel_size`` > 1) now,
        rather than when this object is garbage collected; it cannot generate after."""
        self.engine.shutdown()

    def stats(self) -> dict[str, float]:
        """The engine's memory and scheduling counters (`LLMEngine.stats`)."""
        return self.engine.stats()

    def _run(
        self, prompts: list[Prompt], params: list, use_tqdm: bool, lora_request=None
    ) -> list[Output]:
        loras = _loras(lora_request, len(prompts))
        requests = [
            (str(next(self._request_ids)), *self._tokenize(p), sp, lora)
            for p, sp, lora in zip(prompts, params, loras)
        ]
        for request_id, token_ids, _, mm, sp, lora in requests:  # all checked before any is queued
            self.engine.check_request(request_id, token_ids, sp, lora, mm)
        for request_id, token_ids, text, mm, sp, lora in requests:
            self.engine.add_request(
                request_id, token_ids, sp, prompt=text, lora_request=lora, mm_features=mm
            )
        ours = {request_id for request_id, *_ in requests}
        done: dict[str, Output] = {}
        try:
            with tqdm(
                total=len(requests),
                desc="Processed prompts",
                disable=not use_tqdm,
                dynamic_ncols=True,
            ) as bar:
                while len(done) < len(requests):
                    for output in self.engine.step():
                        if output.request_id in ours:
                            done[output.request_id] = output
                            bar.update(1)
        finally:  # an interrupted run leaves no request (and no block) behind
            for request_id, *_ in requests:
                if request_id not in done:
                    self.engine.abort_request(request_id)
        return [done[request_id] for request_id, *_ in requests]

    def _tokenize(self, prompt: Prompt) -> tuple[list[int], str | None, list]:
        """A prompt's token ids, its text, and its images' ``mm_features``."""
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            return self._process_multimodal(prompt)
        if isinstance(prompt, str):
            if not prompt:  # the tokenizer would make it a lone BOS
                raise ValueError("prompt must not be empty, got ''")
            return self.engine.tokenizer.encode(prompt), prompt, []
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"]), prompt.get("prompt"), []
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self._tokenize(prompt["prompt"])
        raise ValueError(
            f"prompt must be a str, {{'prompt': str}} or "
            f"{{'prompt_token_ids': [...]}}, got {prompt!r:.80}"
        )

    def _process_multimodal(self, prompt: dict) -> tuple[list[int], str, list]:
        """``{"prompt": str, "multi_modal_data": {"image": image or [images]}}``: the
        placeholders expanded by the model's processor (`LLMEngine.process_multimodal`)."""
        data, text = prompt["multi_modal_data"], prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError(
                "multi_modal_data needs a 'prompt' string holding the image placeholders"
            )
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(
                f"multi_modal_data must be {{'image': image or [images]}}, got {data!r:.80}"
            )
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        token_ids, features = self.engine.process_multimodal(
            text, images, prompt.get("add_special_tokens", True)
        )
        return token_ids, text, features


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    return prompts


def _conversations(messages) -> list[Conversation]:
    """``messages`` as a list of conversations, each checked to be a non-empty list of
    ``{"role": str, "content": ...}``."""
    if (
        isinstance(messages, (list, tuple))
        and messages
        and all(isinstance(m, dict) for m in messages)
    ):
        messages = [messages]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"messages must be a conversation (a list of dicts) or a non-empty "
            f"list of them, got {messages!r:.80}"
        )
    for conversation in messages:
        if (
            not isinstance(conversation, (list, tuple))
            or not conversation
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                for m in conversation
            )
        ):
            raise ValueError(
                f"messages must hold conversations of {{'role': str, "
                f"'content': ...}} dicts, got {conversation!r:.80}"
            )
    return [list(conversation) for conversation in messages]


def _loras(lora_request, count: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of ``count``."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request]
    if len(loras) != count or not all(x is None or isinstance(x, LoRARequest) for x in loras):
        raise ValueError(
            f"lora_request must be one LoRARequest or a list of {count} (one per "
            f"prompt, None for the base model), got {lora_request!r:.80}"
        )
    return loras


def _per_prompt(params, count: int, cls, name: str) -> list:
    if isinstance(params, cls):
        return [params] * count
    params = list(params) if isinstance(params, (list, tuple)) else [params]
    if len(params) != count or not all(isinstance(p, cls) for p in params):
        raise ValueError(
            f"{name} must be one {cls.__name__} or a list of {count} "
            f"(one per prompt), got {params!r:.80}"
        )
    return params

"""The request bodies of OpenAI's API, as pydantic models, and what they ask of the engine.

Pydantic checks the JSON's shape (a field missing, a string where a number goes); the
values are checked where they always are, by `SamplingParams`, so the server and
``LLM.generate`` refuse the same things with the same messages.  Fields beyond OpenAI's
are vLLM's (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs``, ``structured_outputs`` and its older
``guided_*`` names), so a client written for vLLM works unchanged.

Nothing is silently ignored: every field of OpenAI's and vLLM's requests is either
implemented, or in `UNSUPPORTED` with the values that ask for nothing (vLLM's
defaults), and asking for anything else is a 400 naming the field.  Only ``user``
(an end-user id for the provider's logs) and fields neither API knows are ignored,
as both do.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict

from minipaged.pooling_params import PoolingParams
from minipaged.sampling_params import (
    STRUCTURED_OUTPUT_KINDS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

# Fields of OpenAI's and vLLM's requests that minipaged does not implement, and the
# values that ask for nothing.  Both endpoints:
UNSUPPORTED = {
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logprob_token_ids": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "priority": (None, 0),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "logits_processors": (None,),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None,),
    "watermarking": (None, False),
    "stream_interval": (None, 1),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "prediction": (None,),
}
COMPLETION_UNSUPPORTED = {
    "suffix": (None, ""),
    "prompt_embeds": (None,),
}
CHAT_UNSUPPORTED = {
    "functions": (None, []),  # OpenAI's older names for tools and tool_choice
    "function_call": (None, "none", "auto"),
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


# vLLM's older names for structured_outputs' fields, still accepted (as vLLM does).
GUIDED_FIELDS = {f"guided_{kind}": kind for kind in ("json", "regex", "choice", "grammar")}


class FieldError(ValueError):
    """A bad value of request field ``param``: a 400 naming it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs(
    response_format: dict | None, extra: dict, tool_schema: dict | None = None
) -> StructuredOutputsParams | None:
    """The request's structured output, from whichever one of OpenAI's
    ``response_format`` (``json_schema``, ``json_object``; ``text`` asks for nothing),
    vLLM's ``structured_outputs``, its older ``guided_*`` fields or a forced
    ``tool_choice`` (``tool_schema``) sets it; `FieldError` naming the field if it is
    malformed, or if two set one."""
    specs = {} if tool_schema is None else {"tool_choice": {"json": tool_schema}}
    if response_format not in (None, {"type": "text"}):
        specs["response_format"] = _response_format(response_format)
    if extra.get("structured_outputs") is not None:
        value = extra["structured_outputs"]
        if not isinstance(value, dict):
            raise FieldError(
                "structured_outputs", f"structured_outputs must be an object, got {value!r}"
            )
        specs["structured_outputs"] = value
    for name, kind in GUIDED_FIELDS.items():
        if extra.get(name) is not None:
            specs[name] = {kind: extra[name]}
    if not specs:
        return None
    if len(specs) > 1:
        raise FieldError(
            next(iter(specs)),
            f"set only one of {', '.join(specs)}: each asks for a structured output",
        )
    ((param, spec),) = specs.items()
    unknown = set(spec) - set(STRUCTURED_OUTPUT_KINDS)
    if unknown:
        raise FieldError(param, f"{param} has unsupported fields {sorted(unknown)}")
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as error:
        raise FieldError(param, f"{param}: {error}") from None


def _response_format(value) -> dict:
    if not isinstance(value, dict) or value.get("type") not in ("json_schema", "json_object"):
        raise FieldError(
            "response_format",
            f"response_format.type must be 'text', 'json_schema' or 'json_object', got {value!r}",
        )
    if value["type"] == "json_object":
        return {"json_object": True}
    json_schema = value.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise FieldError(
            "response_format",
            "response_format.json_schema must be an object with a 'schema' object, "
            f"got {json_schema!r}",
        )
    return {"json": json_schema["schema"]}


def unsupported_field(body: BaseModel, table: dict) -> str | None:
    """The first field of ``table`` that ``body`` sets to a value other than those
    ``table`` lists as asking for nothing."""
    extra = body.model_extra or {}
    return next((name for name, off in table.items() if extra.get(name) not in off), None)


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``, as vLLM's."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``, as vLLM's (``lora_int_id`` is accepted, unused:
    the name says which)."""

    lora_name: str
    lora_int_id: int | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # continuous_usage_stats: not implemented

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the one model served (as vLLM allows)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    response_format: dict | None = None

    # The options this endpoint has beyond UNSUPPORTED's, minipaged does not implement.
    _unsupported: dict = {}

    def unsupported(self) -> str | None:
        """The first option asked for that minipaged does not implement."""
        return unsupported_field(self, {**UNSUPPORTED, **self._unsupported})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's parameters (raises ``ValueError`` naming a bad value).  A stream
        wants each step's news (DELTA), an answer only the end (FINAL_ONLY)."""
        optional = {
            name: value
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "min_tokens",
                "best_of",
            )
            if (value := getattr(self, name)) is not None
        }
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs(
                self.response_format, self.model_extra or {}, self.tool_schema()
            ),
            **optional,
        )

    def tool_schema(self) -> dict | None:
        """The JSON schema a forced ``tool_choice`` holds the completion to (chat's)."""
        return None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of
    token ids or a list of those."""

    _unsupported = COMPLETION_UNSUPPORTED

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # null: up to the context length
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the BOS token, if any

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """vLLM's rule: ``prompt_logprobs`` if given, else, to echo the prompt with
        logprobs, as many alternatives per prompt token as ``logprobs`` asks."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; one size here


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: ignored

    role: str
    content: str | list[TextPart | ImageURLPart] | None = None

    tool_calls: list[dict] | None = None  # an assistant's, sent back
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            isinstance(part, ImageURLPart) for part in self.content
        )

    def as_template_input(self) -> dict:
        """The message as chat templates read it: an assistant's calls with their
        arguments as objects (as vLLM passes them), a tool result with its call's id."""
        content = self.content
        if isinstance(content, list) and self.has_images:  # for `split_images`
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def template_tool_call(call: dict) -> dict:
    """An assistant's tool call (OpenAI's shape) with its arguments parsed; a
    `FieldError` naming ``messages`` if they are not a JSON object."""
    function = call.get("function") if isinstance(call, dict) else None
    try:
        arguments = json.loads(function["arguments"])
        name = function["name"]
    except (TypeError, KeyError, json.JSONDecodeError):
        arguments = name = None
    if not isinstance(arguments, dict) or not isinstance(name, str):
        raise FieldError(
            "messages",
            "an assistant message's tool_calls need function.name and "
            f"function.arguments as a JSON object string, got {call!r}",
        )
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template.
    Without ``max_tokens``, a reply may run to the end of the model's context."""

    _unsupported = CHAT_UNSUPPORTED

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False  # vLLM's: the chat template has them already
    tools: list | None = None
    tool_choice: str | dict | None = None  # OpenAI's default: "auto" with tools

    @property
    def effective_tool_choice(self) -> str | dict:
        """``tool_choice`` as given, or OpenAI's default: "auto" with tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_schema(self) -> dict | None:
        from minipaged.server.tools import check_tools, forced_schema  # it imports FieldError

        check_tools(self.tools, self.tool_choice)
        return forced_schema(self.tools or [], self.effective_tool_choice)


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` of a text (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` of messages, through the chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def unsupported(self) -> str | None:
        """The first option asked for that minipaged does not implement."""
        names = ("continue_final_message", "chat_template", "chat_template_kwargs")
        table = {name: CHAT_UNSUPPORTED[name] for name in names}
        return unsupported_field(self, {**table, "tools": (None, [])})


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


# vLLM's fields of an embeddings request that minipaged does not implement.
EMBEDDING_UNSUPPORTED = {
    "truncate_prompt_tokens": (None,),
    "priority": (None, 0),
    "request_id": (None,),
    "mm_processor_kwargs": (None,),
    "cache_salt": (None,),
    "use_activation": (None,),
    "embed_dtype": (None, "float32"),
    "endianness": (None, "native", "little"),
}


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``, OpenAI's (and vLLM's ``add_special_tokens`` and
    ``normalize``): ``input`` is a string, a list of them, a token array or a list of
    token arrays; ``encoding_format`` ``"float"`` (lists of numbers) or ``"base64"``
    (little-endian float32 bytes, as OpenAI's)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None

    def unsupported(self) -> str | None:
        return unsupported_field(self, {**UNSUPPORTED, **EMBEDDING_UNSUPPORTED})

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


class ErrorInfo(BaseModel):
    message: str
    type: str  # invalid_request_error (4xx) or server_error (5xx)
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body, as OpenAI sends it."""

    error: ErrorInfo

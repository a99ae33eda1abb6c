"""The request bodies of OpenAI's API, as pydantic models, and what they ask of the engine.

Pydantic checks the JSON's shape (a field missing, a string where a number goes); the
values are checked where they always are, by `SamplingParams`, so the server and
``LLM.generate`` refuse the same things with the same messages.  Fields beyond OpenAI's
are vLLM's (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``), so a client written
for vLLM works unchanged.  Unknown fields are ignored, as OpenAI and vLLM do, except the
sampling options minipaged does not implement: asking for one is an error, not a
silent no-op.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from minipaged.sampling_params import RequestOutputKind, SamplingParams

# Options minipaged does not implement, and the values that ask for nothing.
UNSUPPORTED = {
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


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

    def unsupported(self) -> str | None:
        """The first option asked for that minipaged does not implement."""
        extra = self.model_extra or {}
        return next((name for name, off in UNSUPPORTED.items() if extra.get(name) not in off), None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            **optional,
        )


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of
    token ids or a list of those."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # null: up to the context length
    echo: bool = False
    logprobs: int | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: ignored

    role: str
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template.
    Without ``max_tokens``, a reply may run to the end of the model's context."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str  # invalid_request_error (4xx) or server_error (5xx)
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body, as OpenAI sends it."""

    error: ErrorInfo

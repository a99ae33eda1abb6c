"""An OpenAI-compatible HTTP server over the engine (FastAPI): ``minipaged serve DIR``.

    GET  /v1/models             the model served, and its LoRA adapters
    POST /v1/completions        prompt(s) -> text; streamed as server-sent events if asked
    POST /v1/chat/completions   messages -> the chat template -> a reply
    POST /v1/embeddings         input(s) -> one embedding each (--runner pooling only)
    POST /tokenize              text or messages -> token ids (vLLM's)
    POST /detokenize            token ids -> text (vLLM's)
    GET  /tokenizer_info        the tokenizer's configuration (vLLM's)
    GET  /health                200 while the engine runs
    GET  /metrics               Prometheus text: queues, KV blocks, preemptions, tokens
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   adapters by name (--enable-lora)

Every prompt of a request becomes one engine request; `AsyncEngine` runs them in the
same batch as everyone else's; a request whose ``model`` names a LoRA adapter runs
with it (`minipaged.server.lora`).  A stream sends each step's new text as it is made
(``data: {...}`` chunks, then ``data: [DONE]``); a client that hangs up mid-stream
aborts its requests, which frees their blocks.  Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with a 4xx status for anything the
client got wrong, and the server goes on serving.

No one request can stop, stall or leak from the server (docs/serving-safely.md): the
host, the API key and the body's size and pace are checked before the body is read
(`minipaged.server.guard`); prompts, ``n`` and logprobs are capped (`ServerLimits`);
a prompt's length is checked in characters before it is tokenized, on a thread of its
own; a request that fails inside the engine fails alone; a client that hangs up aborts
its request, streamed or not; and shutdown refuses new work, gives running requests a
grace period, then ends the rest with an error the client can read.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager, suppress
from pathlib import Path

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine
from minipaged.engine.protocol import EngineClient
from minipaged.lora_request import LoRARequest
from minipaged.multimodal.inputs import split_images
from minipaged.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from minipaged.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    ServerClosingError,
)
from minipaged.server.data_parallel import DataParallelEngine, check_data_parallel_size
from minipaged.server.guard import (
    GuardConfig,
    RequestGuard,
    default_allowed_hosts,
    h11_with_head_timeout,
)
from minipaged.server.limits import ServerLimits
from minipaged.server.lora import ServedAdapters, UnknownAdapterError
from minipaged.server.metrics import make_registry
from minipaged.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    SamplingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from minipaged.server.tools import TOOL_CALL_PARSERS, ChatTools

logger = logging.getLogger("minipaged.server")

# The errors the /v1 routes document in the OpenAPI schema, all in OpenAI's shape.
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (400, "Invalid request"),
        (401, "Wrong API key"),
        (404, "Unknown model"),
        (408, "Body too slow"),
        (413, "Body too large"),
        (500, "Failed in the engine"),
        (503, "Shutting down"),
    ]
}


class APIError(Exception):
    """An error for the client, in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(error: APIError) -> Response:
    # ASCII-escaped: a message may quote what the client sent, even half a surrogate pair.
    return Response(json.dumps(error_body(error)), error.status, media_type="application/json")


def server_error(error: Exception) -> APIError:
    """An engine-side failure as the client sees it: 503 while shutting down, else 500."""
    return APIError(503 if isinstance(error, ServerClosingError) else 500, str(error))


def error_body(error: APIError) -> dict:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {
        "error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}
    }


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Usage:
    """Token counts for ``usage``: prompts once, every completion's tokens."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompt_tokens = sum(map(len, prompts))
        self.completion_tokens = 0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class OpenAIServing:
    """The endpoints' logic: requests in, engine requests out, responses back."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        limits: ServerLimits | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
    ) -> None:
        self.engine, self.model_name = engine, model_name
        self.limits = limits or ServerLimits()
        check_tool_flags(enable_auto_tool_choice, tool_call_parser)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tokenizer = engine.facts.tokenizer
        self.max_model_len = engine.facts.max_model_len
        # No token is longer than the vocabulary's longest entry (a byte-level entry has
        # a character per byte), so a longer prompt cannot fit; checked before tokenizing.
        longest = max(map(len, self.tokenizer.get_vocab()))
        self.max_prompt_chars = self.max_model_len * longest
        # One thread: tokenizing never blocks the event loop, and never runs twice at once.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="minipaged-tokenize")
        self.adapters = ServedAdapters(engine)
        self.runner = engine.facts.config.runner  # "generate" or "pooling"
        # vLLM's older per-request ``guided_decoding_backend`` may only name this one.
        self.structured_outputs_backend = (
            engine.facts.config.structured_outputs_config.resolved_backend
        )

    def models(self) -> dict:
        created = int(time.time())
        base = {
            "id": self.model_name,
            "object": "model",
            "created": created,
            "owned_by": "minipaged",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [base, *self.adapters.cards(self.model_name, created)]}

    # -- LoRA adapters (vLLM's endpoints) ---------------------------------------------
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """Read the adapter (off the event loop) and serve it as ``lora_name``."""
        await self.adapters.load(body.lora_name, body.lora_path, self.model_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        lora_request = self.adapters.unload(body.lora_name)
        self.engine.remove_lora(lora_request.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # -- completions ------------------------------------------------------------------
    async def completions(self, body: CompletionRequest) -> Response:
        lora_request = self._check(body)
        self._check_logprobs(body.logprobs, "logprobs")
        prompt_logprobs = body.wanted_prompt_logprobs
        prompts = await self._completion_prompts(body.prompt, body.add_special_tokens)
        params = {}
        for i, (token_ids, _) in enumerate(prompts):
            # max_tokens null: up to the context's end, as OpenAI does.
            max_tokens = (
                body.max_tokens
                if body.max_tokens is not None
                else max(1, self.max_model_len - len(token_ids))
            )
            self._check_context(len(token_ids), max_tokens, "prompt")
            params[i] = body.sampling_params(max_tokens, body.logprobs, prompt_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        outputs = await self.engine.generate(
            [
                (rid, token_ids, params[i], text, lora_request)
                for i, (rid, (token_ids, text)) in enumerate(zip(ids, prompts))
            ]
        )
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or self.model_name,
        }
        usage = Usage([token_ids for token_ids, _ in prompts])
        echoes = {rid: self._prompt_text(p) if body.echo else "" for rid, p in zip(ids, prompts)}
        offsets: dict[int, int] = {}  # choice -> characters of text sent so far
        scored: dict[str, list] = {}  # request -> its prompt logprobs (a stream's first output)

        def choice(output: RequestOutput, completion: CompletionOutput) -> dict:
            index = ids.index(output.request_id) * body.n + completion.index
            if output.prompt_logprobs is not None:
                scored[output.request_id] = output.prompt_logprobs
            text, tokens, logprobs = completion.text, completion.token_ids, completion.logprobs
            if index not in offsets:
                offsets[index] = 0
                if body.echo:  # the prompt first, with its logprobs if asked (vLLM)
                    text = echoes[output.request_id] + text
                    if logprobs is not None:
                        tokens = output.prompt_token_ids + tokens
                        logprobs = scored[output.request_id] + logprobs
            answer = {
                "index": index,
                "text": text,
                "logprobs": None
                if logprobs is None
                else self._completion_logprobs(tokens, logprobs, offsets[index]),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            offsets[index] += len(text)
            if body.prompt_logprobs is not None and not body.stream:
                answer["prompt_logprobs"] = self._prompt_logprobs(output, body.prompt_logprobs)
            return answer

        if body.stream:
            return self._stream(outputs, head, choice, usage, body.include_usage)
        choices = await self._collect(outputs, choice, usage)
        return JSONResponse({**head, "choices": choices, "usage": usage.as_dict()})

    async def _completion_prompts(
        self, prompt, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[tuple[list[int], str | None]]:
        """(token ids, text) per prompt: ``prompt`` is a str, a list of str, a list of
        token ids, or a list of those.  Counted and measured first, tokenized off the
        event loop."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(not p for p in prompt):
            raise APIError(400, f"{param} must not be empty", param)
        if len(prompt) > self.limits.max_prompts:
            raise APIError(
                400,
                f"{param} holds {len(prompt)} prompts, more than the "
                f"{self.limits.max_prompts} one request may (--max-prompts)",
                param,
            )
        for p in prompt:
            if isinstance(p, str):
                self._check_chars(len(p), param)
        return await self._off_loop(
            lambda: [
                (self.tokenizer.encode(p, add_special_tokens=add_special_tokens), p)
                if isinstance(p, str)
                else (p, None)
                for p in prompt
            ]
        )

    # -- embeddings (a pooling model's) -----------------------------------------------
    async def embeddings(self, body: EmbeddingRequest) -> Response:
        """OpenAI's ``/v1/embeddings``: one engine request per input, each pooled once
        its prompt has run (`minipaged.models.pooler`)."""
        self._check_text(body)
        if self.runner != "pooling":
            raise APIError(
                400,
                "The model does not support the Embeddings API: this server generates; "
                "start it with --runner pooling to serve /v1/embeddings",
                "model",
            )
        self._check_model(body.model)
        if name := body.unsupported():
            raise APIError(400, f"{name} is not supported by minipaged", name)
        try:
            params = body.pooling_params()
        except ValueError as error:
            raise APIError(400, str(error), "dimensions") from error
        prompts = await self._completion_prompts(body.input, body.add_special_tokens, "input")
        for token_ids, _ in prompts:
            if len(token_ids) > self.max_model_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {len(token_ids)} tokens in the input.",
                    "input",
                )
        request_id = f"embd-{uuid.uuid4().hex}"
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        outputs = await self.engine.encode(
            [(rid, token_ids, params, text, None) for rid, (token_ids, text) in zip(ids, prompts)]
        )
        finals: list[EmbeddingRequestOutput] = []
        try:
            async with aclosing(outputs):  # closing it (a cancelled task) aborts the rest
                finals += [output async for output in outputs]
        except (EngineDeadError, RequestFailedError, ServerClosingError) as error:
            raise server_error(error) from error
        finals.sort(key=lambda o: ids.index(o.request_id))
        usage = Usage([token_ids for token_ids, _ in prompts]).as_dict()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "object": "embedding",
                        "index": i,
                        "embedding": encode_embedding(o.outputs.embedding, body.encoding_format),
                    }
                    for i, o in enumerate(finals)
                ],
                "model": body.model or self.model_name,
                "usage": {k: usage[k] for k in ("prompt_tokens", "total_tokens")},
            }
        )

    def _prompt_text(self, prompt: tuple[list[int], str | None]) -> str:
        token_ids, text = prompt
        return text if text is not None else self.tokenizer.decode(token_ids)

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float] | None], offset: int
    ) -> dict:
        """The legacy completions format: parallel lists, one entry per token (null
        for an echoed prompt's first token, which nothing scores)."""
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        starts = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [
                None if lp is None else {self.tokenizer.decode([k]): v for k, v in lp.items()}
                for lp in logprobs
            ],
            "text_offset": starts,
        }

    def _prompt_logprobs(self, output: RequestOutput, k: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` field: per prompt token, null for the first, then
        ``{token_id: {"logprob", "rank", "decoded_token"}}``, the prompt token first,
        then its ``k`` best alternatives.  ``rank`` counts from 1 for the best; the
        prompt token's is null when it is not among the ``k`` best (only they are
        known)."""
        return [
            None if entry is None else self._ranked(entry, k) for entry in output.prompt_logprobs
        ]

    def _ranked(self, entry: dict[int, float], k: int) -> dict:
        best_first = sorted(entry, key=lambda t: -entry[t])
        outside = next(iter(entry)) if len(entry) > k else None  # the prompt token, unranked
        ranks = {t: r for r, t in enumerate((t for t in best_first if t != outside), start=1)}
        return {
            str(t): {
                "logprob": v,
                "rank": ranks.get(t),
                "decoded_token": self.tokenizer.decode([t]),
            }
            for t, v in entry.items()
        }

    # -- chat -------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest) -> Response:
        lora_request = self._check(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        self._check_logprobs(body.top_logprobs, "top_logprobs")
        tools = self._chat_tools(body)
        token_ids, mm_features = await self._chat_prompt(body)
        asked = [m for m in (body.max_completion_tokens, body.max_tokens) if m is not None]
        max_tokens = asked[0] if asked else max(1, self.max_model_len - len(token_ids))
        self._check_context(len(token_ids), max_tokens, "messages")
        top = body.top_logprobs or 0
        params = body.sampling_params(
            max_tokens, top if body.logprobs else None, body.prompt_logprobs
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = await self.engine.generate(
            [(request_id, token_ids, params, None, lora_request, mm_features)]
        )
        head = {
            "id": request_id,
            "object": "chat.completion.chunk" if body.stream else "chat.completion",
            "created": int(time.time()),
            "model": body.model or self.model_name,
        }
        usage, started = Usage([token_ids]), set()

        def choice(_: RequestOutput, completion: CompletionOutput) -> dict:
            message, finish_reason = {"content": completion.text}, completion.finish_reason
            if tools is not None:
                message, finish_reason = tools.message(completion, body.stream)
            if completion.index not in started:  # a stream names the role once
                message = {"role": "assistant", **message}
                started.add(completion.index)
            logprobs = (
                None
                if completion.logprobs is None
                else self._chat_logprobs(completion.token_ids, completion.logprobs, top)
            )
            return {
                "index": completion.index,
                "delta" if body.stream else "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": completion.stop_reason,
            }

        if body.stream:
            return self._stream(outputs, head, choice, usage, body.include_usage)
        finals: list[RequestOutput] = []
        choices = await self._collect(outputs, choice, usage, finals)
        answer = {**head, "choices": choices, "usage": usage.as_dict()}
        if body.prompt_logprobs is not None:  # vLLM: beside the choices
            answer["prompt_logprobs"] = self._prompt_logprobs(finals[0], body.prompt_logprobs)
        return JSONResponse(answer)

    def _chat_tools(self, body: ChatCompletionRequest) -> ChatTools | None:
        """How this request's tool calls are read (None: it asks for none); a 400
        naming ``tool_choice`` for "auto" without ``--enable-auto-tool-choice``, as
        vLLM."""
        body.tool_schema()  # checks tools and tool_choice
        choice = body.effective_tool_choice
        if choice == "none":
            return None
        if choice == "auto" and not self.enable_auto_tool_choice:
            raise APIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                "tool_choice",
            )
        return ChatTools(choice)

    async def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], list]:
        """The messages' token ids, and the ``mm_features`` of their images (none
        without ``image_url`` parts)."""
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        if self.tokenizer.chat_template is None:
            raise APIError(
                400, "this model's tokenizer has no chat template; use /v1/completions", "messages"
            )
        if any(m.has_images for m in body.messages):
            return await self._render_chat_with_images(body)
        tokens = await self._render_chat(
            body.messages, add_special_tokens=body.add_special_tokens, tools=body.tools
        )
        return tokens, []

    async def _render_chat_with_images(self, body: ChatCompletionRequest):
        """Messages with ``image_url`` parts: each image's placeholder where it goes
        (`split_images`), the template rendered, then the model's processor expands the
        placeholders and reads the images (decoded, checked and hashed off the event
        loop); a refused image is a 400 naming ``messages`` and what was wrong."""
        placeholder = self.engine.facts.image_placeholder
        try:
            messages, images = split_images(
                [m.as_template_input() for m in body.messages], placeholder
            )
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")

        def render():
            text = self.tokenizer.apply_chat_template(
                messages, tools=body.tools, add_generation_prompt=True, tokenize=False
            )
            return self.engine.process_multimodal(text, images, body.add_special_tokens)

        try:
            return await self._off_loop(render)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error

    async def _render_chat(
        self,
        messages: list,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list | None = None,
    ) -> list[int]:
        """The messages (and ``tools``, which the template describes to the model)
        through the chat template, tokenized off the event loop (the template has the
        special tokens already, unless ``add_special_tokens``)."""
        if any(m.has_images for m in messages):
            raise APIError(400, "image_url parts are only read by /v1/chat/completions", "messages")
        messages = [m.as_template_input() for m in messages]
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                )
            except Exception as error:  # a template raises what it likes
                raise APIError(
                    400, f"the chat template refused the messages: {error}", "messages"
                ) from error
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await self._off_loop(render)

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], top: int
    ) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.tokenizer.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {
                    **entry(t, lp[t]),
                    "top_logprobs": [
                        entry(k, v) for k, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top]
                    ],
                }
                for t, lp in zip(token_ids, logprobs)
            ]
        }

    # -- the tokenizer (vLLM's endpoints) ----------------------------------------------
    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """The token ids of a text or of templated messages, as the engine would see
        them; refused, as a prompt is, past ``max_model_len``."""
        self._check_text(body)
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            if name := body.unsupported():
                raise APIError(400, f"{name} is not supported by minipaged", name)
            if self.tokenizer.chat_template is None:
                raise APIError(400, "this model's tokenizer has no chat template", "messages")
            tokens = await self._render_chat(
                body.messages, body.add_generation_prompt, body.add_special_tokens
            )
            param = "messages"
        else:
            self._check_chars(len(body.prompt), "prompt")
            add = body.add_special_tokens
            tokens = await self._off_loop(
                lambda: self.tokenizer.encode(body.prompt, add_special_tokens=add)
            )
            param = "prompt"
        if len(tokens) > self.max_model_len:
            raise APIError(
                400,
                f"the {param} has {len(tokens)} tokens, more than this model's maximum "
                f"context length of {self.max_model_len}",
                param,
            )
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_model(body.model)
        vocab = self.engine.facts.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise APIError(400, f"tokens must be ids in [0, {vocab}), got {bad[0]}", "tokens")
        return {"prompt": await self._off_loop(lambda: self.tokenizer.decode(body.tokens))}

    def tokenizer_info(self) -> dict:
        """vLLM's ``/tokenizer_info``: the tokenizer's settings (``init_kwargs``, less
        the paths of its files), its class and its chat template."""
        info = {
            name: json_safe(value)
            for name, value in self.tokenizer.init_kwargs.items()
            if name not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
        }
        info["tokenizer_class"] = type(self.tokenizer).__name__
        if self.tokenizer.chat_template:
            info["chat_template"] = self.tokenizer.chat_template
        return info

    # -- shared -----------------------------------------------------------------------
    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); an unknown name is
        a 404."""
        return self.adapters.resolve(model, self.model_name)

    @staticmethod
    def _check_text(body) -> None:
        """Refuse a body holding a string that cannot be encoded (first: no message
        may quote one)."""
        if name := unencodable_field(body.model_dump()):
            raise APIError(
                400,
                f"{name} holds a lone surrogate, which is not text "
                "(UTF-16 halves must come in pairs)",
                name,
            )

    def _check(self, body: SamplingRequest) -> LoRARequest | None:
        """Refuse what the request may not ask; returns the LoRA adapter its ``model``
        names (None: the base model)."""
        self._check_text(body)
        if self.runner == "pooling":
            raise APIError(
                400,
                "The model does not support the Completions or Chat API: this server "
                "runs a pooling model (--runner pooling), which answers /v1/embeddings",
                "model",
            )
        lora_request = self._check_model(body.model)
        if name := body.unsupported():
            raise APIError(400, f"{name} is not supported by minipaged", name)
        backend = (body.model_extra or {}).get("guided_decoding_backend")
        if backend not in (None, "auto", self.structured_outputs_backend):
            raise APIError(
                400,
                f"guided_decoding_backend {backend!r}: this server's structured outputs use "
                f"{self.structured_outputs_backend!r} (--structured-outputs-config)",
                "guided_decoding_backend",
            )
        self._check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(
                400, "prompt_logprobs is not available with stream (as in vLLM)", "prompt_logprobs"
            )
        if body.n > self.limits.max_n:
            raise APIError(
                400, f"n must be at most {self.limits.max_n} (--max-n), got {body.n}", "n"
            )
        return lora_request

    def _check_logprobs(self, asked: int | None, param: str) -> None:
        if asked is not None and asked > self.limits.max_logprobs:
            raise APIError(
                400,
                f"{param} must be at most {self.limits.max_logprobs} (--max-logprobs), got {asked}",
                param,
            )

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, before
        spending time tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the {param} has {num_chars} characters; no text over "
                f"{self.max_prompt_chars} fits this model's maximum "
                f"context length of {self.max_model_len} tokens",
                param,
            )

    async def _off_loop(self, work):
        """``work()`` on the tokenizing thread, so a long prompt stalls no one else."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work)

    def _check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        """As OpenAI and vLLM: prompt and completion must fit the model's context."""
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} "
                f"tokens. However, you requested {prompt_len + max_tokens} "
                f"tokens ({prompt_len} in the {param}, {max_tokens} in the "
                "completion).",
                param,
            )

    @staticmethod
    async def _collect(
        outputs: AsyncIterator[RequestOutput], choice, usage: Usage, finals: list | None = None
    ) -> list:
        """Every request's final output as choices, by index (the outputs themselves
        into ``finals``, if given)."""
        finals = [] if finals is None else finals
        try:
            async with aclosing(outputs):  # closing it (a cancelled task) aborts the rest
                finals += [output async for output in outputs]  # FINAL_ONLY: one each
        except (EngineDeadError, RequestFailedError, ServerClosingError) as error:
            raise server_error(error) from error
        choices = [choice(o, c) for o in finals for c in o.outputs]
        usage.completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return sorted(choices, key=lambda c: c["index"])

    @staticmethod
    def _stream(
        outputs: AsyncIterator[RequestOutput], head: dict, choice, usage: Usage, include_usage: bool
    ) -> StreamingResponse:
        async def events():
            try:
                async with aclosing(outputs):  # closing it aborts what still runs
                    async for output in outputs:
                        for completion in output.outputs:
                            usage.completion_tokens += len(completion.token_ids)
                            yield sse({**head, "choices": [choice(output, completion)]})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage.as_dict()})
            except ValueError as error:
                yield sse(error_body(APIError(400, str(error))))
            except (EngineDeadError, RequestFailedError, ServerClosingError) as error:
                yield sse(error_body(server_error(error)))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """As OpenAI sends one: a list of numbers, or base64 of its little-endian float32
    bytes."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """vLLM's rule: ``--enable-auto-tool-choice`` needs a ``--tool-call-parser``."""
    if tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
            f"got {tool_call_parser!r}"
        )
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser)")


def unencodable_field(body: dict) -> str | None:
    """The first top-level field of ``body`` holding a string that is not valid Unicode
    (a lone surrogate, which JSON's ``\\ud800`` escapes allow and tokenizers refuse)."""

    def bad(value) -> bool:
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                return True
            return False
        if isinstance(value, dict):
            return any(bad(k) or bad(v) for k, v in value.items())
        return isinstance(value, list) and any(map(bad, value))

    return next((name for name, value in body.items() if bad(value)), None)


def json_safe(value):
    """``value`` as JSON can hold it: a tokenizer's ``AddedToken`` as its text, other
    objects as their ``str``."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return getattr(value, "content", None) or str(value)


def default_model_name(model: str) -> str:
    """The model's id in the API: a local checkpoint's directory name (not the whole
    path, which says where the server's files are), else the name as given."""
    path = Path(model)
    if not path.is_dir():
        return model
    return path.name or path.resolve().name  # as named (a link keeps its name); "." too


class Draining:
    """A shutdown in progress: new ``/v1`` requests get 503 and ``/health`` 503 (for
    load balancers), running requests have ``grace_s`` to finish, then the rest are
    ended with an error (an SSE error event and ``[DONE]``, or a 503 body)."""

    def __init__(self, engine: EngineClient, grace_s: float) -> None:
        self.engine, self.grace_s = engine, grace_s
        self.started = False

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        logger.info(
            "shutting down: %d request(s) running, %g s to finish",
            self.engine.num_requests,
            self.grace_s,
        )
        timer = threading.Timer(
            self.grace_s, self.engine.end_all, ["the server shut down before the request finished"]
        )
        timer.daemon = True
        timer.start()


class Server(uvicorn.Server):
    """uvicorn's server, whose shutdown drains the app first (`Draining`)."""

    def __init__(self, config: uvicorn.Config, draining: Draining) -> None:
        super().__init__(config)
        self.draining = draining

    async def shutdown(self, sockets=None) -> None:
        self.draining.start()
        await super().shutdown(sockets)


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    allowed_hosts: list[str] | None = None,
    lora_modules: list[str] | None = None,
    data_parallel_size: int = 1,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    **engine_kwargs,
) -> None:
    """Load ``model`` into an engine (``engine_kwargs``: `EngineConfig`'s) and serve it
    over HTTP, as ``served_model_name`` (default: `default_model_name`), until stopped,
    with the LoRA adapters ``lora_modules`` (``name=path``) beside it.
    ``data_parallel_size`` N > 1 runs N engine replicas, each a process of its own,
    behind this one server (`minipaged.server.data_parallel`).
    ``allowed_hosts`` defaults to the loopback names when bound to one, else any.  If
    the engine's loop dies (with replicas: the last of them), the server stops and this
    raises ``SystemExit(1)``, so a supervisor can restart it."""
    check_data_parallel_size(data_parallel_size, engine_kwargs)
    check_tool_flags(enable_auto_tool_choice, tool_call_parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    limits = limits or ServerLimits()
    hosts = tuple(allowed_hosts) if allowed_hosts else default_allowed_hosts(host)
    server: Server | None = None

    def on_dead(_: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    config = EngineConfig(model=str(model), **engine_kwargs)
    engine: EngineClient = (
        AsyncEngine(LLMEngine(config), on_dead)
        if data_parallel_size == 1
        else DataParallelEngine(config, data_parallel_size, on_dead)
    )
    name = served_model_name or default_model_name(model)
    try:
        app = build_app(
            engine,
            name,
            api_key,
            limits,
            hosts,
            lora_modules,
            enable_auto_tool_choice,
            tool_call_parser,
        )
        server = Server(uvicorn_config(app, host, port, limits), app.state.draining)
    except BaseException:
        engine.shutdown()
        raise
    log_startup(engine.facts.description, model, name, host, port, api_key, limits, hosts)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it has already handled
        pass
    finally:  # the app's lifespan does it too, unless a Ctrl-C cut it short
        engine.shutdown()
    if engine.error is not None:
        raise SystemExit(
            f"minipaged serve: the engine died ({engine.error!r}); the traceback is above"
        )


def uvicorn_config(
    app: FastAPI, host: str, port: int, limits: ServerLimits, **kwargs
) -> uvicorn.Config:
    """uvicorn's settings for ``app``: HTTP/1.1 heads timed like bodies, and shutdown
    waiting out the grace period (plus time for the last error events to go out).

    An idle keep-alive connection is closed after the read timeout too, not after
    uvicorn's 5 s: httpx (under the openai client and LangChain) reuses a pooled
    connection until it has been idle 5 s by its own clock, which starts after the
    server's, so a server closing at 5 s races the client's next request on it, and the
    request is lost ("Server disconnected without sending a response").  The server's
    idle limit must outlast the clients' (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s
    unless set, is this setting)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=h11_with_head_timeout(limits.read_timeout_s),
        timeout_keep_alive=limits.read_timeout_s,
        timeout_graceful_shutdown=limits.shutdown_grace_s + 5,
        **kwargs,
    )


def log_startup(
    description: list[str],
    model: str,
    name: str,
    host: str,
    port: int,
    api_key: str | None,
    limits: ServerLimits,
    hosts,
) -> None:
    """One block saying what is served, where and on what (``description``: the
    engine's, `EngineFacts.description`), as vLLM's startup log does."""
    lines = [
        f"model           {model} (served as {name!r})",
        *description,
        (
            f"limits          body {limits.max_body_bytes} bytes, {limits.max_prompts} prompts, "
            f"n <= {limits.max_n}, logprobs <= {limits.max_logprobs}, read timeout "
            f"{limits.read_timeout_s:g} s, shutdown grace {limits.shutdown_grace_s:g} s"
        ),
        f"API key         {'required' if api_key else 'none'}",
        f"allowed hosts   {', '.join(hosts) if hosts else 'any'}",
        f"listening on    http://{f'[{host}]' if ':' in host else host}:{port}",
    ]
    logger.info("minipaged serve\n%s", "\n".join(f"  {line}" for line in lines))


def build_app(
    engine: EngineClient,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    allowed_hosts: tuple[str, ...] | None = None,
    lora_modules: list[str] | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``; with ``api_key``, the
    ``/v1`` routes want ``Authorization: Bearer <api_key>``; ``allowed_hosts`` None
    allows any ``Host``; ``lora_modules``: adapters to serve, ``name=path`` each;
    ``enable_auto_tool_choice`` with ``tool_call_parser`` (vLLM's flags) lets
    ``tool_choice="auto"`` read the model's calls.
    ``app.state.draining`` is its `Draining`.  Stopping the app stops the engine's
    thread."""
    limits = limits or ServerLimits()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.shutdown()

    # No trailing-slash redirects: they would send clients to the Host they named.
    app = FastAPI(title="minipaged", lifespan=lifespan, redirect_slashes=False)
    serving = OpenAIServing(engine, model_name, limits, enable_auto_tool_choice, tool_call_parser)
    registry = make_registry(engine)
    if lora_modules:  # read before the app serves: a malformed one stops the start
        asyncio.run(serving.adapters.load_modules(lora_modules, model_name))
    draining = app.state.draining = Draining(engine, limits.shutdown_grace_s)
    app.add_middleware(
        RequestGuard,
        config=GuardConfig(api_key, allowed_hosts, limits.max_body_bytes, limits.read_timeout_s),
        closing=lambda: draining.started,
    )

    app.get("/v1/models", responses=ERROR_RESPONSES)(serving.models)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, serving.completions(body))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, serving.chat(body))

    @app.post("/v1/embeddings", responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, serving.embeddings(body))

    app.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)(serving.load_lora_adapter)
    app.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)(serving.unload_lora_adapter)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        return await serving.tokenize(body)

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await serving.detokenize(body)

    app.get("/tokenizer_info")(serving.tokenizer_info)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200 if engine.error is None and not draining.started else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    _add_error_handlers(app)
    _document_400_not_422(app)
    return app


async def cancel_on_disconnect(request: Request, handler: Coroutine) -> Response:
    """Run ``handler``; if the client hangs up first, cancel it, which aborts its engine
    requests and frees their blocks (vLLM's ``with_cancellation``).  A stream is
    returned at once and watches for the hang-up itself."""
    work = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work.done():
        gone.cancel()
        return work.result()
    work.cancel()
    with suppress(asyncio.CancelledError):
        await work
    return Response(status_code=499)  # no one reads it: the client left


async def _disconnected(request: Request) -> None:
    """Return when the client has hung up (the body is read by now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; this server answers a bad body with
    OpenAI's 400, so the schema says so."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
        return app.openapi_schema

    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, pydantic's, Starlette's and the library's."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> Response:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        if first["type"] == "json_invalid":
            return error_response(APIError(400, f"malformed JSON: {first['msg']}"))
        return error_response(
            APIError(
                400, f"{'.'.join(where) or 'body'}: {first['msg']}", where[0] if where else None
            )
        )

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> Response:
        response = error_response(APIError(error.status_code, str(error.detail)))
        response.headers.update(error.headers or {})  # a 405's Allow, for one
        return response

    @app.exception_handler(UnknownAdapterError)
    async def unknown_model(_: Request, error: UnknownAdapterError) -> Response:
        return error_response(APIError(404, str(error), "model", "model_not_found"))

    @app.exception_handler(ValueError)  # SamplingParams and the engine name the argument
    async def bad_value(_: Request, error: ValueError) -> Response:
        return error_response(APIError(400, str(error), getattr(error, "param", None)))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> Response:
        return error_response(APIError(500, str(error)))

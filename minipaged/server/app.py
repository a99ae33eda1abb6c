"""An OpenAI-compatible HTTP server over the engine (FastAPI): ``minipaged serve DIR``.

    GET  /v1/models             the one model served
    POST /v1/completions        prompt(s) -> text; streamed as server-sent events if asked
    POST /v1/chat/completions   messages -> the chat template -> a reply
    GET  /health                200 while the engine runs
    GET  /metrics               Prometheus text: queues, KV blocks, preemptions, tokens

Every prompt of a request becomes one engine request; `AsyncEngine` runs them in the
same batch as everyone else's.  A stream sends each step's new text as it is made
(``data: {...}`` chunks, then ``data: [DONE]``); a client that hangs up mid-stream
aborts its requests, which frees their blocks.  Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with a 4xx status for anything the
client got wrong, and the server goes on serving.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from minipaged.config import EngineConfig
from minipaged.engine import LLMEngine
from minipaged.outputs import CompletionOutput, RequestOutput
from minipaged.server.async_engine import AsyncEngine, EngineDeadError
from minipaged.server.metrics import make_registry
from minipaged.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       SamplingRequest)


class APIError(Exception):
    """An error for the client, in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status)


def error_body(error: APIError) -> dict:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Usage:
    """Token counts for ``usage``: prompts once, every completion's tokens."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompt_tokens = sum(map(len, prompts))
        self.completion_tokens = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class OpenAIServing:
    """The endpoints' logic: requests in, engine requests out, responses back."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "minipaged", "max_model_len": self.max_model_len}]}

    # -- completions ------------------------------------------------------------------
    async def completions(self, body: CompletionRequest) -> Response:
        self._check(body)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs needs the prompt's logprobs, which "
                                "minipaged does not compute", "echo")
        prompts = self._completion_prompts(body.prompt)
        for token_ids, _ in prompts:
            self._check_context(len(token_ids), body.max_tokens, "prompt")
        params = body.sampling_params(body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        outputs = self.engine.generate([(rid, token_ids, params, text) for rid, (token_ids, text)
                                        in zip(ids, prompts)])
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        usage = Usage([token_ids for token_ids, _ in prompts])
        echoes = {rid: self._prompt_text(p) if body.echo else "" for rid, p in zip(ids, prompts)}
        offsets: dict[int, int] = {}  # choice -> characters of text sent so far

        def choice(request_id: str, completion: CompletionOutput) -> dict:
            index = ids.index(request_id) * body.n + completion.index
            text = completion.text
            if index not in offsets:
                text, offsets[index] = echoes[request_id] + text, 0
            logprobs = None if completion.logprobs is None else self._completion_logprobs(
                completion.token_ids, completion.logprobs, offsets[index])
            offsets[index] += len(text)
            return {"index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason}

        if body.stream:
            return self._stream(outputs, head, choice, usage, body.include_usage)
        choices = await self._collect(outputs, choice, usage)
        return JSONResponse({**head, "choices": choices, "usage": usage.as_dict()})

    def _completion_prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """(token ids, text) per prompt: ``prompt`` is a str, a list of str, a list of
        token ids, or a list of those."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(not p for p in prompt):
            raise APIError(400, "prompt must not be empty", "prompt")
        return [(self.tokenizer.encode(p), p) if isinstance(p, str) else (p, None)
                for p in prompt]

    def _prompt_text(self, prompt: tuple[list[int], str | None]) -> str:
        token_ids, text = prompt
        return text if text is not None else self.tokenizer.decode(token_ids)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                             offset: int) -> dict:
        """The legacy completions format: parallel lists, one entry per token."""
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        starts = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs)],
                "top_logprobs": [{self.tokenizer.decode([k]): v for k, v in lp.items()}
                                 for lp in logprobs],
                "text_offset": starts}

    # -- chat -------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest) -> Response:
        self._check(body)
        token_ids = self._chat_prompt(body)
        asked = [m for m in (body.max_completion_tokens, body.max_tokens) if m is not None]
        max_tokens = asked[0] if asked else max(1, self.max_model_len - len(token_ids))
        self._check_context(len(token_ids), max_tokens, "messages")
        top = body.top_logprobs or 0
        params = body.sampling_params(max_tokens, top if body.logprobs else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = self.engine.generate([(request_id, token_ids, params, None)])
        head = {"id": request_id, "object": "chat.completion.chunk" if body.stream
                else "chat.completion", "created": int(time.time()), "model": self.model_name}
        usage, started = Usage([token_ids]), set()

        def choice(_: str, completion: CompletionOutput) -> dict:
            message = {"content": completion.text}
            if completion.index not in started:  # a stream names the role once
                message = {"role": "assistant", **message}
                started.add(completion.index)
            logprobs = None if completion.logprobs is None else self._chat_logprobs(
                completion.token_ids, completion.logprobs, top)
            return {"index": completion.index, "delta" if body.stream else "message": message,
                    "logprobs": logprobs, "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason}

        if body.stream:
            return self._stream(outputs, head, choice, usage, body.include_usage)
        choices = await self._collect(outputs, choice, usage)
        return JSONResponse({**head, "choices": choices, "usage": usage.as_dict()})

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        if self.tokenizer.chat_template is None:
            raise APIError(400, "this model's tokenizer has no chat template; use "
                                "/v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [m.as_template_input() for m in body.messages], add_generation_prompt=True,
                tokenize=False)
        except Exception as error:  # a template raises what it likes
            raise APIError(400, f"the chat template refused the messages: {error}",
                           "messages") from error
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template has them

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]],
                       top: int) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.tokenizer.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in sorted(
                lp.items(), key=lambda kv: -kv[1])[:top]]}
            for t, lp in zip(token_ids, logprobs)]}

    # -- shared -----------------------------------------------------------------------
    def _check(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model",
                           "model_not_found")
        if name := body.unsupported():
            raise APIError(400, f"{name} is not supported by minipaged", name)

    def _check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        """As OpenAI and vLLM: prompt and completion must fit the model's context."""
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens. However, you requested {prompt_len + max_tokens} "
                                f"tokens ({prompt_len} in the {param}, {max_tokens} in the "
                                "completion).", param)

    @staticmethod
    async def _collect(outputs: AsyncIterator[RequestOutput], choice, usage: Usage) -> list:
        finals = [output async for output in outputs]  # FINAL_ONLY: one per request
        choices = [choice(o.request_id, c) for o in finals for c in o.outputs]
        usage.completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return sorted(choices, key=lambda c: c["index"])

    @staticmethod
    def _stream(outputs: AsyncIterator[RequestOutput], head: dict, choice, usage: Usage,
                include_usage: bool) -> StreamingResponse:
        async def events():
            try:
                async with aclosing(outputs):  # closing it aborts what still runs
                    async for output in outputs:
                        for completion in output.outputs:
                            usage.completion_tokens += len(completion.token_ids)
                            yield sse({**head, "choices": [choice(output.request_id,
                                                                  completion)]})
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage.as_dict()})
            except (EngineDeadError, ValueError) as error:
                yield sse(error_body(APIError(500 if isinstance(error, EngineDeadError)
                                              else 400, str(error))))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, **engine_kwargs) -> None:
    """Load ``model`` into an engine (``engine_kwargs``: `EngineConfig`'s) and serve it
    over HTTP, as ``served_model_name`` (default: ``model`` as given), until stopped."""
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model), **engine_kwargs)))
    app = build_app(engine, served_model_name or str(model), api_key)
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=5)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``; with ``api_key``, the
    ``/v1`` routes want ``Authorization: Bearer <api_key>``.  Stopping the app stops
    the engine's thread."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="minipaged", lifespan=lifespan)
    serving, registry = OpenAIServing(engine, model_name), make_registry(engine)

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key is not None and not secrets.compare_digest(given, f"Bearer {api_key}"):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    v1 = [Depends(authorize)]
    app.get("/v1/models", dependencies=v1)(serving.models)
    app.post("/v1/completions", dependencies=v1)(serving.completions)
    app.post("/v1/chat/completions", dependencies=v1)(serving.chat)

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200 if engine.error is None else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, pydantic's, Starlette's and the library's."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        if first["type"] == "json_invalid":
            return error_response(APIError(400, f"malformed JSON: {first['msg']}"))
        return error_response(APIError(400, f"{'.'.join(where) or 'body'}: {first['msg']}",
                                        where[0] if where else None))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return error_response(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(ValueError)  # SamplingParams and the engine name the argument
    async def bad_value(_: Request, error: ValueError) -> JSONResponse:
        return error_response(APIError(400, str(error)))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(APIError(500, str(error)))

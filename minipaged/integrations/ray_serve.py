"""Replicas of ``minipaged serve`` under Ray Serve: ``minipaged serve-ray MODEL``.

One `minipaged serve` is one engine and one KV pool.  To serve more requests than one
engine can, run several, each a *replica* with its own engine and pool, and spread the
requests over them: this is data parallelism, and vLLM's production stack leaves it to
Ray Serve (vLLM's ``ray.serve.llm``), which places replicas on a cluster's nodes,
restarts one whose process dies, and adds or removes replicas as the load asks
(``autoscaling_config``).  Two deployments:

- `EngineReplica` (``num_replicas``, ``autoscaling_config``, ``ray_actor_options``):
  the server's own FastAPI app (`minipaged.server.app.build_app`, every route, guard
  and metric as they are) over an `AsyncEngine`, run in the replica's process.  Each
  request's ASGI messages stream back to the caller through a Ray Serve handle.
- `OpenAIIngress`: the HTTP front door behind Ray Serve's proxy.  It reads the request
  (with the server's `RequestGuard`), hands it to a replica (Ray's router picks the
  less busy of two), and relays the answer.  It is there for faults: when a replica's
  process dies mid-request, Ray's proxy alone would answer a bare ``500 Internal Server
  Error`` or cut a stream short; this answers in OpenAI's error shape (a 503 body, or an
  error event and ``data: [DONE]`` in a stream), so only that replica's requests fail
  and the client can tell why.

A client that hangs up cancels the proxy's call, which Ray passes on down to the
replica; there it cancels the app's handler, which aborts the engine requests and frees
their blocks, as in one ``minipaged serve``.  Every response names the replica that
made it in an ``x-minipaged-replica`` header, so ``/metrics`` (any replica's, as the
router picks) says whose counters it shows; Ray's own metrics (``ray_serve_*``: requests,
latencies and queue lengths per replica) export on each node's metrics port.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine
from minipaged.server.app import (
    APIError,
    build_app,
    default_model_name,
    error_body,
    error_response,
    sse,
)
from minipaged.server.async_engine import AsyncEngine
from minipaged.server.guard import GuardConfig, RequestGuard, default_allowed_hosts
from minipaged.server.limits import ServerLimits

logger = logging.getLogger("ray.serve")
REPLICA_HEADER = b"x-minipaged-replica"
# Requests one replica takes at once (Ray Serve's default is 5).  An engine batches every
# request it holds, as one `minipaged serve` does, so it takes many: the rest wait in
# its scheduler's queue, and Ray's router still sends each to the less busy replica.
MAX_ONGOING_REQUESTS = 256
# What of an ASGI scope a replica needs (the rest is the proxy's own objects).
SCOPE_KEYS = (
    "type",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "headers",
    "client",
    "server",
)


@serve.deployment(name="EngineReplica")
class EngineReplica:
    """One engine and its KV pool, behind the server's FastAPI app."""

    def __init__(
        self,
        model: str,
        served_model_name: str,
        engine_kwargs: dict,
        guard: GuardConfig,
        limits: ServerLimits,
    ) -> None:
        self.engine = AsyncEngine(LLMEngine(EngineConfig(model=model, **engine_kwargs)))
        self.app = build_app(
            self.engine, served_model_name, guard.api_key, limits, guard.allowed_hosts
        )
        self.name = serve.get_replica_context().replica_id.unique_id.encode()

    async def http(self, scope: dict, body: bytes):
        """Run one HTTP request through the app (`run_asgi`), streaming its messages."""
        async for message in run_asgi(self.app, scope, body, self.name):
            yield message

    def __del__(self) -> None:
        self.engine.shutdown()


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """The front door: the guard, then one replica per request, errors in OpenAI's shape."""

    def __init__(self, replicas: DeploymentHandle, guard: GuardConfig) -> None:
        self.replicas = replicas.options(stream=True)
        self.guard = guard

    def __serve_build_asgi_app__(self):
        return RequestGuard(functools.partial(relay, self.replicas.http.remote), self.guard)


async def lifespan(receive: Receive, send: Send) -> None:
    """ASGI's lifespan protocol, with nothing to start or stop."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def run_asgi(app, scope: dict, body: bytes, name: bytes) -> AsyncIterator[Message]:
    """Run one HTTP request (``scope`` and its whole ``body``) through ``app``; yields
    its ASGI messages as the app sends them (a stream's events one by one), the
    response's headers naming the replica ``name``.  Closing the iterator early (the
    caller went away) cancels the app's handler, which aborts its engine requests."""
    messages: asyncio.Queue = asyncio.Queue()
    pending: bytes | None = body

    async def receive() -> Message:
        nonlocal pending
        if pending is not None:
            message, pending = {"type": "http.request", "body": pending}, None
            return message
        await asyncio.Future()  # a hang-up arrives as the handler's cancellation

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), (REPLICA_HEADER, name)]
        await messages.put(message)

    handler = asyncio.create_task(app({**scope, "root_path": ""}, receive, send))
    handler.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            yield message
    finally:
        handler.cancel()


async def relay(forward, scope: Scope, receive: Receive, send: Send) -> None:
    """The front door's ASGI app: read the request, ``forward(scope, body)`` it (an async
    iterator of the replica's ASGI messages) and send them on.  If the replica fails
    before answering, the client gets a 503 in OpenAI's shape; if it fails mid-stream,
    an error event and ``data: [DONE]`` end the stream."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    try:
        body = await read_body(receive)
    except HTTPException as error:  # the guard's 408 or 413
        await error_response(APIError(error.status_code, str(error.detail)))(scope, receive, send)
        return
    request = {key: scope[key] for key in SCOPE_KEYS if key in scope}
    started = streaming = False
    try:
        async for message in forward(request, body):
            if message["type"] == "http.response.start":
                started = True
                streaming = any(
                    k == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in message.get("headers", [])
                )
            await send(message)
    except RayError as error:  # the replica died (or could not be reached)
        logger.warning("a replica failed a request: %r", error)
        failure = APIError(503, f"the replica serving this request failed: {error}")
        if not started:
            await error_response(failure)(scope, receive, send)
        elif streaming:
            events = sse(error_body(failure)) + sse("[DONE]")
            await send({"type": "http.response.body", "body": events.encode()})
        # A JSON body is sent whole in one message: it cannot be cut halfway.


async def read_body(receive: Receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def build_openai_app(
    model: str,
    num_replicas: int | str = 1,
    autoscaling_config: dict | None = None,
    ray_actor_options: dict | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
    allowed_hosts: tuple[str, ...] | None = None,
    **engine_kwargs,
):
    """The Ray Serve application: `OpenAIIngress` over ``num_replicas`` `EngineReplica`
    (each ``LLM(model, **engine_kwargs)``'s engine), or as many as
    ``autoscaling_config`` asks for (Ray Serve's fields: ``min_replicas``,
    ``max_replicas``, ``target_ongoing_requests``, ...; then ``num_replicas`` must be
    left at 1 or "auto").  ``ray_actor_options`` are each replica's resources, e.g.
    ``{"num_cpus": 1, "num_gpus": 1}``.  Run it with ``serve.run(app)``."""
    if autoscaling_config is not None and num_replicas not in (1, "auto"):
        raise ValueError(
            f"num_replicas must be left at 1 with an autoscaling_config, got {num_replicas!r}"
        )
    if autoscaling_config is None and not (isinstance(num_replicas, int) and num_replicas >= 1):
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    limits = limits or ServerLimits()
    guard = GuardConfig(api_key, allowed_hosts, limits.max_body_bytes, limits.read_timeout_s)
    scaling = (
        {"autoscaling_config": autoscaling_config}
        if autoscaling_config is not None
        else {"num_replicas": num_replicas}
    )
    replicas = EngineReplica.options(
        **scaling,
        ray_actor_options=ray_actor_options or {"num_cpus": 1},
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
    ).bind(str(model), served_model_name or default_model_name(model), engine_kwargs, guard, limits)
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING_REQUESTS
    ).bind(replicas, guard)


def serve_ray(
    model: str,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    allowed_hosts: list[str] | None = None,
    **app_kwargs,
) -> None:
    """Deploy `build_openai_app` (``app_kwargs``) on the Ray cluster at ``address`` (None: a
    local one started here, or ``$RAY_ADDRESS``), Ray Serve's proxy listening on
    ``host:port``, until interrupted; then take the deployment down."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    ray.init(address=address)
    hosts = tuple(allowed_hosts) if allowed_hosts else default_allowed_hosts(host)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_openai_app(model, allowed_hosts=hosts, **app_kwargs), name="minipaged")
    logger.info("minipaged serve-ray: listening on http://%s:%d", host, port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete("minipaged")
        ray.shutdown()

"""What every request passes before FastAPI reads a byte of its body (pure ASGI middleware).

In order, each answered in OpenAI's error shape:

1. the ``Host`` header must name an allowed host (400), so a web page cannot reach a
   server on localhost through DNS rebinding;
2. a server shutting down takes no new work (503);
3. ``/v1`` wants the API key, if one is set (401, with ``WWW-Authenticate``), checked
   before the body is read, so an unauthenticated client cannot make it parse megabytes;
4. a body longer than ``max_body_bytes`` is refused (413), by its ``Content-Length`` or
   as it streams in;
5. a body that stops arriving for ``read_timeout_s`` is refused (408), so a client that
   sends half a body does not hold a connection forever.

Before all of these, `HeadTimeoutH11Protocol` closes a connection whose request line and
headers do not arrive within the same time.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import h11
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

# The names a server bound to a loopback address answers to by default.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass
class GuardConfig:
    """The checks' settings; ``allowed_hosts`` None or holding ``"*"`` allows any host."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_body_bytes: int = 8 * 2**20
    read_timeout_s: float = 30.0


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """Bound to a loopback address: only its names (a rebinding page names another);
    bound elsewhere: any host, as the operator chose to be reachable."""
    return LOCAL_HOSTS if bind_host in LOCAL_HOSTS else None


def host_name(header: str) -> str:
    """``Host`` without its port: ``[::1]:8000`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def error(
    status: int,
    message: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error body (the app's `error_body`, repeated here to stay import-free)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}},
        status_code=status,
        headers=headers,
    )


class RequestGuard:
    """The checks above, around ``app``; ``closing()`` says whether to refuse new work."""

    def __init__(
        self,
        app: ASGIApp,
        config: GuardConfig,
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.app, self.config, self.closing = app, config, closing
        self.bearer = None if config.api_key is None else f"Bearer {config.api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        """The first check the request fails, as a response; None if it passes them."""
        headers = dict(scope["headers"])  # lower-case byte names, as ASGI gives them
        allowed = self.config.allowed_hosts
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if allowed is not None and "*" not in allowed and host not in allowed:
            return error(
                400,
                f"the Host header {host!r} is not an allowed host (see --allowed-hosts)",
                "invalid_host",
            )
        v1 = scope["path"].startswith("/v1")
        if v1 and self.closing():
            return error(503, "the server is shutting down", "server_shutting_down")
        # Bytes, not str: a non-ASCII header must compare unequal, not raise.
        given = headers.get(b"authorization", b"")
        if v1 and self.bearer is not None and not secrets.compare_digest(given, self.bearer):
            return error(
                401,
                "Incorrect API key provided.",
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return error(400, "Content-Length must be a number of bytes")
        if int(length) > self.config.max_body_bytes:
            return error(413, self._too_large(), "request_too_large")
        return None

    def _too_large(self) -> str:
        return (
            f"the request body is larger than {self.config.max_body_bytes} bytes "
            "(see --max-request-bytes)"
        )

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` with the body's size and read time bounded (a chunked body has no
        Content-Length to check first).  Raising HTTPException lets FastAPI's body
        reader pass the status on to the app's error handler."""
        received, done = 0, False

        async def limited() -> Message:
            nonlocal received, done
            if done:  # after the body: a wait for the client to hang up, unbounded
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.config.read_timeout_s)
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.config.read_timeout_s:g} s",
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if received > self.config.max_body_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        return limited


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head (the request
    line and headers) has not arrived ``head_timeout_s`` after the connection opened or
    the previous response ended: uvicorn times neither, so a client that connects and
    sends nothing, or half a head, would hold a connection forever.  (The body's pace is
    `RequestGuard`'s.)"""

    head_timeout_s = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self._head_timer is not None:
            self._head_timer.cancel()  # the head is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        if self.conn.their_state is h11.IDLE:  # not already reading a pipelined request
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _head_late(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def h11_with_head_timeout(seconds: float) -> type[HeadTimeoutH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, timing heads at ``seconds``."""
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,), {"head_timeout_s": seconds})

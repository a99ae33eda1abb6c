"""The engine behind the server: one thread steps it, requests stream back (paper §4.5).

HTTP requests arrive whenever they like, but the engine runs one step at a time over
everything that has arrived.  So the engine lives in a thread of its own, looping:

    take the requests and aborts that came in -> step -> hand each output to its request

The event loop that serves HTTP never runs the model: it keeps accepting requests and
streaming tokens while a step runs (torch releases the GIL), and a new request joins the
running batch at the next step, which is continuous batching as Orca and vLLM do it.

Only the engine thread changes the engine.  The event loop talks to it through a queue
of commands, and it answers through each request's ``asyncio.Queue``, by way of
``loop.call_soon_threadsafe``.  After every step it also publishes ``stats`` (the
engine's ``counters()``), a fresh dict that ``/metrics`` reads without touching the
engine.

A request whose sampling raises fails alone (`LLMEngine.step` with ``fail_alone``): its
stream gets a `RequestFailedError` and everyone else's batch goes on.  If the loop
itself dies, the traceback is logged, every waiting request hears of it, and
``on_dead`` is called, so a server can exit for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from minipaged.engine.llm_engine import LLMEngine
from minipaged.engine.protocol import EngineClient, EngineFacts, Request
from minipaged.lora_request import LoRARequest
from minipaged.outputs import RequestOutput

logger = logging.getLogger("minipaged.server")


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state is unknown, so it serves nothing more."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its blocks are freed); the rest go on."""


class ServerClosingError(RuntimeError):
    """The server is shutting down and ended the request (its blocks are freed)."""


class AsyncEngine(EngineClient):
    """An `LLMEngine` stepped by a thread of its own, with asyncio streams of outputs
    (vLLM's ``AsyncLLM``): the server's `EngineClient` for one engine."""

    def __init__(
        self, engine: LLMEngine, on_dead: Callable[[BaseException], None] | None = None
    ) -> None:
        self.engine = engine
        self.facts = EngineFacts.of(engine)
        self.stats = engine.counters()
        self.error: BaseException | None = None
        self.on_dead = on_dead
        self._closed: str | None = None  # why, once `end_all` has ended everything
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="minipaged-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side --------------------------------------------------------
    async def generate(self, requests: list[Request]) -> AsyncIterator[RequestOutput]:
        """Queue ``requests`` and return one stream of all their outputs, ending when
        the last finishes.  Checks every request first and raises ``ValueError``
        before queueing any (a coroutine, as a replica elsewhere answers later:
        `minipaged.server.data_parallel`).  Leaving the stream early (a client gone) aborts those
        still running, which frees their blocks."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        for request_id, token_ids, params, *rest in requests:
            # Reads only the engine's fixed limits and its request ids: safe from here.
            mm = rest[2] if len(rest) > 2 else None
            self.engine.check_request(request_id, token_ids, params, mm_features=mm)
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for request in requests:
            self._streams[request[0]] = (loop, outputs)
            self._commands.put(("add", request))
        return self._stream([r[0] for r in requests], outputs)

    async def _stream(self, request_ids: list[str], outputs: asyncio.Queue):
        running = set(request_ids)
        try:
            while running:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                if output.finished:
                    running.discard(output.request_id)
                yield output
        finally:
            for request_id in running:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    def process_multimodal(
        self, prompt: str, images: list, add_special_tokens: bool
    ) -> tuple[list[int], list]:
        # The engine's processor reads nothing the step loop changes: safe from here.
        return self.engine.process_multimodal(prompt, images, add_special_tokens)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Have the engine read and know an adapter (between steps, on its thread);
        ``ValueError`` naming the file if it cannot."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        added = loop.create_future()
        self._commands.put(("add_lora", (lora_request, loop, added)))
        await added

    def remove_lora(self, lora_int_id: int) -> None:
        """Have the engine forget an adapter the server no longer offers (between steps)."""
        self._commands.put(("remove_lora", lora_int_id))

    def end_all(self, message: str) -> None:
        """End every running request now with `ServerClosingError` (shutting down)."""
        self._commands.put(("end_all", message))

    @property
    def num_requests(self) -> int:
        """Requests with a stream still open (the event loop's own count)."""
        return len(self._streams)

    def shutdown(self) -> None:
        self._commands.put(("stop", None))
        self._thread.join()

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._apply(self._take_commands()):
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step(fail_alone=True))
                    self._fail(self.engine.failed)
                self.stats = self.engine.counters()
        except Exception as error:  # every waiting request must hear of it
            logger.exception("the engine loop died; the server cannot go on")
            self.error = error
            dead = EngineDeadError(f"the engine stopped: {error!r}")
            for request_id in list(self._streams):
                self._send(request_id, dead)
            for kind, arg in self._take_commands(block=False):  # adapters being loaded
                if kind == "add_lora":
                    _, loop, added = arg
                    loop.call_soon_threadsafe(added.set_exception, dead)
            if self.on_dead is not None:
                self.on_dead(error)

    def _fail(self, failed: dict[str, Exception]) -> None:
        """Tell each request that failed alone why (and log it: a bug to look at)."""
        for request_id, error in failed.items():
            logger.error("request %s failed in the engine", request_id, exc_info=error)
            self._end(
                request_id, RequestFailedError(f"the request failed in the engine: {error!r}")
            )

    def _take_commands(self, block: bool = True) -> list[tuple]:
        """Everything queued; an idle engine sleeps here until something is."""
        idle = block and not self.engine.has_unfinished_requests()
        commands = [self._commands.get()] if idle else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[tuple]) -> bool:
        """Add and abort requests between steps; False once told to stop."""
        for kind, arg in commands:
            if kind == "stop":
                return False
            if kind == "abort":
                self.engine.abort_request(arg)
                continue
            if kind == "end_all":
                self._closed = arg  # and requests still on their way are turned back
                for request_id in list(self._streams):
                    self._end(request_id, ServerClosingError(arg))
                continue
            if kind == "remove_lora":
                self._remove_lora(arg)
                continue
            if kind == "add_lora":
                self._add_lora(*arg)
                continue
            request_id, token_ids, params, prompt, lora_request, *mm = arg
            if self._closed is not None:
                self._end(request_id, ServerClosingError(self._closed))
                continue
            try:
                self.engine.add_request(
                    request_id,
                    token_ids,
                    params,
                    prompt=prompt,
                    lora_request=lora_request,
                    mm_features=mm[0] if mm else None,
                )
            except ValueError as error:  # e.g. its id reused since it was checked
                self._send(request_id, error)
        return True

    def _add_lora(self, lora_request: LoRARequest, loop, added: asyncio.Future) -> None:
        try:
            self.engine.add_lora(lora_request)
        except ValueError as error:  # a malformed adapter: the caller's 400
            loop.call_soon_threadsafe(added.set_exception, error)
        else:
            loop.call_soon_threadsafe(added.set_result, None)

    def _remove_lora(self, lora_int_id: int) -> None:
        """Free an unloaded adapter's slot and host copy, unless requests still use it:
        then it stays until evicted (the server no longer routes to it)."""
        try:
            self.engine.remove_lora(lora_int_id)
        except ValueError:
            pass

    def _end(self, request_id: str, error: Exception) -> None:
        """Abort a request (a no-op if it never reached the engine) and tell its stream."""
        self.engine.abort_request(request_id)
        self._send(request_id, error)
        self._streams.pop(request_id, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send(output.request_id, output)
            if output.finished:
                self._streams.pop(output.request_id, None)

    def _send(self, request_id: str, item) -> None:
        if (stream := self._streams.get(request_id)) is not None:  # gone if aborted
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

"""Data parallelism: N engine replicas behind one API server (``--data-parallel-size N``).

Tensor parallelism splits one model over several devices so that one engine can hold it;
data parallelism runs the whole engine N times, each *replica* (vLLM: a data-parallel
*engine*) with its own process, model copy and KV pool, and spreads the requests over
them: N times the KV blocks, N batches stepping at once.  vLLM's API server keeps a
client per engine and sends each request to the least loaded one (its
``DPLBAsyncMPClient``, fed the engines' waiting and running counts by the
``DPCoordinator``); this is the same with one API server, so the router's own count of
the requests it has sent each replica and not yet seen finish *is* each replica's
running + waiting.

- Each replica is a process started with multiprocessing's ``spawn`` (so a replica may
  itself spawn tensor-parallel ranks) running `replica_main`: an `AsyncEngine` and a
  loop that takes commands from one pipe and sends events back on another
  (``multiprocessing`` connections, which pickle the requests and outputs).
- `DataParallelEngine` is what the API server holds instead of an `AsyncEngine`, with
  the same methods: ``generate`` picks a replica (`Router`), and everything the app
  already does (streams, aborts on a hang-up, errors in OpenAI's shape) goes through it
  unchanged.  With ``enable_prefix_caching`` the router prefers, among the replicas no
  busier than the least busy plus ``PREFIX_SLACK`` requests, the one that was last sent
  the longest run of the prompt's leading blocks: its prefix cache likely holds them.
- A replica that dies fails only its own requests (`EngineDeadError`, a 500 in OpenAI's
  shape), is logged and reported on ``/metrics`` (``minipaged:engine_alive``), and the
  others serve on; when none is left, ``on_dead`` is called (the server exits 1).  A
  replica whose API server is gone sees its command pipe close and stops, so none is
  left orphaned.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import signal
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine
from minipaged.engine.protocol import EngineClient, EngineFacts, Request
from minipaged.lora_request import LoRARequest
from minipaged.outputs import RequestOutput
from minipaged.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
    ServerClosingError,
)

logger = logging.getLogger("minipaged.server")
STATS_INTERVAL_S = 0.05  # how often a replica publishes its counters, if they changed
STOP_TIMEOUT_S = 30.0  # a replica's time to stop before it is killed
# Prefix-aware routing sends a request to the replica holding its prefix unless that
# replica has this many more unfinished requests than the least busy one.
PREFIX_SLACK = 4


def check_data_parallel_size(data_parallel_size, engine_kwargs: dict) -> None:
    """``ValueError`` naming the argument unless ``data_parallel_size`` is an int >= 1
    that can run with ``engine_kwargs``."""
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int):
        raise ValueError(f"data_parallel_size must be an int >= 1, got {data_parallel_size!r}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if data_parallel_size > 1 and engine_kwargs.get("enable_lora"):
        raise ValueError(
            "data_parallel_size > 1 cannot run with enable_lora in minipaged (adapters "
            "loaded at run time would have to reach every replica); serve one engine"
        )
    if data_parallel_size > 1 and engine_kwargs.get("distributed_executor_backend") == (
        "external_launcher"
    ):
        raise ValueError(
            "data_parallel_size > 1 cannot run with distributed_executor_backend="
            "'external_launcher' in minipaged (the replicas are spawned on this host, "
            "torchrun's ranks are one engine's); serve one engine"
        )


# -- a replica's process --------------------------------------------------------------
def replica_main(index: int, config: EngineConfig, commands: Connection, events: Connection):
    """A replica: build the engine, say ``("ready", EngineFacts)``, then serve commands
    until told to stop or the API server is gone; exit 1 if the engine died."""
    # Ctrl-C reaches the whole process group; the API server decides when replicas stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format=f"%(levelname)s:     [engine {index}] %(message)s"
    )
    engine = LLMEngine(config)
    events.send(("ready", EngineFacts.of(engine)))
    replica = ReplicaLoop(engine, commands, events)
    raise SystemExit(asyncio.run(replica.run()))


class ReplicaLoop:
    """One replica's event loop: an `AsyncEngine`, fed by the command pipe (read on a
    thread of its own), each batch of requests forwarded as events by a task."""

    def __init__(self, engine: LLMEngine, commands: Connection, events: Connection) -> None:
        self.llm_engine, self.commands, self.events = engine, commands, events
        self.tasks: dict[int, asyncio.Task] = {}
        self.exit_code = 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.done = asyncio.Event()

        def on_dead(_: BaseException) -> None:  # every stream has heard already
            self.exit_code = 1
            loop.call_soon_threadsafe(self.done.set)

        self.engine = AsyncEngine(self.llm_engine, on_dead)
        threading.Thread(target=self._read, args=(loop,), daemon=True).start()
        publisher = asyncio.create_task(self._publish_stats())
        await self.done.wait()
        publisher.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.engine.shutdown()
        self.llm_engine.shutdown()
        return self.exit_code

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """Commands into the event loop; a closed pipe (the API server gone) stops it."""
        while True:
            try:
                command = self.commands.recv()
            except (EOFError, OSError):
                command = ("stop",)
            loop.call_soon_threadsafe(self._apply, command)
            if command[0] == "stop":
                return

    def _apply(self, command: tuple) -> None:
        kind, *args = command
        if kind == "generate":
            batch_id, requests = args
            self.tasks[batch_id] = asyncio.create_task(self._serve(batch_id, requests))
        elif kind == "abort" and (task := self.tasks.get(args[0])) is not None:
            task.cancel()  # closing the stream aborts its requests, freeing their blocks
        elif kind == "end_all":
            self.engine.end_all(args[0])
        elif kind == "stop":
            self.done.set()

    async def _serve(self, batch_id: int, requests: list[Request]) -> None:
        """Check and run one batch (an HTTP request's prompts), sending its outputs."""
        try:
            try:
                stream = await self.engine.generate(requests)
            except (ValueError, EngineDeadError) as error:
                self._send("refused", batch_id, error)
                return
            self._send("accepted", batch_id)
            async with aclosing(stream):
                async for output in stream:
                    self._send("output", batch_id, output)
        except (RequestFailedError, ServerClosingError, EngineDeadError) as error:
            self._send("error", batch_id, error)
        finally:
            self.tasks.pop(batch_id, None)

    async def _publish_stats(self) -> None:
        published = None
        while True:
            if self.engine.stats is not published:  # a fresh dict after every step
                published = self.engine.stats
                self._send("stats", published)
            await asyncio.sleep(STATS_INTERVAL_S)

    def _send(self, *event) -> None:
        try:
            self.events.send(event)
        except OSError:  # the API server is gone; the command pipe will say so too
            pass


# -- the API server's side ------------------------------------------------------------
@dataclass
class Replica:
    """The API server's handle on one replica: its process, pipes, the requests it was
    sent that have not finished (its load), and its last published counters."""

    index: int
    process: multiprocessing.process.BaseProcess
    commands: Connection
    events: Connection
    alive: bool = True
    load: int = 0
    stats: dict = field(default_factory=dict)
    sent_blocks: OrderedDict = field(default_factory=OrderedDict)  # prefix hashes, LRU

    @property
    def name(self) -> str:
        return f"data-parallel engine {self.index} (pid {self.process.pid})"


@dataclass
class Batch:
    """One ``generate`` call in flight: its replica, its requests, and where its
    replica's events go."""

    replica: Replica
    request_ids: list[str]
    accepted: asyncio.Future
    outputs: asyncio.Queue


class Router:
    """Which replica gets a request: the least loaded (unfinished requests: running and
    waiting), lowest index first; with prefix caching, the one most likely to hold the
    prompt's leading blocks, unless it is busier than the least loaded plus
    ``PREFIX_SLACK``."""

    def __init__(self, block_size: int, prefix_aware: bool, capacity_blocks: int) -> None:
        self.block_size, self.prefix_aware = block_size, prefix_aware
        self.capacity_blocks = capacity_blocks  # a replica cannot cache more than its pool

    def pick(self, replicas: list[Replica], prompts: list[list[int]]) -> Replica:
        alive = [r for r in replicas if r.alive]
        least = min(alive, key=lambda r: r.load)
        if not self.prefix_aware:
            return least
        hashes = [h for p in prompts for h in self.block_hashes(p)]
        candidates = [r for r in alive if r.load <= least.load + PREFIX_SLACK]
        best = max(candidates, key=lambda r: (self.cached(r, hashes), -r.load))
        self.remember(best, hashes)
        return best

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """A hash per full block of the prompt, each chained to the blocks before it (as
        the prefix cache's, §4.4): equal hashes, equal prefixes."""
        hashes, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start : start + self.block_size])))
            hashes.append(parent)
        return hashes

    @staticmethod
    def cached(replica: Replica, hashes: list[int]) -> int:
        return sum(h in replica.sent_blocks for h in hashes)

    def remember(self, replica: Replica, hashes: list[int]) -> None:
        for h in hashes:
            replica.sent_blocks[h] = None
            replica.sent_blocks.move_to_end(h)
        while len(replica.sent_blocks) > self.capacity_blocks:
            replica.sent_blocks.popitem(last=False)


class DataParallelEngine(EngineClient):
    """``data_parallel_size`` replicas of ``LLMEngine(config)``, the API server's
    `EngineClient` as `AsyncEngine` is for one: the engine thread's counters per replica
    (`replica_stats`) for ``/metrics``, ``error`` once every replica is dead.
    ``prefix_aware_routing`` (default: with ``enable_prefix_caching``) turns the
    router's prefix affinity on or off."""

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int,
        on_dead: Callable[[BaseException], None] | None = None,
        prefix_aware_routing: bool | None = None,
    ) -> None:
        check_data_parallel_size(data_parallel_size, vars(config))
        self.on_dead, self.error = on_dead, None
        self._stopping = False
        # multiprocessing joins its children at exit: stop them first, or it waits forever.
        atexit.register(self.shutdown)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batches: dict[int, Batch] = {}
        self._batch_ids = itertools.count()
        context = multiprocessing.get_context("spawn")
        self.replicas = [self._start(context, i, config) for i in range(data_parallel_size)]
        try:
            facts = [self._wait_ready(r) for r in self.replicas][0]
        except BaseException:
            self.shutdown()
            raise
        self.facts = replace(
            facts,
            description=[
                *facts.description,
                f"data parallel   {data_parallel_size} engines, each one process and its "
                f"own KV pool (pids {', '.join(str(r.process.pid) for r in self.replicas)})",
            ],
        )
        if prefix_aware_routing is None:
            prefix_aware_routing = config.enable_prefix_caching
        self.router = Router(config.block_size, prefix_aware_routing, facts.num_gpu_blocks)
        for replica in self.replicas:
            threading.Thread(
                target=self._read,
                args=(replica,),
                name=f"minipaged-dp-{replica.index}",
                daemon=True,
            ).start()

    @staticmethod
    def _start(context, index: int, config: EngineConfig) -> Replica:
        commands_out, commands_in = context.Pipe(duplex=False)
        events_out, events_in = context.Pipe(duplex=False)
        process = context.Process(
            target=replica_main,
            args=(index, config, commands_out, events_in),
            name=f"minipaged-engine-{index}",
        )
        process.start()
        commands_out.close(), events_in.close()  # the replica's ends
        return Replica(index, process, commands_in, events_out)

    @staticmethod
    def _wait_ready(replica: Replica) -> EngineFacts:
        try:
            kind, facts = replica.events.recv()
        except EOFError:
            replica.process.join()
            replica.alive = False
            raise RuntimeError(
                f"{replica.name} failed to start (exit code {replica.process.exitcode}); "
                "its traceback is above"
            ) from None
        assert kind == "ready", kind
        return facts

    # -- the event loop's side (AsyncEngine's methods) ---------------------------------
    async def generate(self, requests: list[Request]) -> AsyncIterator[RequestOutput]:
        """Send ``requests`` (one HTTP request's prompts) to one replica, which checks
        them (``ValueError`` here if it refuses any) and runs them; returns the stream of
        their outputs, as `AsyncEngine.generate`."""
        if self.error is not None:
            raise self.error
        self._loop = asyncio.get_running_loop()
        replica = self.router.pick(self.replicas, [r[1] for r in requests])
        batch_id = next(self._batch_ids)
        batch = Batch(
            replica, [r[0] for r in requests], self._loop.create_future(), asyncio.Queue()
        )
        self._batches[batch_id] = batch
        replica.load += len(requests)
        try:
            self._command(replica, "generate", batch_id, requests)
            await batch.accepted
        except BaseException:  # refused, its replica died, or the client left
            self._close(batch_id, set(batch.request_ids))
            raise
        return self._stream(batch_id)

    async def _stream(self, batch_id: int):
        batch = self._batches[batch_id]
        running = set(batch.request_ids)
        try:
            while running:
                output = await batch.outputs.get()
                if isinstance(output, BaseException):
                    raise output
                if output.finished:
                    running.discard(output.request_id)
                    batch.replica.load -= 1
                yield output
        finally:
            self._close(batch_id, running)

    def _close(self, batch_id: int, running: set[str]) -> None:
        """Forget a batch; abort on its replica what it still runs."""
        if (batch := self._batches.pop(batch_id, None)) is None:
            return
        batch.replica.load -= len(running)
        if running:
            self._command(batch.replica, "abort", batch_id)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        raise ValueError("data_parallel_size > 1 serves no LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> None:
        raise ValueError("data_parallel_size > 1 serves no LoRA adapters")

    def end_all(self, message: str) -> None:
        for replica in self.replicas:
            self._command(replica, "end_all", message)

    @property
    def num_requests(self) -> int:
        return sum(r.load for r in self.replicas if r.alive)

    def replica_stats(self) -> list[tuple[Replica, dict]]:
        """Each replica with its last published counters (empty once it is dead)."""
        return [(r, r.stats if r.alive else {}) for r in self.replicas]

    def shutdown(self) -> None:
        """Stop every replica (killed if it will not stop) and wait for it; again, a
        no-op."""
        if self._stopping:
            return
        self._stopping = True
        for replica in self.replicas:
            self._command(replica, "stop")
        for replica in self.replicas:
            replica.process.join(STOP_TIMEOUT_S)
            if replica.process.is_alive():
                logger.warning("%s did not stop; killing it", replica.name)
                replica.process.kill()
                replica.process.join()
            replica.commands.close()

    def _command(self, replica: Replica, *command) -> None:
        """Send a command; a replica that is gone will be reported by its reader."""
        if replica.alive:
            try:
                replica.commands.send(command)
            except OSError:
                pass

    # -- the reader threads -----------------------------------------------------------
    def _read(self, replica: Replica) -> None:
        """A replica's events, handed to the event loop, until its pipe closes."""
        while True:
            try:
                event = replica.events.recv()
            except (EOFError, OSError):
                if self._stopping:  # told to stop: no one waits for its requests
                    replica.alive = False
                    return
                replica.process.join(STOP_TIMEOUT_S)
                self._post(self._replica_died, replica)
                return
            if event[0] == "stats":  # read by /metrics from any thread
                replica.stats = event[1]
            else:
                self._post(self._deliver, *event)

    def _post(self, handler, *args) -> None:
        if self._loop is None:  # no request ever came: nothing waits on the loop
            handler(*args)
        else:
            self._loop.call_soon_threadsafe(handler, *args)

    def _deliver(self, kind: str, batch_id: int, item=None) -> None:
        if (batch := self._batches.get(batch_id)) is None:  # closed since
            return
        if kind == "accepted":
            batch.accepted.set_result(None)
        elif kind == "refused":
            batch.accepted.set_exception(item)
        else:  # "output", "error"
            batch.outputs.put_nowait(item)

    def _replica_died(self, replica: Replica) -> None:
        """Fail the dead replica's requests alone; with none left, the server stops."""
        replica.alive = False
        error = EngineDeadError(
            f"{replica.name} died (exit code {replica.process.exitcode}); "
            "its requests failed, the other engines serve on"
        )
        logger.error("%s", error)
        for batch in [b for b in self._batches.values() if b.replica is replica]:
            if not batch.accepted.done():
                batch.accepted.set_exception(error)
            else:
                batch.outputs.put_nowait(error)
        if not any(r.alive for r in self.replicas):
            self.error = EngineDeadError("every data-parallel engine died")
            logger.error("%s; the server cannot go on", self.error)
            if self.on_dead is not None:
                self.on_dead(self.error)

"""`P2pTcpConnector`: a prompt's KV pulled from the producer engine over TCP, between
two hosts (the CPU counterpart of vLLM V1's ``P2pNcclConnector``, which moves the same
blocks with NCCL between GPUs).

It keeps `SharedStorageConnector`'s entries, a prompt's blocks of every layer under a
hash of its tokens, and changes where they live and how they travel.  The producer
(``kv_role="kv_producer"``) keeps each finished prompt's entry in its own memory, the
oldest dropped once they pass ``kv_buffer_size`` bytes, and serves them from a thread
listening on ``kv_ip:kv_port``.  The consumer (``kv_role="kv_consumer"``) connects
there when it starts (for ``connect_timeout_s`` seconds, then it is refused) and
compares the producer's `KVCacheFacts` with its own (a mismatch is refused at start-up,
naming the field).  Then the two halves of the consumer's connector split the work as
vLLM's do:

- the **scheduler**'s side only *asks* how many tokens the producer holds for a prompt
  (``lookup``: a few bytes; a producer that is gone means the consumer computes the
  prompt itself, a warning);
- the **worker**'s side *pulls* the blocks: `start_load_kv` sends one ``get`` for the
  step's loads, each a prompt's block range ``[first, last)``, the blocks the consumer
  lacks (those past its prefix-cache hit, never the one holding the prompt's last
  token), and a thread receives the answer layer by layer, copying each layer into
  the blocks its own scheduler gave the sequence; `wait_for_layer_load`, called by
  each attention layer before it reads its cache, waits for that layer only, so the
  first layers compute while the later ones are still on the wire (vLLM's layer-wise
  loading).  With tensor parallelism each consumer rank pulls its own slice of the KV
  heads over its own connection (the heterogeneous case of vLLM's ``NixlConnector``).

On the wire, requests and answers' headers are JSON messages of
`multiprocessing.connection` (length-prefixed, authenticated); each layer's message is
the raw bytes of the requested blocks of its cache tensors (keys, values, and int8's
scales), one after the other, ``blocks x block_size x heads x head_dim x element
size`` each, nothing else, so its size follows from the model's config alone.  A
layer that does not arrive within ``load_timeout_s``, or a producer that goes away in
the middle, fails the requests that were loading (vLLM's
``kv_load_failure_policy="fail"``): the waits return, the step runs on, and
`get_block_ids_with_load_errors` hands the engine their blocks, which it drops from
the prefix cache before failing every request holding one with a `KVTransferError`
naming the producer.  (vLLM's ``"recompute"`` policy, which rolls them back to compute
the prompt instead, is not built here.)  With tensor parallelism only rank 0 reports
to the engine; a failure on another rank raises there.  One producer per process and
port: both of its connector instances (scheduler and worker) share its store.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import asdict
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

import torch

from minipaged.distributed.kv_transfer.kv_connector.v1.base import (
    ForwardContext,
    KVConnectorRole,
    KVTransferError,
)
from minipaged.distributed.kv_transfer.kv_connector.v1.shared_storage_connector import (
    ReqMeta,
    SharedStorageConnector,
)

logger = logging.getLogger(__name__)
AUTHKEY = b"minipaged-kv-transfer"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_LOAD_TIMEOUT_S = 30.0


def block_bytes(tensors: list[torch.Tensor], first: int, last: int, heads: list[int]) -> bytes:
    """Blocks ``first..last-1`` of one layer's cache tensors, KV heads ``heads[0]..
    heads[1]-1`` (dim 2 of each), as raw bytes, tensor after tensor."""
    lo, hi = heads
    return b"".join(
        t[first:last, :, lo:hi].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors
    )


class ProducerStore:
    """A producer's entries in memory, by key (least recently asked first: it is
    dropped first), served to consumers by a listening thread."""

    def __init__(self, facts: dict, address: tuple[str, int], capacity_bytes: int) -> None:
        self.facts, self.capacity = facts, capacity_bytes
        # key -> (prompt tokens, layer -> its cache tensors' blocks)
        self.entries: collections.OrderedDict[str, tuple[int, dict[str, list[torch.Tensor]]]] = (
            collections.OrderedDict()
        )
        self.partial: dict[str, dict[str, list[torch.Tensor]]] = {}
        self.num_bytes = 0  # held
        self.bytes_sent = 0  # the layers' bytes served to consumers
        self.lock = threading.Lock()
        self.listener = Listener(address, authkey=AUTHKEY)
        threading.Thread(target=self._accept, daemon=True, name="kv-producer").start()

    def commit(self, key: str, num_tokens: int) -> None:
        layers = self.partial.pop(key, {})
        with self.lock:
            self.entries[key] = (num_tokens, layers)
            self.num_bytes += _nbytes(layers)
            while self.num_bytes > self.capacity and len(self.entries) > 1:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.num_bytes -= _nbytes(dropped)

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, AuthenticationError):  # a peer that failed to connect
                continue
            no_delay(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            try:
                while True:
                    request = json.loads(conn.recv_bytes())
                    if request["op"] == "facts":
                        conn.send_bytes(json.dumps(self.facts).encode())
                    elif request["op"] == "lookup":
                        conn.send_bytes(json.dumps(self._lookup(request["key"])).encode())
                    else:
                        self._send_blocks(conn, request["items"], request["heads"])
            except (EOFError, OSError):  # the consumer went away
                return

    def _lookup(self, key: str) -> dict:
        """How many prompt tokens ``key``'s entry holds ({} if none); asked, it is
        the last to be dropped."""
        with self.lock:
            if key not in self.entries:
                return {}
            self.entries.move_to_end(key)
            return {"num_tokens": self.entries[key][0]}

    def _send_blocks(self, conn: Connection, items: list, heads: list[int]) -> None:
        """Each item's blocks ``[first, last)`` of entry ``key``, layer-major: every
        item's layer 0, then every item's layer 1, ... (so a consumer's layer k is
        complete as soon as its messages are in); first a header naming the layers."""
        with self.lock:
            entries = [self.entries.get(key) for key, _, _ in items]
        for (key, _, last), entry in zip(items, entries):
            layers = entry[1] if entry else {}
            if not layers or next(iter(layers.values()))[0].shape[0] < last:
                conn.send_bytes(json.dumps({"missing": key}).encode())
                return
        names = list(entries[0][1])
        conn.send_bytes(json.dumps({"layers": names}).encode())
        for name in names:
            for (_, first, last), (_, layers) in zip(items, entries):
                data = block_bytes(layers[name], first, last, heads)
                conn.send_bytes(data)
                with self.lock:  # one thread per consumer
                    self.bytes_sent += len(data)


def _nbytes(layers: dict[str, list[torch.Tensor]]) -> int:
    return sum(t.nbytes for tensors in layers.values() for t in tensors)


def no_delay(conn: Connection) -> Connection:
    """Send each message at once (``TCP_NODELAY``): with Nagle's algorithm a message
    written right after another (the header, then a small layer) waits for the peer's
    delayed acknowledgement, tens of milliseconds a request."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def hang_up(conn: Connection) -> None:
    """Close ``conn`` so that a thread blocked receiving on it wakes up (a shutdown:
    closing the descriptor alone leaves that thread waiting)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already disconnected
            pass
    conn.close()


_STORES: dict[tuple[str, int], ProducerStore] = {}
_STORES_LOCK = threading.Lock()


def producer_store(facts: dict, address: tuple[str, int], capacity: int) -> ProducerStore:
    """The process's store listening at ``address``: made by the first of the
    producer's two connector instances, shared by the second."""
    with _STORES_LOCK:
        store = _STORES.get(address)
        if store is None:
            store = _STORES[address] = ProducerStore(facts, address, capacity)
        elif store.facts != facts:
            raise ValueError(
                f"kv_transfer_config: {address[0]}:{address[1]} already serves another "
                "engine's KV in this process"
            )
        return store


class P2pTcpConnector(SharedStorageConnector):
    def _open_store(self) -> None:
        config = self.config
        extra = config.kv_connector_extra_config
        self.address = (config.kv_ip, config.kv_port)
        self.connect_timeout_s = extra.get("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S)
        self.load_timeout_s = extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S)
        self.store, self.conn = None, None
        # The worker's loads of the current step: its connection, its receiving
        # thread, one event per layer, and what went wrong.
        self._worker_conn, self._loader = None, None
        self._layer_loaded: dict[str, threading.Event] = {}
        self._load_error: BaseException | None = None
        self._loads: list[ReqMeta] = []
        self._failed_blocks: set[int] = set()
        if config.is_kv_producer:  # kv_both is refused by KVTransferConfig
            self.store = producer_store(asdict(self.facts), self.address, config.kv_buffer_size)
        elif self.role is KVConnectorRole.SCHEDULER:  # the consumer's lookups go from here
            self.conn = self._connect(self.connect_timeout_s)
            self._check_facts()

    def __getstate__(self) -> dict:
        """A copy for another tensor-parallel rank of this engine: a producer's saves
        go through rank 0, a consumer's rank connects by itself when it first loads."""
        return {**self.__dict__, "store": None, "conn": None, "_worker_conn": None}

    def _connect(self, timeout_s: float) -> Connection:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return no_delay(Client(self.address, authkey=AUTHKEY))
            except OSError as error:
                if time.monotonic() >= deadline:
                    raise ValueError(
                        f"kv_transfer_config: no KV producer answered at "
                        f"{self.address[0]}:{self.address[1]} within {timeout_s:g} s ({error})"
                    ) from error
                time.sleep(0.1)

    def _ask(self, request: dict) -> dict:
        self.conn.send_bytes(json.dumps(request).encode())
        return json.loads(self.conn.recv_bytes())

    def _check_facts(self) -> None:
        """Refuse a producer with another kind of cache, naming the first field."""
        theirs = self._ask({"op": "facts"})
        for name, value in asdict(self.facts).items():
            if theirs.get(name) != value:
                raise ValueError(
                    f"kv_transfer_config: the producer at {self.address[0]}:{self.address[1]} "
                    f"has {name}={theirs.get(name)!r}; this engine has {name}={value!r}"
                )

    def _has_entry(self, key: str) -> bool:
        return key in self.store.entries

    def get_kv_connector_stats(self) -> dict[str, float]:
        """What a producer's store served (the layers' bytes sent, counted once, by the
        scheduler's side), or what a consumer's worker received (its rank's share)."""
        if self.store is not None:
            if self.role is not KVConnectorRole.SCHEDULER:
                return {}
            return {"kv_connector_bytes_sent": self.store.bytes_sent}
        if self.role is KVConnectorRole.SCHEDULER:  # lookups only
            return {}
        return {
            "kv_connector_bytes_received": self.num_bytes_received,
            "kv_connector_recv_seconds": self.recv_seconds,
        }

    # -- scheduler side: how many tokens the producer holds --------------------------
    def _read_entry(self, key: str) -> tuple[int, dict]:
        """The prompt tokens the producer holds under ``key`` (0 if none, or if it
        cannot be reached: the consumer computes them, a warning); no blocks yet."""
        try:
            if self.conn is None:  # lost earlier: try once more
                self.conn = self._connect(0)
            return int(self._ask({"op": "lookup", "key": key}).get("num_tokens", 0)), {}
        except (EOFError, OSError, ValueError) as error:
            self.conn = None
            logger.warning("KV producer unreachable (%s): computing the prompt", error)
            return 0, {}

    # -- producer's worker side: entries in the store ---------------------------------
    def _put_layer(self, key: str, layer: str, tensors: dict[str, torch.Tensor]) -> None:
        self.store.partial.setdefault(key, {})[layer] = [
            tensors[str(i)] for i in range(len(tensors))
        ]

    def _commit(self, key: str, meta: dict) -> None:
        self.store.commit(key, meta["num_tokens"])

    # -- consumer's worker side: the blocks, layer by layer ----------------------------
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        """Ask for this step's blocks and receive them in a thread, layer by layer."""
        loads = self._get_connector_metadata().loads
        self._layer_loaded, self._load_error, self._loads = {}, None, loads
        if not loads:
            return
        caches = forward_context.kv_caches
        self._layer_loaded = {name: threading.Event() for name in caches}
        self._loader = threading.Thread(
            target=self._receive, args=(loads, caches), daemon=True, name="kv-loader"
        )
        self._loader.start()

    def _receive(self, loads: list[ReqMeta], caches: dict[str, tuple]) -> None:
        start = time.perf_counter()
        try:
            if self._worker_conn is None:
                self._worker_conn = self._connect(self.connect_timeout_s)
            conn = self._worker_conn
            heads = next(iter(caches.values()))[0].shape[2]  # this rank's share
            items = [[r.key, r.stored_blocks[0], r.stored_blocks[-1] + 1] for r in loads]
            own = [self.tp.rank * heads, (self.tp.rank + 1) * heads]
            conn.send_bytes(json.dumps({"op": "get", "items": items, "heads": own}).encode())
            header = json.loads(conn.recv_bytes())
            if "missing" in header:
                raise KVTransferError(f"the producer no longer holds entry {header['missing']}")
            with torch.inference_mode():
                for name in header["layers"]:
                    for req in loads:
                        data = conn.recv_bytes()
                        self.num_bytes_received += len(data)
                        copy_blocks(data, caches[name], req.block_ids, name)
                    self._layer_loaded[name].set()
        except BaseException as error:  # noqa: BLE001  the waits raise it on the main thread
            self._worker_conn, self._load_error = None, error
            for event in self._layer_loaded.values():
                event.set()
        finally:
            self.recv_seconds += time.perf_counter() - start

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s blocks are in this engine's cache, or the load
        failed (then this step's loads are marked failed, and the step runs on)."""
        event = self._layer_loaded.get(layer_name)
        if event is None or self._failed_blocks:  # nothing (more) to wait for
            return
        where = f"{self.address[0]}:{self.address[1]}"
        if not event.wait(self.load_timeout_s):
            conn, self._worker_conn = self._worker_conn, None
            if conn is not None:
                hang_up(conn)  # the thread's receive fails, and it ends
            error = KVTransferError(
                f"kv_transfer_config: the producer at {where} did not send layer "
                f"{layer_name!r}'s KV within load_timeout_s={self.load_timeout_s:g}"
            )
        elif self._load_error is not None:
            error = KVTransferError(
                f"kv_transfer_config: loading KV from the producer at {where} failed "
                f"({self._load_error!r})"
            )
        else:
            return
        if self.tp.rank:  # only rank 0 reports to the engine
            raise error
        logger.warning("%s: failing the requests that were loading", error)
        self._load_error = error
        self._failed_blocks = {b for req in self._loads for b in req.block_ids}

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def load_error(self) -> BaseException | None:
        return self._load_error

    def wait_for_save(self) -> None:
        """A consumer's: the receiving thread is done (every layer was waited for)."""
        if self._loader is not None:
            self._loader.join()
            self._loader = None
        super().wait_for_save()


def copy_blocks(data: bytes, kv_layer: tuple, block_ids: list[int], layer: str) -> None:
    """One layer's received blocks (`block_bytes`' layout) into this cache's
    ``block_ids``, each of its tensors in turn; a size other than those blocks' is
    refused."""
    shapes = [(len(block_ids), *cache.shape[1:]) for cache in kv_layer]
    sizes = [math.prod(s) * cache.element_size() for s, cache in zip(shapes, kv_layer)]
    if len(data) != sum(sizes):
        raise KVTransferError(f"layer {layer!r}: {len(data)} bytes received, {sum(sizes)} expected")
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offset = 0
    for cache, shape, size in zip(kv_layer, shapes, sizes):
        src = buffer[offset : offset + size].view(cache.dtype).view(shape)
        index = torch.tensor(block_ids, device=cache.device)
        cache.index_copy_(0, index, src.to(cache.device))
        offset += size

"""`P2pTcpConnector`: a prompt's KV pulled from the producer engine over TCP, between
two hosts (the CPU counterpart of vLLM V1's ``P2pNcclConnector``, which moves the same
blocks with NCCL between GPUs).

It keeps `SharedStorageConnector`'s entries and checks and changes only where they
live.  The producer (``kv_role="kv_producer"``) keeps each finished prompt's entry, its
blocks of every layer and a ``meta`` with their SHA-256 digests, in its own memory, the
oldest dropped once they pass ``kv_buffer_size`` bytes, and serves them from a thread
listening on ``kv_ip:kv_port``.  The consumer (``kv_role="kv_consumer"``) connects there
when it starts (for ``connect_timeout_s`` seconds, then it is refused), compares the
producer's `KVCacheFacts` with its own (a mismatch is refused at start-up, naming the
field), and, for each prompt it is asked, requests the entry by the prompt's hash: its
scheduler receives the meta and then one message per layer, checks each digest, and
hands the bytes to its worker, which copies them into whichever blocks its own
scheduler gave the sequence.  A peer that is gone or answers with a broken entry means
the consumer computes the prompt itself (a warning), never a wrong cache.

The messages are `multiprocessing.connection`'s (length-prefixed, authenticated);
requests and metas are JSON, the layers safetensors bytes.  One producer per process
and port: both of its connector instances (scheduler and worker) share its store.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from minipaged.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from minipaged.distributed.kv_transfer.kv_connector.v1.shared_storage_connector import (
    SharedStorageConnector,
)

logger = logging.getLogger(__name__)
AUTHKEY = b"minipaged-kv-transfer"
DEFAULT_CONNECT_TIMEOUT_S = 10.0


class ProducerStore:
    """A producer's entries in memory, by key (insertion order: the oldest is dropped
    first), served to consumers by a listening thread."""

    def __init__(self, facts: dict, address: tuple[str, int], capacity_bytes: int) -> None:
        self.facts, self.capacity = facts, capacity_bytes
        self.entries: collections.OrderedDict[str, tuple[dict, dict[str, bytes]]] = (
            collections.OrderedDict()
        )
        self.partial: dict[str, dict[str, bytes]] = {}
        self.num_bytes = 0  # held
        self.bytes_sent = 0  # the layers' bytes served to consumers
        self.lock = threading.Lock()
        self.listener = Listener(address, authkey=AUTHKEY)
        threading.Thread(target=self._accept, daemon=True, name="kv-producer").start()

    def commit(self, key: str, meta: dict) -> None:
        layers = self.partial.pop(key, {})
        with self.lock:
            self.entries[key] = (meta, layers)
            self.num_bytes += sum(len(b) for b in layers.values())
            while self.num_bytes > self.capacity and len(self.entries) > 1:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.num_bytes -= sum(len(b) for b in dropped.values())

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
                        continue
                    with self.lock:
                        entry = self.entries.get(request["key"])
                    if entry is None:
                        conn.send_bytes(b"{}")
                        continue
                    meta, layers = entry
                    conn.send_bytes(json.dumps(meta).encode())
                    for layer in meta["files"]:
                        conn.send_bytes(layers[layer])
                    with self.lock:  # one thread per consumer
                        self.bytes_sent += sum(len(layers[layer]) for layer in meta["files"])
            except (EOFError, OSError):  # the consumer went away
                return


def no_delay(conn: Connection) -> Connection:
    """Send each message at once (``TCP_NODELAY``): with Nagle's algorithm a message
    written right after another (the meta, then a small layer) waits for the peer's
    delayed acknowledgement, tens of milliseconds a request."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


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
        self.address = (config.kv_ip, config.kv_port)
        self.store, self.conn = None, None
        if config.is_kv_producer:  # kv_both is refused by KVTransferConfig
            self.store = producer_store(asdict(self.facts), self.address, config.kv_buffer_size)
        elif self.role is KVConnectorRole.SCHEDULER:  # the consumer's requests go from here
            extra = config.kv_connector_extra_config
            self.conn = self._connect(extra.get("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S))
            self._check_facts()

    def __getstate__(self) -> dict:
        """A copy for another tensor-parallel rank of this engine: its worker side
        saves and loads through rank 0, so it needs no store or connection."""
        return {**self.__dict__, "store": None, "conn": None}

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
        """A consumer's reads (`SharedStorageConnector`'s), or what a producer's store
        served: the layers' bytes sent to consumers."""
        if self.store is None:
            return super().get_kv_connector_stats()
        if self.role is not KVConnectorRole.SCHEDULER:  # one store, counted once
            return {}
        return {"kv_connector_bytes_sent": self.store.bytes_sent}

    def _load_entry(self, key: str) -> tuple[dict, dict[str, bytes]] | None:
        if self.conn is None:  # lost earlier: try once more
            self.conn = self._connect(0)
        try:
            meta = self._ask({"op": "get", "key": key})
            if not meta:
                return None
            return meta, {layer: self.conn.recv_bytes() for layer in meta["files"]}
        except (EOFError, OSError):
            self.conn = None  # a half-read answer: the next request reconnects
            raise

    def _put_layer(self, key: str, layer: str, data: bytes) -> None:
        self.store.partial.setdefault(key, {})[layer] = data

    def _commit(self, key: str, meta: dict) -> None:
        self.store.commit(key, meta)

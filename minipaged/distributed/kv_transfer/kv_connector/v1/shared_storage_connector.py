"""`SharedStorageConnector`: a prompt's KV in files under a directory both engines see
(vLLM V1's ``kv_connector/v1/shared_storage_connector.py``, its teaching connector).

The producer's worker writes, per prompt it finishes, one safetensors file per layer
holding the prompt's blocks only (``[num_blocks, block_size, ...]`` for each of the
layer's cache tensors: keys, values, and int8's scales), under a folder named by a hash
of the prompt's tokens; ``meta.json`` is written last, with each file's SHA-256, so a
folder without it (a save cut short) is never read.  The consumer's scheduler checks the
folder before trusting it (the files are there and their hashes match: a missing or
corrupt entry means the prompt is computed instead) and hands its worker the very bytes
it checked, so an entry changed or removed after the check never reaches the cache; the
worker copies the stored blocks into whichever blocks its own scheduler gave the
sequence: the block ids differ on each side, the logical order does not.

Only full blocks of the prompt are loaded, and never its last token, which the consumer
computes for the logits it samples from (vLLM does the same).  Loading is synchronous,
all layers in `start_load_kv`, as vLLM's connector does; `wait_for_layer_load` then has
nothing to wait for.  ``kv_cache_facts.json`` at the top records what both engines must
agree on (`KVCacheFacts`); an engine that disagrees is refused, naming the field.

With tensor parallelism each rank's cache holds its share of the KV heads (rank r the
r-th slice, dim 2 of every cache tensor).  An entry always holds every head, so the
two engines' sizes may differ (prefill on 2 ranks, decode on 1, or the other way):
a producer's ranks gather their slices on rank 0 (`TensorParallelGroup.gather`, over
gloo on a CPU), which writes the entry; a consumer's ranks each copy their own slice
of the entry, whose bytes came to every rank with the step's plan.  That is the
heterogeneous-TP case of vLLM's ``NixlConnector`` (each decode rank reads its slice of
the prefill's heads), done the simplest way; vLLM's ``P2pNcclConnector``, rank k to
rank k, needs equal sizes.  Heads replicated over ranks (more ranks than KV heads)
are refused at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save

from minipaged.core.memory.block_table import blocks_for
from minipaged.core.sched.output import SchedulerOutput
from minipaged.distributed.kv_transfer.kv_connector.v1.base import (
    ForwardContext,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from minipaged.sequence import Sequence

logger = logging.getLogger(__name__)
FACTS_FILE = "kv_cache_facts.json"
META_FILE = "meta.json"


@dataclass
class ReqMeta:
    """One sequence's transfer: its blocks here, and the stored blocks they hold."""

    seq_id: str
    key: str  # the folder: a hash of the prompt's tokens
    block_ids: list[int]
    stored_blocks: list[int]  # a load's block indices in the stored files
    num_tokens: int = 0  # a save's prompt length
    layers: dict[str, bytes] = field(default_factory=dict)  # a load's checked files


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    loads: list[ReqMeta] = field(default_factory=list)
    saves: list[ReqMeta] = field(default_factory=list)


def prompt_key(prompt_token_ids: list[int]) -> str:
    """The folder of a prompt's KV: a hash of its tokens (the same on both engines)."""
    return hashlib.sha256(json.dumps(prompt_token_ids).encode()).hexdigest()[:32]


class SharedStorageConnector(KVConnectorBase_V1):
    def __init__(self, config, role, facts) -> None:
        super().__init__(config, role, facts)
        self.block_size = facts.block_size
        # The scheduler's per-step state: matches waiting for their blocks, and loads.
        self._pending: dict[str, tuple[str, int, int, dict[str, bytes]]] = {}
        self._loads: list[ReqMeta] = []
        self._saved: dict[str, dict[str, str]] = {}  # the worker's: key -> layer -> sha256
        # Entries read this step: admission asks twice per prompt (to plan, then to
        # allocate), and a networked store would send the entry twice.
        self._read: dict[str, tuple[int, dict[str, bytes]]] = {}
        # The scheduler's reads from the store: the layers' bytes, and the seconds spent
        # fetching them (the transfer, not the checks after it).
        self.num_bytes_received, self.recv_seconds = 0, 0.0
        self._open_store()

    # -- where the entries live: a directory (a networked connector overrides these) ---
    def _open_store(self) -> None:
        self.root = Path(self.config.kv_connector_extra_config["shared_storage_path"])
        if self.role is KVConnectorRole.SCHEDULER:
            self._check_facts()

    def _has_entry(self, key: str) -> bool:
        return (self.root / key / META_FILE).is_file()

    def _load_entry(self, key: str) -> tuple[dict, dict[str, bytes]] | None:
        """An entry's ``meta.json`` and its layers' files, unchecked; None if absent."""
        folder = self.root / key
        if not (folder / META_FILE).is_file():
            return None
        meta = json.loads((folder / META_FILE).read_text())
        return meta, {
            layer: (folder / f"{layer}.safetensors").read_bytes() for layer in meta["files"]
        }

    def _put_layer(self, key: str, layer: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one layer's blocks of an entry (``"0"``, ``"1"``, ...: the layer's
        cache tensors, on the CPU) as a safetensors file, and remember its digest."""
        data = save(tensors)
        folder = self.root / key
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomically(folder / f"{layer}.safetensors", data)
        self._saved.setdefault(key, {})[layer] = _sha256(data)

    def _commit(self, key: str, meta: dict) -> None:
        _write_atomically(self.root / key / META_FILE, json.dumps(meta).encode())

    def _check_facts(self) -> None:
        """Refuse storage another kind of engine wrote (naming the first field that
        differs); a producer records its facts in new storage."""
        path, ours = self.root / FACTS_FILE, asdict(self.facts)
        if path.is_file():
            stored = json.loads(path.read_text())
            for name, value in ours.items():
                if stored.get(name) != value:
                    raise ValueError(
                        f"kv_transfer_config: the KV under {str(self.root)!r} was saved with "
                        f"{name}={stored.get(name)!r}; this engine has {name}={value!r}"
                    )
        elif self.config.is_kv_producer:
            self.root.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, json.dumps(ours, indent=1).encode())

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Sequence, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._pending.pop(request.seq_id, None)
        if not self.config.is_kv_consumer:
            return 0, False
        prompt = request.token_ids[: request.prompt_len]
        key = prompt_key(prompt)
        if key not in self._read:
            self._read[key] = self._read_entry(key)
        stored, layers = self._read[key]
        # Whole blocks, never the last token (its logits are sampled from).
        loadable = min(stored, len(prompt) - 1) // self.block_size * self.block_size
        num_new = max(0, loadable - num_computed_tokens)
        if num_new:
            self._pending[request.seq_id] = (key, num_computed_tokens, num_new, layers)
        return num_new, False

    def _read_entry(self, key: str) -> tuple[int, dict[str, bytes]]:
        """The prompt tokens stored under ``key`` and each layer's file, checked; 0 if
        none, or if the entry is incomplete or corrupt, or its peer unreachable (then
        the consumer computes them: a warning, no error)."""
        try:
            start = time.perf_counter()
            entry = self._load_entry(key)
            self.recv_seconds += time.perf_counter() - start
            if entry is None:
                return 0, {}
            meta, layers = entry
            self.num_bytes_received += sum(map(len, layers.values()))
            files = meta["files"]
            if len(files) != self.facts.num_layers:
                raise ValueError(
                    f"{len(files)} layers stored, the model has {self.facts.num_layers}"
                )
            for layer, digest in files.items():
                if _sha256(layers[layer]) != digest:
                    raise ValueError(f"layer {layer!r}'s file does not match its hash")
            return int(meta["num_tokens"]), layers
        except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
            logger.warning("stored KV %s is unusable (%s): computing it", key, error)
            return 0, {}

    def get_kv_connector_stats(self) -> dict[str, float]:
        """The scheduler's reads: bytes of the layers' files received, and seconds."""
        if self.role is not KVConnectorRole.SCHEDULER:
            return {}
        return {
            "kv_connector_bytes_received": self.num_bytes_received,
            "kv_connector_recv_seconds": self.recv_seconds,
        }

    def update_state_after_alloc(
        self, request: Sequence, blocks: list[int], num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.seq_id, None)
        if not num_external_tokens or pending is None:
            return
        key, start, num_new, layers = pending
        first, last = start // self.block_size, (start + num_new) // self.block_size
        blocks = list(blocks[first:last])
        self._loads.append(
            ReqMeta(request.seq_id, key, blocks, list(range(first, last)), layers=layers)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SharedStorageConnectorMetadata(self._loads, self._saves(scheduler_output))
        self._loads, self._pending, self._read = [], {}, {}
        return meta

    def _saves(self, scheduler_output: SchedulerOutput) -> list[ReqMeta]:
        """A producer's saves: each sequence whose prompt this step finishes, unless
        its prompt is stored already (by an earlier request, or a sibling now)."""
        if not self.config.is_kv_producer:
            return []
        saves = {}
        for s in scheduler_output.seqs:
            prompt_len = s.seq.prompt_len
            if s.group.lora_request is not None or not (
                s.start < prompt_len <= s.start + s.num_new_tokens
            ):
                continue
            key = prompt_key(s.seq.token_ids[:prompt_len])
            if key in saves or self._has_entry(key):
                continue
            blocks = list(s.block_table[: blocks_for(prompt_len, self.block_size)])
            saves[key] = ReqMeta(s.seq.seq_id, key, blocks, [], prompt_len)
        return list(saves.values())

    # -- worker side ------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        for req in self._get_connector_metadata().loads:
            stored_index = torch.tensor(req.stored_blocks)
            for layer, kv_layer in forward_context.kv_caches.items():
                stored = load(req.layers[layer])  # the bytes the scheduler checked
                for i, cache in enumerate(kv_layer):
                    src = self._own_heads(stored[str(i)][stored_index], cache)
                    if src.shape[1:] != cache.shape[1:] or src.dtype != cache.dtype:
                        raise ValueError(
                            f"stored KV of layer {layer!r} is {tuple(src.shape[1:])} "
                            f"{src.dtype}, this cache holds {tuple(cache.shape[1:])} {cache.dtype}"
                        )
                    index = torch.tensor(req.block_ids, device=cache.device)
                    cache.index_copy_(0, index, src.to(cache.device))

    def _own_heads(self, stored: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a stored tensor's KV heads (all of them on one rank)."""
        if self.tp.size == 1:
            return stored
        heads = cache.shape[2]
        return stored[:, :, self.tp.rank * heads : (self.tp.rank + 1) * heads]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` loaded every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: tuple, attn_metadata: Any) -> None:
        """Each saved prompt's blocks of this layer, every rank's heads gathered on rank
        0, which writes them (every rank takes part in the gather, in the same order)."""
        for req in self._get_connector_metadata().saves:
            index = torch.tensor(req.block_ids, device=kv_layer[0].device)
            tensors = {
                str(i): self.tp.gather(cache.index_select(0, index), dim=2)
                for i, cache in enumerate(kv_layer)
            }
            if self.tp.rank:
                continue
            self._put_layer(req.key, layer_name, {name: t.cpu() for name, t in tensors.items()})

    def wait_for_save(self) -> None:
        """The writes are done; rank 0 commits each entry with its ``meta.json``."""
        if self.tp.rank:
            return
        for req in self._get_connector_metadata().saves:
            meta = {"num_tokens": req.num_tokens, "files": self._saved.pop(req.key, {})}
            self._commit(req.key, meta)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` so a reader sees the whole file or none (a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)

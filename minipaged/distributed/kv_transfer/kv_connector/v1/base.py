"""The KV connector API, as vLLM V1's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

One class, two instances per engine, one per role:

- the **scheduler**'s asks, for a waiting sequence, how many of its prompt tokens
  beyond those it already holds (``num_computed_tokens``: its prefix-cache hit) exist
  elsewhere (`get_num_new_matched_tokens`); the scheduler gives those tokens blocks and
  counts them computed, and tells the connector which blocks it gave
  (`update_state_after_alloc`); once a step is formed, `build_connector_meta` turns
  what the workers must load and save into metadata, which travels in the
  `SchedulerOutput`; `request_finished` hears of each sequence whose blocks are freed;
- the **worker**'s gets that metadata each step (`bind_connector_metadata`), loads the
  KV before the forward pass needs it (`start_load_kv`, then `wait_for_layer_load`
  before each attention layer), saves each layer's after it is written
  (`save_kv_layer`) and waits for the saves to land after the pass (`wait_for_save`).
  With tensor parallelism every rank runs one (its ``tp``, which the model runner
  sets, says which of the KV heads its cache holds), from the metadata the driver
  broadcasts with each step's plan.

The scheduler and the model runner hold a connector but never import one: the engine
builds both (`minipaged.distributed.kv_transfer.kv_connector.factory`).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from minipaged.config import KVTransferConfig
from minipaged.core.sched.output import SchedulerOutput
from minipaged.distributed.parallel_state import TensorParallelGroup
from minipaged.sequence import Sequence


class KVTransferError(RuntimeError):
    """A load the scheduler counted on did not arrive (its producer went away, or was
    too slow): the step cannot complete."""


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B903 (a connector subclasses it with its own fields)
    """What one step asks of the worker side; each connector defines its own."""


@dataclass
class ForwardContext:
    """What the worker side sees of a step (vLLM's ``ForwardContext``): each attention
    layer's KV cache tensors, by layer name."""

    kv_caches: dict[str, tuple] = field(default_factory=dict)


@dataclass(frozen=True)
class KVCacheFacts:
    """What two engines must agree on for one's KV blocks to mean the same in the
    other's cache; a connector records them beside the KV and refuses a mismatch."""

    model: str
    block_size: int
    dtype: str
    kv_cache_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVConnectorBase_V1(ABC):  # noqa: N801 (vLLM's name)
    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, facts: KVCacheFacts
    ) -> None:
        self.config, self.role, self.facts = config, role, facts
        self._metadata: KVConnectorMetadata | None = None
        # The worker's rank among the engine's tensor-parallel ranks (`ModelRunner`
        # sets it): its cache holds its share of the KV heads only.
        self.tp = TensorParallelGroup()

    # -- worker side ------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def has_connector_metadata(self) -> bool:
        return self._metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._metadata is None:
            raise RuntimeError("no connector metadata bound for this step")
        return self._metadata

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        """Start loading this step's external KV into the blocks the scheduler gave it."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (before its attention runs)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: tuple, attn_metadata: Any) -> None:
        """Start saving ``layer_name``'s KV of this step's saved sequences (after the
        layer wrote its new keys and values)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save of this step has landed (after the forward pass)."""

    # -- scheduler side ---------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Sequence, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """How many prompt tokens of ``request`` past its ``num_computed_tokens`` can be
        loaded from elsewhere, and whether they load asynchronously (across steps)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Sequence, blocks: list[int], num_external_tokens: int
    ) -> None:
        """The scheduler gave ``request`` the block table ``blocks``, counting its next
        ``num_external_tokens`` tokens as loaded rather than computed."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """What the workers must load and save in the step ``scheduler_output`` forms;
        resets the connector's per-step state."""

    def request_finished(self, request: Sequence, block_ids: list[int]) -> tuple[bool, Any]:
        """``request``'s blocks are about to be freed; True would ask the scheduler to
        keep them until an asynchronous save finishes (never, for a synchronous
        connector), and the dict is what a peer needs to pull them."""
        return False, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of this step's loads that did not arrive (vLLM's hook of that
        name), forgotten once asked; the engine fails the requests that hold them."""
        return set()

    def load_error(self) -> BaseException | None:
        """Why this step's loads failed, to tell the requests (None if they did not)."""
        return None

    def get_kv_connector_stats(self) -> dict[str, float]:
        """What this side moved so far, as counters for the engine's stats (vLLM's
        hook of that name, whose ``KVConnectorStats`` this plain dict stands for)."""
        return {}

"""The LoRA adapters an engine knows: vLLM's ``add_lora``, ``remove_lora``, ``list_loras``.

A request names its adapter with a `LoRARequest`; the first request of an adapter (or
`LLMEngine.add_lora`) checks it by reading it into host memory, which refuses a
malformed directory with a ``ValueError`` naming the file before anything is queued.
Removing an adapter no request uses frees its device slot and its host copy.
"""

from __future__ import annotations

from minipaged.core.memory.lora_slots import LoRASlots
from minipaged.lora_request import LoRARequest
from minipaged.models.lora import LoRAModelManager
from minipaged.sequence import SequenceGroup


class Adapters:
    """Known adapters by id, over the driver's ``manager`` (None without
    ``enable_lora``) and the scheduler's ``slots``."""

    def __init__(
        self,
        manager: LoRAModelManager | None,
        slots: LoRASlots,
        requests: dict[str, SequenceGroup],
    ) -> None:
        self.manager, self.slots, self.requests = manager, slots, requests
        self.by_id: dict[int, LoRARequest] = {}

    def check(self, lora_request: LoRARequest | None) -> None:
        """Raise ``ValueError`` unless ``lora_request`` is None or an adapter this engine
        can serve (reading it, once, into host memory)."""
        if lora_request is None:
            return
        if self.manager is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r:.80}")
        known = self.by_id.get(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise ValueError(
                f"lora_int_id {known.lora_int_id} is adapter {known.lora_name!r} "
                f"({known.lora_path}); give {lora_request.lora_name!r} an id of its own"
            )
        self.manager.read(lora_request)

    def add(self, lora_request: LoRARequest) -> bool:
        """Check and remember an adapter; False if it was known already."""
        self.check(lora_request)
        if lora_request.lora_int_id in self.by_id:
            return False
        self.by_id[lora_request.lora_int_id] = lora_request
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter no unfinished request uses; False if it is unknown."""
        lora_request = self.by_id.get(lora_int_id)
        if lora_request is None:
            return False
        if users := [g.request_id for g in self.requests.values() if g.lora_id == lora_int_id]:
            raise ValueError(f"adapter {lora_request.lora_name!r} is in use by {users[:3]}")
        self.slots.unload(lora_int_id)
        self.manager.forget(lora_request)
        del self.by_id[lora_int_id]
        return True

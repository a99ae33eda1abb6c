"""LoRA adapter slots: which adapters sit on the device, and which may leave (Punica, S-LoRA).

A server with many fine-tuned adapters of one base model keeps only ``max_loras`` of them
on the device at once, each in a *slot*: one index of the stacked adapter weights every
LoRA layer holds (`minipaged.models.lora`).  A batch may mix tokens of every resident
adapter (and of the base model): each token carries its adapter's slot index, and one
gather-matmul applies them all (Punica, Chen et al. 2023, §3).

This is the bookkeeping, as data, like the KV cache manager's.  A request *holds* its
adapter's slot while it runs; a slot that no running request holds stays loaded, so an
adapter that comes back soon costs nothing, and is reused least recently used first
when another adapter needs room.  A request whose adapter cannot get a slot (all of
them held) waits in the scheduler until one is let go.  Adapter ids are vLLM's
``lora_int_id`` (``>= 1``); the base model needs no slot.

S-LoRA (Sheng et al. 2023, §4) goes further: adapter weights and KV blocks share one
paged pool, so a slot is not reserved ahead and the balance between adapters and KV
moves with the load.  Here the two pools are separate and fixed, as in vLLM: ``max_loras``
slots of ``max_lora_rank`` beside the KV pool.

Standard library only.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class LoRASlots:
    """``num_slots`` adapter slots: which adapter is in which, held or idle (LRU)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[int, int] = {}  # adapter id -> its slot, while resident
        self.holders: Counter[int] = Counter()  # adapter id -> running requests using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unheld; LRU first
        self._free = list(range(num_slots - 1, -1, -1))  # never used or unloaded; pop() = 0
        self.num_loads = 0

    def can_acquire(self, adapter_id: int | None) -> bool:
        """Could a request of ``adapter_id`` run now: the base model, an adapter already
        resident, or a slot free or idle to load it into?"""
        return (
            adapter_id is None or adapter_id in self.slot_of or bool(self._free) or bool(self._idle)
        )

    def acquire(self, adapter_id: int | None) -> tuple[int, bool]:
        """Hold ``adapter_id``'s slot for one more request; returns ``(slot, load)``,
        ``load`` saying the adapter must be loaded into the slot first.  The base model's
        slot is -1.  Raises ``ValueError`` if no slot can be had (see `can_acquire`)."""
        if adapter_id is None:
            return -1, False
        load = adapter_id not in self.slot_of
        if load:
            if not self.can_acquire(adapter_id):
                raise ValueError(
                    f"no slot for adapter {adapter_id}: all {self.num_slots} are in use"
                )
            self.slot_of[adapter_id] = self._take_slot()
            self.num_loads += 1
        self._idle.pop(adapter_id, None)
        self.holders[adapter_id] += 1
        return self.slot_of[adapter_id], load

    def release(self, adapter_id: int | None) -> None:
        """One request of ``adapter_id`` stopped running; the last leaves it idle, resident."""
        if adapter_id is None:
            return
        self.holders[adapter_id] -= 1
        if self.holders[adapter_id] == 0:
            del self.holders[adapter_id]
            self._idle[adapter_id] = None

    def unload(self, adapter_id: int) -> bool:
        """Free an idle adapter's slot (its adapter was removed); False if it is held or
        not resident."""
        if adapter_id in self.holders or adapter_id not in self.slot_of:
            return False
        del self._idle[adapter_id]
        self._free.append(self.slot_of.pop(adapter_id))
        return True

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        evicted, _ = self._idle.popitem(last=False)
        return self.slot_of.pop(evicted)

"""Where does KV memory go?  A step-by-step simulation of paged vs contiguous serving (§3, Fig. 2).

Requests from a workload are served first come, first served, one decode token per
running request per step, on one pool of KV slots.  After every step each slot is in
one of these states, and their averages over all steps are the shares of Fig. 2:

* **token states** - slots holding the KV of a token that exists;
* **reserved** - (contiguous) slots set aside for tokens the request will write later;
* **internal fragmentation** - slots a request holds but will never write
  (contiguous: reservation beyond the final length; paged: the rest of the last block);
* **external fragmentation** - (contiguous) free slots in gaps too small for the
  reservation of the request waiting at the head of the queue;
* everything else is free.

Averages are taken over the *saturated* steps, those in which a request is waiting:
then the pool is the bottleneck and every idle slot is a lost request.  (While the
queue drains at the end, free memory is no waste.)  A workload that never saturates
the pool is averaged over all its steps.

The paged system admits a request when its current tokens fit (keeping a 1% watermark
of blocks free) and grows one block at a time; when a block cannot be had, the most
recently admitted request is preempted by recompute: its blocks are freed and it waits
at the head of the queue to be admitted again (§4.5).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .block_table import blocks_for
from .contiguous import ContiguousAllocator, reservation_size
from .kv_cache_manager import KVCacheManager

if TYPE_CHECKING:  # the memory layer imports nothing of ours at run time
    from .workloads import RequestSpec

SYSTEMS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
# The paper's §6 setting: OPT-13B on an A100-40GB has about 12 GB for KV, 800 KB a token.
OPT13B_A100_SLOTS = 15_700


@dataclass
class MemoryReport:
    """Average shares of the KV pool per state, and the mean number of resident requests."""

    system: str
    token_share: float
    reserved_share: float
    internal_share: float
    external_share: float
    max_batch: float
    num_steps: int  # all steps, to serve the whole workload
    num_preemptions: int = 0

    @property
    def free_share(self) -> float:
        used = self.token_share + self.reserved_share + self.internal_share + self.external_share
        return max(0.0, 1.0 - used)  # not -0.0 from rounding


@dataclass
class _Request:
    rid: int
    spec: RequestSpec
    length: int = 0  # tokens in the KV cache now


@dataclass
class _Usage:
    tokens: int = 0
    reserved: int = 0
    internal: int = 0
    external: int = 0


@dataclass
class _Totals:
    usage: _Usage = field(default_factory=_Usage)
    resident: int = 0
    steps: int = 0

    def add(self, usage: _Usage, resident: int) -> None:
        for name in ("tokens", "reserved", "internal", "external"):
            setattr(self.usage, name, getattr(self.usage, name) + getattr(usage, name))
        self.resident += resident
        self.steps += 1


class _ContiguousSystem:
    def __init__(self, policy: str, num_slots: int, max_len: int) -> None:
        self.policy, self.max_len = policy, max_len
        self.pool = ContiguousAllocator(num_slots)
        self.num_slots = num_slots
        self.ranges: dict[int, tuple[int, int]] = {}  # rid -> (start, size)
        self.num_preemptions = 0

    def size(self, r: _Request) -> int:
        return reservation_size(self.policy, r.spec.prompt_len, r.spec.output_len, self.max_len)

    def check(self, r: _Request) -> None:
        if self.size(r) > self.num_slots:
            raise ValueError(
                f"num_slots={self.num_slots} cannot hold one reservation "
                f"of {self.size(r)} slots ({self.policy})"
            )

    def admit(self, r: _Request) -> bool:
        start = self.pool.reserve(self.size(r))
        if start is None:
            return False
        self.ranges[r.rid] = (start, self.size(r))
        r.length = r.spec.prompt_len
        return True

    def grow(self, running: list[_Request]) -> list[_Request]:
        for r in running:  # the reservation already covers every future token
            r.length += 1
        return []

    def finish(self, r: _Request) -> None:
        self.pool.release(self.ranges.pop(r.rid)[0])

    def usage(self, running: list[_Request], head: _Request | None) -> _Usage:
        u = _Usage()
        for r in running:
            size, final = self.ranges[r.rid][1], r.spec.total_len
            u.tokens += r.length
            u.reserved += final - r.length
            u.internal += size - final
        if head is not None:
            u.external = sum(gap for _, gap in self.pool.gaps() if gap < self.size(head))
        return u


class _PagedSystem:
    def __init__(self, num_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv = KVCacheManager(num_slots // block_size, block_size)
        self.num_slots = self.kv.gpu.num_blocks * block_size
        self.watermark = int(0.01 * self.kv.gpu.num_blocks)
        self.num_preemptions = 0

    def check(self, r: _Request) -> None:
        blocks = blocks_for(r.spec.total_len, self.block_size)
        if blocks > self.kv.gpu.num_blocks - self.watermark:
            raise ValueError(
                f"num_slots={self.num_slots} cannot hold one request of {r.spec.total_len} tokens"
            )

    def admit(self, r: _Request) -> bool:
        length = r.length or r.spec.prompt_len  # a preempted request recomputes all it had
        needed = blocks_for(length, self.block_size)
        if needed > self.kv.gpu.num_free_blocks - self.watermark:
            return False
        self.kv.allocate(str(r.rid), [0] * length)
        r.length = length
        return True

    def grow(self, running: list[_Request]) -> list[_Request]:
        preempted: list[_Request] = []
        for r in list(running):
            if r in preempted:
                continue
            while not self.kv.can_append(str(r.rid)):
                victim = running.pop()  # the most recently admitted
                self.kv.free(str(victim.rid))
                preempted.append(victim)
                self.num_preemptions += 1
                if victim is r:
                    break
            else:
                self.kv.append(str(r.rid), [0])
                r.length += 1
        return preempted

    def finish(self, r: _Request) -> None:
        self.kv.free(str(r.rid))

    def usage(self, running: list[_Request], head: _Request | None) -> _Usage:
        tokens = sum(r.length for r in running)
        held = sum(len(self.kv.tables[str(r.rid)].blocks) for r in running) * self.block_size
        return _Usage(tokens=tokens, internal=held - tokens)


def simulate_systems(
    requests: list[RequestSpec], num_slots: int, block_size: int = 16, max_len: int = 2048
) -> list[MemoryReport]:
    """`simulate_memory` of every system of `SYSTEMS` on the same ``requests``."""
    return [simulate_memory(requests, s, num_slots, block_size, max_len) for s in SYSTEMS]


def simulate_memory(
    requests: list[RequestSpec],
    system: str,
    num_slots: int,
    block_size: int = 16,
    max_len: int = 2048,
) -> MemoryReport:
    """Serve ``requests`` to completion on ``num_slots`` KV slots; report where memory went."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    if system == "paged":
        sim = _PagedSystem(num_slots, block_size)
    else:
        sim = _ContiguousSystem(system.removeprefix("contiguous-"), num_slots, max_len)
    waiting = deque(_Request(i, spec) for i, spec in enumerate(requests))
    for r in waiting:
        sim.check(r)
    running: list[_Request] = []
    saturated, every = _Totals(), _Totals()
    while waiting or running:
        while waiting and sim.admit(waiting[0]):
            running.append(waiting.popleft())
        waiting.extendleft(sim.grow(running))
        usage = sim.usage(running, waiting[0] if waiting else None)
        every.add(usage, len(running))
        if waiting:
            saturated.add(usage, len(running))
        for r in [r for r in running if r.length == r.spec.total_len]:
            sim.finish(r)
            running.remove(r)
    return _report(
        system,
        saturated if saturated.steps else every,
        sim.num_slots,
        every.steps,
        sim.num_preemptions,
    )


def _report(
    system: str, totals: _Totals, num_slots: int, num_steps: int, num_preemptions: int
) -> MemoryReport:
    steps = max(totals.steps, 1)
    u, denominator = totals.usage, steps * num_slots
    return MemoryReport(
        system,
        u.tokens / denominator,
        u.reserved / denominator,
        u.internal / denominator,
        u.external / denominator,
        totals.resident / steps,
        num_steps,
        num_preemptions,
    )

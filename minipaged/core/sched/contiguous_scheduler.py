"""The paper's baseline: Orca's contiguous reservations, as a scheduler (paper §3, §6.1).

Orca reserves, at admission, one contiguous range of KV slots for a request's whole
final length: the maximum length (``"contiguous-max"``), the final length rounded up to a
power of two (``"-pow2"``), or exactly the final length (``"-oracle"``).
`ContiguousScheduler` is the paged `Scheduler` with that one more admission rule: a
waiting request is admitted only if its range can be placed first-fit
(`ContiguousReservations`), and the range is held until it finishes or is aborted.
The ranges cover every token their requests can write, so nothing is ever preempted.
The KV stays paged underneath: the range decides who runs, never what is computed.

`minipaged.core.sched.scheduler.make_scheduler` gives it to an engine whose
``memory_mode`` asks for it.

Standard library only.
"""

from __future__ import annotations

from minipaged.config import MEMORY_MODES
from minipaged.core.memory import KVCacheManager
from minipaged.core.memory.contiguous import ContiguousReservations
from minipaged.core.sched.scheduler import Scheduler, width_of
from minipaged.sampling_params import BeamSearchParams, SamplingParams
from minipaged.sequence import SequenceGroup
from minipaged.trace import Trace

CONTIGUOUS_MODES = tuple(mode for mode in MEMORY_MODES if mode != "paged")


class ContiguousScheduler(Scheduler):
    """A `Scheduler` that also admits by contiguous reservations (``reservations``)
    over the GPU pool's slots, cut at ``max_model_len``."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        trace: Trace | None = None,
        max_model_len: int | None = None,
        *,
        memory_mode: str,
    ) -> None:
        if memory_mode not in CONTIGUOUS_MODES:
            raise ValueError(f"memory_mode must be one of {CONTIGUOUS_MODES}, got {memory_mode!r}")
        if max_model_len is None:
            raise ValueError(
                f"memory_mode={memory_mode!r} needs max_model_len (what "
                "reservations are cut at, and what Max reserves), got None"
            )
        super().__init__(
            kv, max_num_seqs, max_num_batched_tokens, preemption_mode, trace, max_model_len
        )
        self.memory_mode = memory_mode
        self.reservations = ContiguousReservations(
            memory_mode.removeprefix("contiguous-"), kv.num_gpu_blocks, kv.block_size, max_model_len
        )

    def check_fits(self, prompt_len: int, params: SamplingParams | BeamSearchParams) -> None:
        """Also refuse a request whose range could never fit the empty pool (it would
        wait forever)."""
        super().check_fits(prompt_len, params)
        name, width = width_of(params)
        slots = self.reservations.num_slots(prompt_len, params.max_tokens, width)
        pool = self.kv.num_gpu_blocks * self.kv.block_size
        if slots > pool:
            raise ValueError(
                f"memory_mode={self.memory_mode!r} reserves {slots} KV "
                f"slots for a {prompt_len}-token prompt with max_tokens="
                f"{params.max_tokens} and {name}={width}, more than the pool's "
                f"{pool} (num_gpu_blocks * block_size)"
            )

    def abort(self, request_id: str) -> SequenceGroup | None:
        group = super().abort(request_id)
        self.reservations.release(request_id)
        return group

    def retire(self, group: SequenceGroup) -> None:
        super().retire(group)
        self.reservations.release(group.request_id)

    def _can_admit(self, group: SequenceGroup, budget: int) -> bool:
        """The paged checks, then the range's placement: last, as the only check that
        changes anything."""
        return super()._can_admit(group, budget) and self.reservations.reserve(
            group.request_id,
            self.reservations.num_slots(
                len(group.prompt_token_ids), group.params.max_tokens, group.width
            ),
        )

"""The event trace: what the engine did to each request's memory, step by step.

Switched on with ``LLM(..., trace=True)``, the scheduler records one `Event` per memory
operation (allocate, append, free, fork, CoW copy, swap out, swap in, preempt) and per
lifecycle moment (arrive, schedule, sample, finish, abort): every one of them goes
through it, so the trace is recorded in one place.  Lessons draw a request's
journey from it (`minipaged.viz.draw_request_journey`); tests read it to check the order
of things.  Off, recording costs one attribute test.

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EVENT_KINDS = (
    "arrive",
    "schedule",
    "allocate",
    "append",
    "cow",
    "fork",
    "sample",
    "preempt",
    "swap_out",
    "swap_in",
    "free",
    "finish",
    "abort",
)


@dataclass(frozen=True)
class Event:
    """One thing that happened at engine step ``step``.

    ``kind`` is one of `EVENT_KINDS`; ``seq_id`` is None for events about the whole
    request (arrive, preempt, finish); ``detail`` holds what the kind needs, e.g.
    ``{"num_tokens": 7, "blocks": [3, 4]}`` for an allocate.
    """

    step: int
    kind: str
    request_id: str
    seq_id: str | None = None
    detail: dict = field(default_factory=dict)


class Trace:
    """A list of events, or nothing at all when disabled."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.events: list[Event] = []
        self.step = 0

    def record(self, kind: str, request_id: str, seq_id: str | None = None, **detail) -> None:
        if self.enabled:
            self.events.append(Event(self.step, kind, request_id, seq_id, detail))

    def of(self, request_id: str) -> list[Event]:
        """One request's events, in order."""
        return [e for e in self.events if e.request_id == request_id]

    def clear(self) -> None:
        self.events.clear()

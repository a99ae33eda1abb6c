"""A step's sample phase in which a request whose sampling raises fails alone.

A server batches many clients' requests into one step; an error while sampling one of
them (a bug, or sampling parameters the checks let through) must not fail the others.
`sample_failing_alone` runs the sample phase over the whole batch, as usual; only if
that raises does it draw again request by request, and report those that raise again.
The sample phase changes no request (the update phase applies what it chose), so a
retry only needs the random streams put back where the failed attempt found them
(`RandomStreams`).  The engine aborts the requests that failed, through its public
`LLMEngine.abort_request`; `LLM.generate` does not ask for any of this: its caller hears
the error.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from minipaged.core.sched.output import ScheduledSeq, StepSamples, logit_rows
from minipaged.sequence import SequenceGroup

SamplePhase = Callable[[list[ScheduledSeq], torch.Tensor], StepSamples]


def sample_failing_alone(
    sample: SamplePhase,
    sampling: list[ScheduledSeq],
    logits: torch.Tensor,
    generator: torch.Generator,
) -> tuple[StepSamples, dict[str, Exception]]:
    """``sample(sampling, logits)`` over the whole batch (the fast path); if it raises,
    over each request's rows on its own.  Returns what the requests that did not raise
    chose, and the errors of those that did, by request id.  ``generator``: the stream
    of the requests without a seed."""
    streams = RandomStreams(sampling, generator)
    try:
        return sample(sampling, logits), {}
    except Exception:  # noqa: BLE001  any error; each request is tried alone below
        streams.restore()
    rows: dict[SequenceGroup, list[int]] = defaultdict(list)
    for i, scheduled in enumerate(sampling):
        rows[scheduled.group].append(i)
    spans = logit_rows(sampling)  # one row each, more where guesses are verified
    chosen, failed = StepSamples(), {}
    for group, group_rows in rows.items():
        try:
            chosen.extend(
                sample(
                    [sampling[i] for i in group_rows],
                    logits[[row for i in group_rows for row in spans[i]]],
                )
            )
        except Exception as error:  # noqa: BLE001  the engine aborts it
            failed[group.request_id] = error
    return chosen, failed


class RandomStreams:
    """The states of the generators a batch draws from (each seeded sequence's own, and
    the shared one), saved so a failed attempt's draws can be taken back."""

    def __init__(self, sampling: list[ScheduledSeq], generator: torch.Generator) -> None:
        generators = [s.seq.generator for s in sampling if s.seq.generator is not None]
        self.states = [(g, g.get_state()) for g in [*generators, generator]]

    def restore(self) -> None:
        for generator, state in self.states:
            generator.set_state(state)

"""A step's update in which a request whose sampling raises fails alone.

A server batches many clients' requests into one step; an error while sampling one of
them (a bug, or sampling parameters the checks let through) must not fail the others.
`update_failing_alone` runs the engine's update over the whole batch, as usual; only if
that raises does it undo what the update began (`UpdateSnapshot`: forks, random draws)
and update each request on its own, aborting those that raise again.  `LLM.generate`
does not ask for this: its caller hears the error.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from minipaged.batch import ScheduledSeq, logit_rows
from minipaged.sequence import SequenceGroup


def update_failing_alone(
    engine, sampling: list[ScheduledSeq], logits: torch.Tensor
) -> dict[str, Exception]:
    """``engine._update`` over the whole batch (the fast path); if it raises, undo what
    it began and update each request on its own.  Returns the requests that raised, by
    id, each aborted (its blocks freed).  An error after tokens were appended cannot be
    undone and propagates."""
    saved = UpdateSnapshot(engine, sampling)
    try:
        engine._update(sampling, logits)
        return {}
    except Exception:
        if not saved.restore():
            raise
    rows: dict[SequenceGroup, list[int]] = defaultdict(list)
    for i, scheduled in enumerate(sampling):
        rows[scheduled.group].append(i)
    spans = logit_rows(sampling)  # one row each, more where guesses are verified
    failed = {}
    for group, group_rows in rows.items():
        try:
            engine._update(
                [sampling[i] for i in group_rows],
                logits[[row for i in group_rows for row in spans[i]]],
            )
        except Exception as error:  # noqa: BLE001  any error; the abort frees its blocks
            failed[group.request_id] = error
            engine.abort_request(group.request_id)
    return failed


class UpdateSnapshot:
    """What `LLMEngine._update` changes before it appends a token, saved so a batch
    that raised can be replayed request by request: each request's sequences (a prompt
    with ``n`` > 1 forks) and the random generators' states (draws already made)."""

    def __init__(self, engine, sampling: list[ScheduledSeq]) -> None:
        self.engine = engine
        self.groups = {s.group: list(s.group.seqs) for s in sampling}
        seqs = [seq for group_seqs in self.groups.values() for seq in group_seqs]
        self.lengths = [len(seq.token_ids) for seq in seqs]
        self.generators = [
            (seq.generator, seq.generator.get_state()) for seq in seqs if seq.generator is not None
        ]
        self.generators.append((engine.generator, engine.generator.get_state()))
        self.num_generated_tokens = engine.num_generated_tokens

    def restore(self) -> bool:
        """Put everything back; False (changing nothing) if a token was appended."""
        seqs = [seq for group_seqs in self.groups.values() for seq in group_seqs]
        if [len(seq.token_ids) for seq in seqs] != self.lengths or any(
            group.seqs[: len(kept)] != kept for group, kept in self.groups.items()
        ):
            return False
        for group, kept in self.groups.items():
            for child in group.seqs[len(kept) :]:  # forked by the failed attempt
                self.engine.scheduler.free_seq(group, child)
            del group.seqs[len(kept) :]
        for generator, state in self.generators:
            generator.set_state(state)
        self.engine.num_generated_tokens = self.num_generated_tokens
        return True

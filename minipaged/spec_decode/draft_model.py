"""The draft-model proposer: a smaller model of the same vocabulary guesses, greedily,
over a paged KV cache of its own.

The draft keeps, per target sequence, a block table in its own pool (a second
`KVCacheManager`: the same block size, as many blocks, the same ``kv_cache_dtype``; the
engine sizes both pools together) and the KV of the tokens it has seen.  To guess
``k`` tokens it runs one pass over the tokens it has not seen yet (the whole prompt the
first time; after that the token the target added and the guesses it accepted), takes
the argmax, then ``k - 1`` one-token passes, each feeding its last guess back.

Rolling back needs no message from the verifier: the draft's block table remembers the
token ids it holds, so before guessing it keeps the longest common prefix of those and
the sequence's real tokens (`KVCacheManager.rollback`), which drops exactly its KV of
the rejected guesses.  A sequence the draft's pool has no room for gets no guesses
(it decodes one token at a time); the draft lets go of the KV of every sequence that
left the running batch (`release`).
"""

from __future__ import annotations

import torch

from minipaged.core.memory import KVCacheManager
from minipaged.core.sched.output import ScheduledSeq
from minipaged.models.attention import allocate_kv_caches
from minipaged.sequence import Sequence
from minipaged.worker.model_runner import ModelRunner

__all__ = ["DraftModelProposer"]


class DraftModelProposer:
    """Greedy guesses from ``model`` (already loaded) over ``num_blocks`` blocks of its
    own, which store ``kv_cache_dtype`` as the target's do (fp8 too)."""

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.runner = ModelRunner(model, block_size, device)
        self.kv = KVCacheManager(num_blocks, block_size)
        self.caches = allocate_kv_caches(model, num_blocks, block_size, kv_cache_dtype, device)

    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` greedy guesses after ``seqs[i]``'s tokens (none if the
        draft's pool cannot hold them)."""
        rows = [_Row(seq.seq_id, list(seq.token_ids), k) for seq, k in zip(seqs, ks)]
        # The first pass: each sequence's tokens the draft has not seen yet.
        live = [r for r in rows if self._catch_up(r)]
        for _ in range(max(ks, default=0)):
            if not live:
                break
            self._run(live)
            live = [r for r in live if len(r.guesses) < r.k and self._feed_back(r)]
        return [r.guesses for r in rows]

    def release(self, keep: set[str]) -> None:
        """Let go of the KV of every sequence not in ``keep``."""
        for seq_id in [s for s in self.kv.tables if s not in keep]:
            self.kv.free(seq_id)

    # -- one sequence's table -----------------------------------------------------------
    def _catch_up(self, row: _Row) -> bool:
        """Slots for the tokens of ``row`` the draft has not seen (always the last one,
        which it must run to guess after it); False if its pool has no room."""
        tokens, kv = row.tokens, self.kv
        if row.seq_id in kv.tables:
            held = kv.tables[row.seq_id].token_ids
            common = next(
                (i for i, (a, b) in enumerate(zip(held, tokens)) if a != b),
                min(len(held), len(tokens)),
            )
            kv.rollback(row.seq_id, min(common, len(tokens) - 1))
            start = kv.num_tokens(row.seq_id)
            if not kv.can_append(row.seq_id, len(tokens) - start):
                return False
            allocation = kv.append(row.seq_id, tokens[start:])
        else:
            if not kv.can_allocate(tokens):
                return False
            start, allocation = 0, kv.allocate(row.seq_id, tokens)
        row.schedule(start, allocation)
        return True

    def _feed_back(self, row: _Row) -> bool:
        """Slots for ``row``'s last guess, to guess after it; False if there is no room."""
        if not self.kv.can_append(row.seq_id, 1):
            return False
        row.tokens.append(row.guesses[-1])
        row.schedule(len(row.tokens) - 1, self.kv.append(row.seq_id, [row.guesses[-1]]))
        return True

    def _run(self, rows: list[_Row]) -> None:
        """One forward pass of the draft over every row's scheduled tokens; each row
        gains its argmax guess."""
        sampling, logits = self.runner.execute([r.scheduled for r in rows], self.caches)
        by_step = {id(s): r for s, r in zip([r.scheduled for r in rows], rows)}
        for s, token in zip(sampling, logits.argmax(dim=-1).tolist()):
            by_step[id(s)].guesses.append(token)


class _Row:
    """One sequence's guessing in progress: its tokens as the draft sees them (the real
    ones, then the guesses fed back), how many guesses it wants, the step to run."""

    def __init__(self, seq_id: str, tokens: list[int], k: int) -> None:
        self.seq_id, self.tokens, self.k = seq_id, tokens, k
        self.guesses: list[int] = []
        self.scheduled: ScheduledSeq | None = None

    def schedule(self, start: int, allocation) -> None:
        """The draft's next pass runs its tokens from ``start`` on, in ``allocation``'s
        slots; the logits after the last one give the next guess (no request group:
        the draft samples for no request)."""
        self.scheduled = ScheduledSeq(
            seq=Sequence(self.seq_id, self.tokens, len(self.tokens)),
            group=None,
            start=start,
            num_new_tokens=len(self.tokens) - start,
            block_table=allocation.block_table,
            slot_mapping=allocation.slot_mapping,
            samples=True,
        )

"""Lesson 05: the scheduler's admission of a waiting request (paper §4.5).

Write ``admission_plan``, the method of `minipaged.core.sched.scheduler.Scheduler` that sizes a
waiting request's first chunk: how many of each sequence's prompt tokens it can
compute this step.  ``self.kv.num_cached_tokens(token_ids)`` says how many leading
tokens the prefix cache already holds (0 without prefix caching); those are not
computed again.  The scheduler then admits the request only if the plan's blocks are
free, so a long prompt is *chunked* (chunked prefill) rather than refused.

Check with ``make check LESSON=05``.
"""

from minipaged.core.sched.scheduler import _later  # noqa: F401  (tokens to leave for later sequences)
from minipaged.sequence import Sequence


def admission_plan(self, seqs: list[Sequence], budget: int) -> list[tuple[Sequence, int]] | None:
    """First-chunk sizes ``[(seq, n), ...]`` for a waiting request's sequences, or
    ``None`` if the token budget cannot give each of them at least one token.

    Sequence ``k`` gets its uncached prompt tokens (``seq.token_ids`` minus the cached
    ones), but no more than the budget left, minus one token for each sequence after
    it (``_later(seqs, k)``): a recomputed request's last sequences must not starve.
    Each plan entry spends its tokens from the budget.
    """
    raise NotImplementedError("write admission_plan() in exercises/admission.py")

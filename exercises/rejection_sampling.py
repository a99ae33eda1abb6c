"""Lesson 13: modified rejection sampling, which makes speculation lossless (Leviathan et
al. 2023, §2.3; Chen et al. 2023, Algorithm 2).

Write ``modified_rejection_sampling``, the rule `minipaged.sample.rejection_sampler`'s
``rejection_sample`` applies once it has checked the shapes.  A draft drew guess ``x_i``
from its distribution ``q_i``; the target's distribution at the same position is
``p_i = target_probs[i]``.  For ``i = 1..k``: accept ``x_i`` with probability
``min(1, p_i(x_i) / q_i(x_i))`` and go on; on the first rejection, draw the token from
the residual ``max(0, p_i - q_i)`` (normalised) instead, and stop.  If all ``k`` are
accepted, draw a bonus token from ``p_{k+1} = target_probs[k]``.

Draw tokens with ``_draw(weights, generator)`` (given): one token from unnormalised
weights, without a random number when one weight alone is non-zero.  Draw the uniform
number of an acceptance test with ``torch.rand((), generator=generator)``, and only
when the outcome is uncertain (``0 < p < q``): a greedy request's ``p`` is 0 or 1, and
it must consume no randomness, so that it gives the same tokens as without a draft.
Check with ``make check LESSON=13``.
"""

import torch

from minipaged.sample.rejection_sampler import _draw  # noqa: F401  (use it)


def modified_rejection_sampling(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """One sequence's verified tokens: the accepted guesses, then one drawn token
    (between 1 and ``k + 1`` tokens in all).

    ``target_probs [k + 1, vocab]``: the target's distribution at each guess's position
    and after the last one; ``draft_token_ids``: the ``k`` guesses; ``draft_probs [k,
    vocab]``: the distribution each guess was drawn from, or None when each was all on
    its guess (a greedy draft: ``q_i(x_i) = 1``, 0 elsewhere); ``generator``: the
    sequence's random stream.
    """
    raise NotImplementedError(
        "write modified_rejection_sampling() in exercises/rejection_sampling.py"
    )

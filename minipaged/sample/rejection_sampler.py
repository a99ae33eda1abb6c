"""Modified rejection sampling: a draft's guesses checked against the target, losslessly.

A draft proposed tokens ``x_1..x_k`` for a sequence, drawing ``x_i`` from its own
distribution ``q_i``; one forward pass of the target over the sequence's last token
and the guesses gives its distributions ``p_1..p_{k+1}`` at the same positions (each
after the real tokens and the guesses before it).  Then, for ``i = 1..k``
(Leviathan et al. 2023, §2.3; Chen et al. 2023, Algorithm 2):

- accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``, and go on;
- on the first rejection, draw the token from the residual ``norm(max(0, p_i - q_i))``
  instead, and stop;
- if all ``k`` were accepted, draw one more, the *bonus* token, from ``p_{k+1}``.

Each emitted token is distributed exactly as ``p`` says: the chance of emitting ``x``
at a position is ``q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) r(x)`` with
``r`` the residual, which adds up to ``p(x)``.  So the output has the target's
distribution whatever the draft proposes; a bad draft only lowers the acceptance rate.

A greedy request's ``p`` is all on the argmax, so a guess is accepted exactly when it
is the target's argmax, and the token after the last accepted one is the argmax: the
same tokens as decoding without a draft.  A draft that guesses greedily (the n-gram
proposer, the draft model here) has a ``q`` all on its guess: ``draft_probs=None``.
"""

from __future__ import annotations

import torch

__all__ = ["rejection_sample"]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """One sequence's verified tokens: the accepted guesses, then one token drawn by the
    rule above (so between 1 and ``k + 1`` tokens).

    Args:
        target_probs: ``[k + 1, vocab]``, the target's distribution at the position of
            each guess and after the last one.
        draft_token_ids: the ``k`` guesses.
        draft_probs: ``[k, vocab]``, the distribution each guess was drawn from; None:
            each all on its guess (a greedy or n-gram draft).
        generator: the sequence's random stream (a seeded request's own).
    """
    k = len(draft_token_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"target_probs must be [k + 1, vocab] for k={k} draft tokens, "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [k, vocab] = [{k}, {target_probs.shape[1]}], "
            f"got {tuple(draft_probs.shape)}"
        )
    return _modified_rejection_sampling(target_probs, draft_token_ids, draft_probs, generator)


def _modified_rejection_sampling(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """The rule of the module's docstring on well-formed arguments (`rejection_sample`'s):
    vLLM's ``RejectionSampler._batch_modified_rejection_sampling``, one sequence at a
    time.  An outcome that is certain draws no random number."""
    k = len(draft_token_ids)
    accepted: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = target_probs[i]
        q = _point_mass(x, p) if draft_probs is None else draft_probs[i]
        if _accepts(float(p[x]), float(q[x]), generator, p.device):
            accepted.append(x)
            continue
        return [*accepted, _draw(_residual(p, q), generator)]
    return [*accepted, _draw(target_probs[k], generator)]


def _accepts(p: float, q: float, generator, device) -> bool:
    """``u < p / q`` for a uniform ``u``; certain ways drawn no number (a greedy
    request's ``p`` is 0 or 1, so it consumes no randomness)."""
    if p >= q:
        return True
    if p == 0.0:
        return False
    return float(torch.rand((), generator=generator, device=device)) * q < p


def _point_mass(token_id: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token_id] = 1.0
    return q


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``: where the target wants more than the draft offered.
    Never empty after a rejection, which needs ``p(x) < q(x)`` somewhere and so
    ``p(y) > q(y)`` elsewhere (both sum to 1)."""
    residual = (p - q).clamp_(min=0)
    return residual if residual.sum() > 0 else p  # (p == q up to rounding)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (unnormalised weights); a one-hot row without a draw,
    so that a greedy request consumes no randomness."""
    nonzero = probs.nonzero()
    if len(nonzero) == 1:
        return int(nonzero[0, 0])
    return int(torch.multinomial(probs, 1, generator=generator)[0])

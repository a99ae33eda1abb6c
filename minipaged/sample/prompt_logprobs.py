"""Prompt logprobs: how likely the model finds each token of a prompt (vLLM's
``SamplingParams.prompt_logprobs``).

A forward pass over a prompt already computes a hidden state at every position; the
engine projects only the last one to logits, to sample from.  Projecting position ``p``
too and taking its ``log_softmax`` gives the logprob of prompt token ``p + 1`` given the
tokens before it.  That is how an evaluation harness scores a multiple-choice answer:
the context and the answer as one prompt, one prefill, and the sum of the answer
tokens' logprobs (lm-evaluation-harness's ``loglikelihood``).

The positions a step must score are the scheduler's decision
(`SequenceGroup.prompt_logprob_positions`): with chunked prefill a prompt's entries
arrive chunk by chunk, and a prompt re-run after a recompute preemption adds none twice.
A request that asks for them does not read the prefix cache, as in vLLM (a block served
from the cache was never run, so it has no logits); it still fills the cache for others.

Memory stays bounded whatever the prompt's length: the rows are projected
``rows_per_chunk`` at a time (vLLM chunks them too), never a ``[prompt_len, vocab]``
tensor at once.  With tensor parallelism every rank projects the same chunks (the
logits are gathered across ranks); only rank 0 gets them, and keeps the entries.
"""

from __future__ import annotations

import torch

from minipaged.sequence import SequenceGroup

# The most bytes of float32 logits one chunk of rows may take.
CHUNK_BYTES = 32 * 2**20


def rows_per_chunk(vocab_size: int) -> int:
    """How many positions' logits fit in ``CHUNK_BYTES`` (at least one)."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, rows: list[int], scored: list[tuple[SequenceGroup | None, int]]
) -> None:
    """Score prompt tokens: row ``rows[i]`` of ``hidden`` (a step's new tokens, one row
    each) at position ``p`` scores prompt token ``p + 1`` of request ``scored[i] =
    (group, p + 1)`` (the step's ``prompt_logprob_positions``), appending one
    ``{token_id: logprob}`` to its ``prompt_logprobs``: the prompt token first, then the
    request's ``prompt_logprobs`` most likely tokens, best first (the shape of the
    sampler's logprobs).  A group is None on a tensor-parallel rank other than 0, which
    projects the rows (a collective) but keeps nothing."""
    chunk = rows_per_chunk(model.config.vocab_size)
    for first in range(0, len(rows), chunk):
        index = torch.tensor(rows[first : first + chunk], device=hidden.device)
        logits = model.compute_logits(hidden[index])
        if logits is not None:  # None on tensor-parallel ranks other than 0
            _append_entries(logits, scored[first : first + chunk])


def _append_entries(logits: torch.Tensor, scored: list[tuple[SequenceGroup, int]]) -> None:
    """One entry per row of ``logits``, appended to its request (a request's rows are
    its next prompt tokens, in order)."""
    groups = [g for g, _ in scored]
    targets = [g.prompt_token_ids[t] for g, t in scored]
    lse = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, torch.tensor(targets, device=logits.device)[:, None])[:, 0]
    chosen = (chosen - lse).tolist()
    # log_softmax only shifts a row, so the top logits are the top logprobs.
    top = logits.topk(min(max(g.params.prompt_logprobs for g in groups), logits.shape[1]))
    top_ids, top_values = top.indices.tolist(), (top.values - lse[:, None]).tolist()
    for group, target, logprob, ids, values in zip(groups, targets, chosen, top_ids, top_values):
        k = group.params.prompt_logprobs
        group.prompt_logprobs.append({target: logprob, **dict(zip(ids[:k], values[:k]))})

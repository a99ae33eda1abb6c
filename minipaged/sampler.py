"""The sampler: one new token per sequence from a batch of logits (vLLM's ``Sampler``).

Row ``i`` of ``logits [N, vocab]`` is one sequence sampled this step, with its own
``SamplingParams``.  Per row, in the order of vLLM's V0 sampler and of Hugging Face
(vLLM V1 applies min-p before top-k and top-p, which differs only when top-p and min-p
are both set):

1. a greedy row (temperature 0) takes the argmax of its raw logits;
2. any other row divides its logits by its temperature, then drops tokens (logit -inf)
   by top-k, then top-p on what top-k left, then min-p (`filter_logits`), and
3. draws a token from the softmax of what is left.

Randomness: a row whose request has a seed draws from that sequence's own
``torch.Generator`` (`make_generator`), which the engine keeps across steps; its tokens
are then the same whatever else shares the batch, as vLLM guarantees for seeded
requests.  Unseeded rows share one generator and are drawn in one batched call.

Logprobs describe the model, not the sampling knobs: they are ``log_softmax`` of the raw
logits, before temperature, top-k, top-p and min-p, which is what vLLM returns by default
(``logprobs_mode="raw_logprobs"``).  So a greedy and a sampled request over the same
prompt report the same numbers for the same tokens.

Beam search (paper §4.4) samples nothing: `beam_candidates` gives each beam's best next
tokens and the engine ranks them by cumulative logprob.

The sampler knows tensors and per-row parameters, never requests or the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minipaged.sampling_params import SamplingParams

__all__ = ["SamplerOutput", "BeamCandidates", "make_generator", "sample", "filter_logits",
           "beam_candidates"]


@dataclass
class SamplerOutput:
    """The step's result, one entry per row of the logits.

    Attributes:
        token_ids: the chosen token of each row.
        logprobs: the chosen token's log-probability under the raw logits, for every row
            (the engine sums them into ``cumulative_logprob``).
        top_logprobs: None for rows whose ``logprobs`` is None; otherwise
            ``{token_id: logprob}`` holding the chosen token first, then the
            ``logprobs`` most likely tokens, best first: ``logprobs + 1`` entries, or
            ``logprobs`` when the chosen token is among them (vLLM's per-step dict).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


class BeamCandidates(NamedTuple):
    """Each row's best next tokens, best first: both ``[N, min(2 * beam_width, vocab)]``."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded sequence, on the device of the logits it will sample.

    Keep it for the sequence's whole life: each step advances it.  For ``n > 1`` vLLM seeds
    completion ``i`` of a request with ``seed + i``, so the ``n`` completions differ.
    """
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None] | None = None,
           generator: torch.Generator | None = None) -> SamplerOutput:
    """Choose the next token of every row of ``logits [N, vocab]``.

    Args:
        logits: the model's last-position logits, one row per sequence (cast to float32).
        params: each row's sampling parameters.
        generators: each row's own generator (`make_generator`), or None for rows that
            draw from the shared one; None for all rows if omitted.
        generator: the shared generator of the unseeded rows (torch's default if None).
    """
    _check_inputs(logits, params, generators)
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)  # greedy rows keep this; the rest are overwritten
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = _sampling_probs(logits[rows], [params[i] for i in rows])
        row_generators = [generators[i] for i in rows] if generators else [None] * len(rows)
        token_ids[rows] = _draw(probs, row_generators, generator)
    lse = logits.logsumexp(dim=-1)
    chosen = logits.gather(1, token_ids[:, None]).squeeze(1) - lse
    token_ids, chosen = token_ids.tolist(), chosen.tolist()
    return SamplerOutput(token_ids, chosen, _top_logprobs(logits, lse, token_ids, chosen, params))


def filter_logits(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float],
                  min_p: Sequence[float]) -> torch.Tensor:
    """``logits [N, vocab]`` with the tokens each row's filters drop set to -inf.

    Per row, in the module's order: top-k keeps tokens whose logit is at least the k-th
    largest (ties at the boundary stay, so a few more than k may remain; ``top_k`` <= 0
    is off); top-p then keeps a token if the probability of the tokens above it,
    renormalised over what top-k kept, is below ``top_p`` (the smallest nucleus reaching
    ``top_p``, never empty; 1 is off); min-p then drops tokens less likely than ``min_p``
    times the most likely one (0 is off).  A step no row uses is skipped.
    """
    _check_logits(logits)
    for name, values in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        _check_rows(name, values, logits)
    vocab = logits.shape[1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1 for p in top_p)
    if use_k or use_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if use_k:
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k],
                             device=logits.device)
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -torch.inf)
        if use_p:
            p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)[:, None]
            probs = sorted_logits.softmax(dim=-1)
            mass_above = probs.cumsum(dim=-1) - probs
            # `p < 1` keeps rows with top-p off exact: a cumsum that rounds up to 1 before
            # the last token must not drop that row's tail, or a seeded row would sample
            # differently depending on its batch.
            sorted_logits = sorted_logits.masked_fill((mass_above >= p) & (p < 1), -torch.inf)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, dtype=logits.dtype, device=logits.device)[:, None]
        # p / p_max is the same before and after renormalising, so the probabilities of
        # what top-k and top-p kept give vLLM's threshold.
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < m * probs.amax(dim=-1, keepdim=True), -torch.inf)
    return logits


def beam_candidates(logits: torch.Tensor, beam_width: int) -> BeamCandidates:
    """Each row's ``2 * beam_width`` most likely next tokens under ``log_softmax(logits)``.

    Twice the width, as in vLLM and Hugging Face: even if ``beam_width`` of a beam's
    candidates end the sequence, ``beam_width`` live ones remain to extend.
    """
    if not isinstance(beam_width, int) or isinstance(beam_width, bool) or beam_width < 1:
        raise ValueError(f"beam_width must be an int >= 1, got {beam_width!r}")
    _check_logits(logits)
    logits = logits.float()
    top = logits.topk(min(2 * beam_width, logits.shape[1]), dim=-1)
    return BeamCandidates(top.indices, top.values - logits.logsumexp(dim=-1, keepdim=True))


def _sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = filter_logits(logits / temperature[:, None], [p.top_k for p in params],
                           [p.top_p for p in params], [p.min_p for p in params])
    return logits.softmax(dim=-1)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None],
          shared: torch.Generator | None) -> torch.Tensor:
    token_ids = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        token_ids[unseeded] = torch.multinomial(probs[unseeded], 1, generator=shared)[:, 0]
    # One call per seeded row: its draw then depends on its generator and nothing else.
    for i, g in enumerate(generators):
        if g is not None:
            token_ids[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return token_ids


def _top_logprobs(logits, lse, token_ids, chosen, params) -> list[dict[int, float] | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[dict[int, float] | None] = [None] * len(params)
    if not rows:
        return out
    # log_softmax only shifts a row, so the top logits are the top logprobs.
    top = logits[rows].topk(min(max(params[i].logprobs for i in rows), logits.shape[1]))
    top_logprobs = (top.values - lse[rows, None]).tolist()
    top_ids = top.indices.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs
        out[i] = {token_ids[i]: chosen[i], **dict(zip(top_ids[j][:k], top_logprobs[j][:k]))}
    return out


def _check_logits(logits) -> None:
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.shape[1] > 0
            and logits.is_floating_point()):
        got = (f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise ValueError(f"logits must be a 2-D float tensor [N, vocab], got {got}")


def _check_rows(name, values, logits) -> None:
    if len(values) != logits.shape[0]:
        raise ValueError(f"{name} must have one entry per row of logits "
                         f"({logits.shape[0]}), got {len(values)}")


def _check_inputs(logits, params, generators) -> None:
    _check_logits(logits)
    _check_rows("params", params, logits)
    if generators is not None:
        _check_rows("generators", generators, logits)

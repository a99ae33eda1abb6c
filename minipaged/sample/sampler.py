"""The sampler: one new token per sequence from a batch of logits (vLLM's ``Sampler``).

Row ``i`` of ``logits [N, vocab]`` is one sequence sampled this step, with its own
``SamplingParams``.  Per row, in the order of vLLM's V0 sampler and of Hugging Face
(vLLM V1 applies min-p before top-k and top-p, which differs only when top-p and min-p
are both set):

1. the tokens so far adjust the logits (`apply_penalties`): the repetition penalty
   over prompt and output, presence and frequency penalties over the output;
   `apply_min_tokens` masks the end-of-sequence and stop tokens of a row that has not
   yet generated ``min_tokens``;
2. a greedy row (temperature 0) takes the argmax of those logits;
3. any other row divides its logits by its temperature, then drops tokens (logit -inf)
   by top-k, then top-p on what top-k left, then min-p (`filter_logits`), and
4. draws a token from the softmax of what is left.

Every step runs as batched tensor operations over all rows: the penalties from token
counts built in one scatter, the filters from one sort, the unseeded draws from one
cumulative sum.  Only seeded rows are drawn one by one.

Randomness: a row whose request has a seed draws from that sequence's own
``torch.Generator`` (`make_generator`), which the engine keeps across steps; its tokens
are then the same whatever else shares the batch, as vLLM guarantees for seeded
requests.  Unseeded rows share one generator and are drawn in one batched call.

Logprobs describe the model, not the sampling knobs: they are ``log_softmax`` of the raw
logits, before penalties, temperature, top-k, top-p and min-p, which is what vLLM returns
by default (``logprobs_mode="raw_logprobs"``).  So a greedy and a sampled request over
the same prompt report the same numbers for the same tokens.  As in vLLM V1, only the
rows whose request asks for logprobs get them (and a ``cumulative_logprob``): the others
skip the pass over the vocabulary that normalising takes.

Beam search (paper §4.4) samples nothing: `beam_candidates` gives each beam's best next
tokens and the engine ranks them by cumulative logprob.

The sampler knows tensors, token ids and per-row parameters, never requests or the
scheduler.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minipaged.sample.metadata import SamplingMetadata, min_tokens_cells
from minipaged.sampling_params import SamplingParams

__all__ = [
    "SamplerOutput",
    "BeamCandidates",
    "make_generator",
    "seq_generator",
    "sample",
    "sample_with_metadata",
    "final_logits",
    "metadata_of",
    "processed_logits",
    "target_probs",
    "logprobs_of",
    "apply_penalties",
    "apply_min_tokens",
    "filter_logits",
    "beam_candidates",
]


@dataclass
class SamplerOutput:
    """The step's result, one entry per row of the logits.

    Attributes:
        token_ids: the chosen token of each row.
        logprobs: the chosen token's log-probability under the raw logits, for rows
            whose ``logprobs`` is not None (the engine sums them into
            ``cumulative_logprob``); None for the others.
        top_logprobs: None for rows whose ``logprobs`` is None; otherwise
            ``{token_id: logprob}`` holding the chosen token first, then the
            ``logprobs`` most likely tokens, best first: ``logprobs + 1`` entries, or
            ``logprobs`` when the chosen token is among them (vLLM's per-step dict).
    """

    token_ids: list[int]
    logprobs: list[float | None]
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


def seq_generator(params, index: int, device: torch.device | str) -> torch.Generator | None:
    """Completion ``index`` of a request with a seed draws from ``seed + index`` (vLLM);
    None, without one: it draws from the engine's shared stream."""
    seed = getattr(params, "seed", None)
    return None if seed is None else make_generator(seed + index, device)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    generator: torch.Generator | None = None,
    token_ids: Sequence[list[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
    eos_token_ids: Collection[int] = (),
    metadata: SamplingMetadata | None = None,
) -> SamplerOutput:
    """Choose the next token of every row of ``logits [N, vocab]``.

    Args:
        logits: the model's last-position logits, one row per sequence (cast to float32).
        params: each row's sampling parameters.
        generators: each row's own generator (`make_generator`), or None for rows that
            draw from the shared one; None for all rows if omitted.
        generator: the shared generator of the unseeded rows (torch's default if None).
        token_ids: each row's tokens so far, prompt then output; needed only if a row
            has a penalty or ``min_tokens``.
        prompt_lens: how many of each row's ``token_ids`` are its prompt.
        eos_token_ids: what ``min_tokens`` holds back besides ``stop_token_ids``
            (unless the row's ``ignore_eos``).
        metadata: ``params`` and the rest already as tensors, kept across steps
            (`minipaged.sample.metadata.SamplingInputBatch`, the engine's decode
            steps); then ``generators``, ``token_ids``, ``prompt_lens`` and
            ``eos_token_ids`` are not read.
    """
    _check_inputs(logits, params, generators)
    if metadata is None:
        metadata = metadata_of(logits, params, generators, token_ids, prompt_lens, eos_token_ids)
    return sample_with_metadata(logits, metadata, generator)


def sample_with_metadata(
    logits: torch.Tensor, metadata: SamplingMetadata, generator: torch.Generator | None = None
) -> SamplerOutput:
    """`sample`, given the rows' parameters as a `SamplingMetadata`: one batched pass, no
    loop over the rows but for seeded draws, and the chosen ids copied to the host once."""
    raw = logits.float()
    logits = final_logits(raw, metadata)
    if metadata.all_greedy:
        next_ids = logits.argmax(dim=-1)
    elif metadata.all_random:  # no argmax, no copy of the rows
        next_ids = _draw(_probs(logits, metadata, None), metadata.generators, generator)
    else:
        next_ids = logits.argmax(dim=-1)  # greedy rows keep this
        rows = metadata.random_rows
        index = metadata.random_index
        if index is None:
            index = torch.tensor(rows, device=logits.device)
        generators = metadata.generators
        next_ids[index] = _draw(
            _probs(logits[index], metadata, index),
            [generators[i] for i in rows] if generators else None,
            generator,
        )
    return _logprobs(raw, next_ids.tolist(), metadata.logprobs)


def final_logits(raw: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Step 1 of the module's order over ``raw [N, vocab]`` (float32): the penalties,
    then the ``min_tokens`` mask.  What it returns is final: the sampler takes its
    argmax, or its softmax after temperature and filters.  Structured outputs' grammar
    mask comes before, on the raw logits (`LLMEngine.sample`): a masked ``-inf`` stays
    ``-inf`` through every penalty."""
    logits = _apply_penalties(raw, metadata)
    if metadata.min_tokens_cells is not None:
        logits = logits.index_put(
            metadata.min_tokens_cells, torch.tensor(-torch.inf, device=logits.device)
        )
    return logits


def metadata_of(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    token_ids: Sequence[list[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
    eos_token_ids: Collection[int] = (),
) -> SamplingMetadata:
    """The `SamplingMetadata` of ``params``, built from these lists (the penalties'
    counts from each row's ``token_ids``) rather than kept across steps."""
    vocab, device = logits.shape[1], logits.device
    metadata = _draw_metadata(params, vocab, device)
    if generators and any(g is not None for g in generators):
        metadata.generators = list(generators)
    if any(p.logprobs is not None for p in params):
        metadata.logprobs = [p.logprobs for p in params]
    rows = [i for i, p in enumerate(params) if p.penalized]
    if rows:
        _check_history(token_ids, prompt_lens, logits)
        _penalty_metadata(metadata, rows, params, token_ids, prompt_lens, vocab, device)
    if any(p.min_tokens for p in params):
        _check_history(token_ids, prompt_lens, logits)
        metadata.min_tokens_cells = min_tokens_cells(
            params,
            [len(t) - n for t, n in zip(token_ids, prompt_lens)],
            eos_token_ids,
            vocab,
            device,
        )
    return metadata


def _draw_metadata(params: Sequence[SamplingParams], vocab: int, device) -> SamplingMetadata:
    """The `SamplingMetadata` of steps 2-4 only: which rows are greedy, and the others'
    temperature and filters."""
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    metadata = SamplingMetadata(None, not random_rows, len(random_rows) == len(params), random_rows)
    if random_rows:
        # Only the sampled rows' values are read; a greedy row's are neutral.
        metadata.temperature = torch.tensor(
            [1.0 if p.greedy else p.temperature for p in params], device=device
        )
        metadata.top_k, metadata.top_p, metadata.min_p = _filter_tensors(
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            vocab,
            device,
        )
    return metadata


def _penalty_metadata(metadata, rows, params, token_ids, prompt_lens, vocab, device) -> None:
    """The penalized ``rows``' penalties and token counts, into ``metadata``."""
    history = [token_ids[i] for i in rows]
    output = _token_counts(history, [prompt_lens[i] for i in rows], None, vocab, device)
    prompt = _token_counts(history, [0] * len(rows), [prompt_lens[i] for i in rows], vocab, device)

    def column(name):
        return torch.tensor([getattr(params[i], name) for i in rows], device=device)[:, None]

    metadata.penalized_rows = rows
    metadata.frequency_penalties = column("frequency_penalty")
    metadata.presence_penalties = column("presence_penalty")
    metadata.repetition_penalties = column("repetition_penalty")
    metadata.output_token_counts, metadata.prompt_token_mask = output, prompt > 0


def processed_logits(
    raw: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[list[int]] | None,
    prompt_lens: Sequence[int] | None,
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """Step 1 of the module's order: ``raw [N, vocab]`` (float32) after each row's
    penalties and ``min_tokens`` mask, given its tokens so far."""
    return final_logits(raw, metadata_of(raw, params, None, token_ids, prompt_lens, eos_token_ids))


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution `sample` draws each row of `processed_logits` from, ``[N,
    vocab]``: steps 2-3, a greedy row all on its argmax (speculative decoding's target
    distribution, `minipaged.sample.rejection_sampler`)."""
    probs = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        probs[greedy] = probs[greedy].scatter(1, logits[greedy].argmax(-1, keepdim=True), 1.0)
    metadata = _draw_metadata(params, logits.shape[1], logits.device)
    if rows := metadata.random_rows:
        index = torch.tensor(rows, device=logits.device)
        probs[rows] = _probs(logits[rows], metadata, index)
    return probs


def logprobs_of(
    raw: torch.Tensor, token_ids: list[int], params: Sequence[SamplingParams]
) -> SamplerOutput:
    """The chosen ``token_ids`` of the rows of ``raw [N, vocab]`` with, for the rows whose
    request asks for logprobs, their logprobs and top logprobs (module docstring: of the
    raw logits); None for the others."""
    return _logprobs(raw, token_ids, [p.logprobs for p in params])


def _logprobs(
    raw: torch.Tensor, token_ids: list[int], logprobs: Sequence[int | None] | None
) -> SamplerOutput:
    """`logprobs_of`, given each row's ``SamplingParams.logprobs`` (None: no row asks)."""
    out = SamplerOutput(token_ids, [None] * len(token_ids), [None] * len(token_ids))
    rows = [] if logprobs is None else [i for i, k in enumerate(logprobs) if k is not None]
    if not rows:
        return out
    part = raw if len(rows) == raw.shape[0] else raw[rows]
    lse = part.logsumexp(dim=-1)
    index = torch.tensor([token_ids[i] for i in rows], device=raw.device)[:, None]
    chosen = (part.gather(1, index).squeeze(1) - lse).tolist()
    # log_softmax only shifts a row, so the top logits are the top logprobs.
    top = part.topk(min(max(logprobs[i] for i in rows), raw.shape[1]))
    top_logprobs = (top.values - lse[:, None]).tolist()
    top_ids = top.indices.tolist()
    for j, i in enumerate(rows):
        k = logprobs[i]
        out.logprobs[i] = chosen[j]
        out.top_logprobs[i] = {
            token_ids[i]: chosen[j],
            **dict(zip(top_ids[j][:k], top_logprobs[j][:k])),
        }
    return out


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[list[int]] | None,
    prompt_lens: Sequence[int] | None,
) -> torch.Tensor:
    """``logits [N, vocab]`` with each row's penalties applied (a new tensor if any).

    Repetition (Hugging Face's ``RepetitionPenaltyLogitsProcessor``, vLLM): a token seen
    in the prompt or the output has a positive logit divided by the penalty, a negative
    one multiplied.  Presence and frequency (OpenAI, vLLM): over the output only,
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    _check_history(token_ids, prompt_lens, logits)
    metadata = SamplingMetadata(None, True, False, [])
    vocab, device = logits.shape[1], logits.device
    _penalty_metadata(metadata, rows, params, token_ids, prompt_lens, vocab, device)
    return _apply_penalties(logits, metadata)


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    rows = metadata.penalized_rows
    if not rows:
        return logits
    output, penalty = metadata.output_token_counts, metadata.repetition_penalties
    seen = metadata.prompt_token_mask | (output > 0)
    part = logits[rows]
    part = torch.where(seen, torch.where(part > 0, part / penalty, part * penalty), part)
    part = part - metadata.frequency_penalties * output - metadata.presence_penalties * (output > 0)
    logits = logits.clone()
    logits[rows] = part
    return logits


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[list[int]] | None,
    prompt_lens: Sequence[int] | None,
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """``logits`` with the stop tokens of rows short of ``min_tokens`` set to -inf.

    A row's stop tokens are its ``stop_token_ids`` and, unless ``ignore_eos``,
    ``eos_token_ids`` (Hugging Face's ``MinNewTokensLengthLogitsProcessor``, vLLM's
    min-tokens penalty).  Returns ``logits`` itself when no row is short.
    """
    if not any(p.min_tokens for p in params):
        return logits
    _check_history(token_ids, prompt_lens, logits)
    cells = min_tokens_cells(
        params,
        [len(t) - n for t, n in zip(token_ids, prompt_lens)],
        eos_token_ids,
        logits.shape[1],
        logits.device,
    )
    if cells is None:
        return logits
    return logits.index_put(cells, torch.tensor(-torch.inf, device=logits.device))


def filter_logits(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """``logits [N, vocab]`` with the tokens each row's filters drop set to -inf.

    Per row, in the module's order: top-k keeps tokens whose logit is at least the k-th
    largest (ties at the boundary stay, so a few more than k may remain; ``top_k`` <= 0
    is off); top-p then keeps a token if the probability of the tokens above it,
    renormalised over what top-k kept, is below ``top_p`` (the smallest nucleus reaching
    ``top_p``, never empty, the most likely token always kept; 1 is off); min-p then
    drops tokens less likely than ``min_p`` times the most likely one (0 is off).  A
    step no row uses is skipped.
    """
    _check_logits(logits)
    for name, values in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        _check_rows(name, values, logits)
    k, p, m = _filter_tensors(top_k, top_p, min_p, logits.shape[1], logits.device, logits.dtype)
    return _filter(logits, k, p, m)


def _filter_tensors(top_k, top_p, min_p, vocab: int, device, dtype=torch.float32):
    """The filters' per-row values as tensors, each None if no row uses it: top-k as the
    number of tokens kept (the vocabulary where off), top-p and min-p as ``dtype`` (the
    logits')."""
    k = p = m = None
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=device)
    if any(p < 1 for p in top_p):
        p = torch.tensor(top_p, dtype=dtype, device=device)
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, dtype=dtype, device=device)
    return k, p, m


def _filter(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    m: torch.Tensor | None,
) -> torch.Tensor:
    """`filter_logits` over tensors (`_filter_tensors`), a filter None where off."""
    if k is not None or p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if k is not None:
            kth = sorted_logits.gather(1, (k - 1)[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -torch.inf)
        if p is not None:
            p = p.to(logits.dtype)[:, None]
            probs = sorted_logits.softmax(dim=-1)
            mass_above = probs.cumsum(dim=-1) - probs
            # `p < 1` keeps rows with top-p off exact: a cumsum that rounds up to 1 before
            # the last token must not drop that row's tail, or a seeded row would sample
            # differently depending on its batch.
            drop = (mass_above >= p) & (p < 1)
            # A top_p that rounds to 0 in float32 (1e-300) would drop every token.
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if m is not None:
        m = m.to(logits.dtype)[:, None]
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


def _probs(
    logits: torch.Tensor, metadata: SamplingMetadata, index: torch.Tensor | None
) -> torch.Tensor:
    """Steps 3-4's distribution of ``logits``, the rows ``index`` of the step (all of
    them if None): temperature, the filters, softmax."""

    def of(values):
        return values if values is None or index is None else values[index]

    logits = logits / of(metadata.temperature)[:, None]
    logits = _filter(logits, of(metadata.top_k), of(metadata.top_p), of(metadata.min_p))
    return logits.softmax(dim=-1)


def _draw(
    probs: torch.Tensor,
    generators: list[torch.Generator | None] | None,
    shared: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of ``probs``, which it may overwrite; ``generators`` None: every
    row draws from ``shared``."""
    if generators is None:
        return _inverse_cdf(probs, shared)
    token_ids = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    # One call per seeded row: its draw then depends on its generator and nothing else.
    for i, g in enumerate(generators):
        if g is not None:
            token_ids[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        token_ids = _inverse_cdf(probs, shared)
    elif unseeded:
        token_ids[unseeded] = _inverse_cdf(probs[unseeded], shared)
    return token_ids


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` (overwritten by its running sum): the first token
    whose cumulative probability exceeds a uniform number.  Same distribution as
    ``torch.multinomial``, which on a CPU costs about eight times as much over a large
    vocabulary."""
    cdf = probs.cumsum_(dim=-1)  # in place: at 256 rows x 49k tokens, a 50 MB buffer less
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    # Below the total, or u * total could round up to it and find no token; the first
    # cumulative sum above any value is where a token of non-zero probability starts.
    value = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, value, right=True)[:, 0]


def _check_logits(logits) -> None:
    if not (
        isinstance(logits, torch.Tensor)
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.is_floating_point()
    ):
        got = (
            f"{tuple(logits.shape)} {logits.dtype}"
            if isinstance(logits, torch.Tensor)
            else type(logits).__name__
        )
        raise ValueError(f"logits must be a 2-D float tensor [N, vocab], got {got}")


def _check_rows(name, values, logits) -> None:
    if len(values) != logits.shape[0]:
        raise ValueError(
            f"{name} must have one entry per row of logits ({logits.shape[0]}), got {len(values)}"
        )


def _check_inputs(logits, params, generators) -> None:
    _check_logits(logits)
    _check_rows("params", params, logits)
    if generators is not None:
        _check_rows("generators", generators, logits)


def _check_history(token_ids, prompt_lens, logits) -> None:
    if token_ids is None or prompt_lens is None:
        raise ValueError(
            "token_ids and prompt_lens must be given when a row has a penalty or min_tokens"
        )
    _check_rows("token_ids", token_ids, logits)
    _check_rows("prompt_lens", prompt_lens, logits)


def _token_counts(
    token_ids: list[list[int]], starts: list[int], ends: list[int] | None, vocab: int, device
) -> torch.Tensor:
    """``[R, vocab]``: how often each token occurs in ``token_ids[r][starts[r]:ends[r]]``
    (to the end if ``ends`` is None), counted in one scatter."""
    ends = ends or [len(t) for t in token_ids]
    flat = array.array(
        "q",
        itertools.chain.from_iterable(
            itertools.islice(t, a, b) for t, a, b in zip(token_ids, starts, ends)
        ),
    )
    lengths = torch.tensor([b - a for a, b in zip(starts, ends)], device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
    counts = torch.zeros(len(token_ids), vocab, device=device)
    if flat:
        index = rows * vocab + torch.frombuffer(flat, dtype=torch.long).to(device)
        counts.view(-1).index_add_(0, index, torch.ones(len(flat), device=device))
    return counts

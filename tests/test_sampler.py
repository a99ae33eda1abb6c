"""The sampler (lesson 09): greedy, temperature, top-k, top-p, min-p, seeds, logprobs, beams.

Oracles, all independent of the code under test:

- ``oracle_probs``: the filtered, renormalised distribution computed in plain Python
  (float64, ``sorted`` and a running sum), following vLLM's rules as the docs state them;
- empirical frequencies of many seeded draws, compared with that distribution by a
  chi-square test whose p-value comes from ``torch.special.gammaincc``;
- ``torch.log_softmax`` and Python's ``sorted`` for logprobs and beam candidates.

Every random draw is seeded, so every test is deterministic.
"""

import math

import pytest
import torch

from minipaged.sample.sampler import beam_candidates, filter_logits, make_generator, sample
from minipaged.sampling_params import SamplingParams

VOCAB = 32


def fixture_logits(rows=1, vocab=VOCAB, seed=0, scale=2.0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def oracle_probs(row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, margin=1e-4):
    """``{token: probability}`` after temperature, top-k, top-p, min-p, in that order.

    Asserts that no token sits within ``margin`` of a top-p or min-p boundary, where
    float32 rounding in the sampler could fairly decide either way.
    """
    x = [v / temperature for v in row.tolist()]
    order = sorted(range(len(x)), key=lambda i: -x[i])

    def renormalised(keep):
        top = max(x[i] for i in keep)
        weights = {i: math.exp(x[i] - top) for i in keep}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    keep = set(order[:top_k]) if top_k > 0 else set(order)
    if top_p < 1:
        p, running, nucleus = renormalised(keep), 0.0, set()
        for i in (i for i in order if i in keep):
            nucleus.add(i)
            running += p[i]
            assert abs(running - top_p) > margin, "fixture too close to the top-p boundary"
            if running >= top_p:
                break
        keep = nucleus
    if min_p > 0:
        p = renormalised(keep)
        threshold = min_p * max(p.values())
        assert all(abs(q - threshold) > margin for q in p.values()), "fixture too close to min-p"
        keep = {i for i in keep if p[i] >= threshold}
    return renormalised(keep)


def draw_counts(row, params, draws=20_000, seed=0):
    """How often each token is drawn in ``draws`` independent draws from ``row``."""
    out = sample(row.expand(draws, -1), [params] * draws, generator=make_generator(seed))
    return torch.bincount(torch.tensor(out.token_ids), minlength=row.shape[-1])


def chi_square_pvalue(counts, probs):
    """Pearson's goodness-of-fit p-value; bins expecting under 5 draws are pooled, the
    usual condition for the chi-square approximation."""
    total = int(counts.sum())
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for token, p in probs.items():
        if total * p >= 5:
            observed.append(int(counts[token]))
            expected.append(total * p)
        else:
            pooled_obs, pooled_exp = pooled_obs + int(counts[token]), pooled_exp + total * p
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    if len(expected) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(expected) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


# A fixed seed makes each test deterministic; 1e-3 is the false-alarm rate we accept for
# the seed we happened to pick, and 20k draws make real mistakes (a wrong temperature, a
# filter keeping one token too many or too few) fail by orders of magnitude.
P_MIN = 1e-3

FILTER_CASES = [
    # temperature, top_k, top_p, min_p
    (1.0, 5, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.0, 100, 1.0, 0.0),  # top_k above vocab: off
    (1.0, 0, 0.6, 0.0),
    (1.0, 0, 0.93, 0.0),
    (1.0, 0, 1e-6, 0.0),  # the top token always stays
    (1.0, 0, 1.0, 0.1),
    (1.0, -1, 1.0, 0.3),
    (0.7, 10, 0.8, 0.05),  # all three, on a sharpened distribution
    (1.6, 12, 0.9, 0.2),
    (0.5, 0, 1.0, 0.0),
    (2.0, 0, 1.0, 0.0),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTER_CASES)
def test_draws_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    row = fixture_logits(seed=1)[0]
    probs = oracle_probs(row, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    counts = draw_counts(row, params)
    outside = [t for t in range(VOCAB) if t not in probs and counts[t] > 0]
    assert outside == [], f"filtered-out tokens were drawn: {outside}"
    assert chi_square_pvalue(counts, probs) > P_MIN


def test_the_chi_square_check_has_power():
    # The same draws, judged against the untempered distribution, must be rejected.
    row = fixture_logits(seed=1)[0]
    counts = draw_counts(row, SamplingParams(temperature=0.5))
    assert chi_square_pvalue(counts, oracle_probs(row, 1.0)) < 1e-12
    assert chi_square_pvalue(counts, oracle_probs(row, 0.5)) > P_MIN


def test_filter_logits_keeps_each_rows_oracle_support_in_one_batch():
    logits = fixture_logits(rows=len(FILTER_CASES), seed=2)
    temperature = torch.tensor([c[0] for c in FILTER_CASES])[:, None]
    top_k, top_p, min_p = ([c[i] for c in FILTER_CASES] for i in (1, 2, 3))
    filtered = filter_logits(logits / temperature, top_k, top_p, min_p)
    for r, case in enumerate(FILTER_CASES):
        kept = set(torch.isfinite(filtered[r]).nonzero()[:, 0].tolist())
        assert kept == set(oracle_probs(logits[r], *case)), case
        assert torch.equal(filtered[r][list(kept)], (logits[r] / temperature[r])[list(kept)])


def test_filters_that_are_off_change_nothing():
    logits = fixture_logits(rows=3, vocab=4096, seed=3, scale=6.0)
    assert torch.equal(filter_logits(logits, [0, -1, 0], [1.0, 1.0, 1.0], [0.0] * 3), logits)
    # Beside rows that do filter, a row with every filter off is still untouched.
    filtered = filter_logits(logits, [0, 5, 0], [1.0, 1.0, 0.5], [0.0, 0.3, 0.0])
    assert torch.equal(filtered[0], logits[0])


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    kept = torch.isfinite(filter_logits(logits, [2], [1.0], [0.0]))[0].tolist()
    assert kept == [True, True, True, False]


def test_top_p_applies_to_what_top_k_kept():
    # probs 0.4, 0.3, 0.2, 0.1.  Over all four, the nucleus of 0.5 is {0, 1}; renormalised
    # over top-2 the first token alone has 4/7 >= 0.5.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    kept = torch.isfinite(filter_logits(logits, [2], [0.5], [0.0]))[0].tolist()
    assert kept == [True, False, False, False]


def test_min_p_applies_after_top_p():
    # probs 0.5, 0.3, 0.1, 0.1.  Top-p 0.6 keeps {0, 1}; min-p 0.25 then keeps both.  The
    # other order (min-p first, as vLLM V1 does) would renormalise {0, 1} to 0.625, 0.375
    # and top-p would keep only token 0.
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
    kept = torch.isfinite(filter_logits(logits, [0], [0.6], [0.25]))[0].tolist()
    assert kept == [True, True, False, False]


@pytest.mark.parametrize("top_p", [1e-300, 1e-50, 5e-324])
def test_a_top_p_that_rounds_to_zero_keeps_exactly_the_argmax(top_p):
    """1e-300 is 0 in float32: without a guard every token is dropped, the softmax is
    NaN and the draw raises (this once killed the server's engine thread)."""
    logits = fixture_logits(rows=5, seed=4)
    kept = filter_logits(logits, [0] * 5, [top_p] * 5, [0.0] * 5).isfinite()
    assert kept.sum(dim=-1).tolist() == [1] * 5
    assert kept.float().argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()
    params = [SamplingParams(top_p=top_p, temperature=2.0)] * 4 + [
        SamplingParams(top_p=top_p, seed=3)
    ]
    generators = [None] * 4 + [make_generator(3)]
    out = sample(logits, params, generators, make_generator(0))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(("top_k", "min_p"), [(1, 0.0), (0, 1.0), (1, 1.0)])
def test_the_tightest_top_k_and_min_p_keep_the_argmax(top_k, min_p):
    logits = fixture_logits(rows=5, seed=5)
    out = sample(
        logits, [SamplingParams(top_k=top_k, min_p=min_p)] * 5, generator=make_generator(0)
    )
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_take_the_argmax_whatever_the_other_knobs():
    logits = fixture_logits(rows=16, vocab=1000, seed=4)
    params = [
        SamplingParams(temperature=0, top_k=k, top_p=p, seed=s)
        for k, p, s in zip([0, 3, 50, -1] * 4, [1.0, 0.1, 0.5, 0.9] * 4, [None, 1] * 8)
    ]
    generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
    out = sample(logits, params, generators, make_generator(0))
    assert out.token_ids == [max(range(1000), key=row.__getitem__) for row in logits.tolist()]
    assert sample(logits, params).token_ids == out.token_ids


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = fixture_logits(rows=6, vocab=50, seed=5)
    params = [SamplingParams(temperature=t, top_k=1 if t else 0) for t in [0, 1, 0, 0.5, 0, 2]]
    # top_k=1 makes the random rows deterministic too: all six must be the argmax.
    out = sample(logits, params, generator=make_generator(0))
    assert out.token_ids == logits.argmax(-1).tolist()


def seeded_stream(params, seed, steps, position, batch_logits, batch_params, shared_seed):
    """Tokens of one seeded row over ``steps`` steps, sampled at ``position[step]`` inside
    a batch of other rows (``batch_params``, their own seeded generators and a shared one)."""
    mine = make_generator(seed)
    others = [make_generator(p.seed) if p.seed is not None else None for p in batch_params]
    shared = make_generator(shared_seed)
    tokens = []
    for step in range(steps):
        logits = batch_logits[step]
        rows, gens = list(batch_params), list(others)
        rows.insert(position[step], params)
        gens.insert(position[step], mine)
        out = sample(logits, rows, gens, shared)
        tokens.append(out.token_ids[position[step]])
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=7, temperature=1.5),
        SamplingParams(seed=7, temperature=1.2, top_p=0.95),
        SamplingParams(seed=123, top_k=20, min_p=0.01),
    ],
)
def test_a_seeded_row_gives_the_same_tokens_alone_or_in_any_batch(params):
    steps, vocab = 24, 64
    step_logits = [fixture_logits(vocab=vocab, seed=100 + s)[0] for s in range(steps)]
    alone = seeded_stream(
        params,
        params.seed,
        steps,
        [0] * steps,
        [row[None] for row in step_logits],
        [],
        shared_seed=0,
    )
    others = [
        SamplingParams(seed=8),
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(top_k=3, top_p=0.5, min_p=0.2),
        SamplingParams(seed=7, top_p=0.3),
    ]
    for trial in range(3):
        positions = torch.randint(
            0, len(others) + 1, (steps,), generator=torch.Generator().manual_seed(trial)
        ).tolist()
        batches = []
        for s, row in enumerate(step_logits):
            noise = fixture_logits(rows=len(others), vocab=vocab, seed=1000 * trial + s)
            batches.append(torch.cat([noise[: positions[s]], row[None], noise[positions[s] :]]))
        assert (
            seeded_stream(
                params, params.seed, steps, positions, batches, others, shared_seed=trial + 1
            )
            == alone
        )
    other_seed = seeded_stream(
        params,
        params.seed + 1,
        steps,
        [0] * steps,
        [row[None] for row in step_logits],
        [],
        shared_seed=0,
    )
    assert other_seed != alone


def test_the_shared_generator_makes_unseeded_rows_reproducible():
    logits = fixture_logits(rows=8, vocab=100, seed=6)
    params = [SamplingParams(temperature=1.3)] * 8
    first = sample(logits, params, generator=make_generator(5)).token_ids
    assert sample(logits, params, generator=make_generator(5)).token_ids == first
    assert sample(logits, params, generator=make_generator(6)).token_ids != first


def test_logprobs_are_those_of_the_raw_logits_for_the_rows_that_ask():
    """A row without ``logprobs`` gets none (vLLM V1: no pass over its vocabulary)."""
    logits = fixture_logits(rows=5, vocab=200, seed=7)
    params = [
        SamplingParams(temperature=0.6, top_k=10, logprobs=3),
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.1, logprobs=0),
        SamplingParams(temperature=2.0, logprobs=200),
    ]
    out = sample(logits, params, generator=make_generator(0))
    raw = torch.log_softmax(logits.double(), dim=-1)
    for r, (token, p) in enumerate(zip(out.token_ids, params)):
        if p.logprobs is None:
            assert out.logprobs[r] is None and out.top_logprobs[r] is None
            continue
        assert out.logprobs[r] == pytest.approx(raw[r, token].item(), abs=1e-5)
        entries = list(out.top_logprobs[r].items())
        assert entries[0] == (token, out.logprobs[r])
        best = sorted(range(200), key=lambda t: -raw[r, t].item())[: p.logprobs]
        alternatives = [t for t, _ in entries[1:]]
        assert alternatives == [t for t in best if t != token]
        assert len(entries) == p.logprobs + (token not in best)
        for t, lp in entries:
            assert lp == pytest.approx(raw[r, t].item(), abs=1e-5)


@pytest.mark.parametrize("beam_width,vocab", [(1, 50), (4, 50), (3, 7), (4, 5)])
def test_beam_candidates_are_the_top_two_beam_width_of_log_softmax(beam_width, vocab):
    logits = fixture_logits(rows=6, vocab=vocab, seed=8)
    cands = beam_candidates(logits, beam_width)
    raw = torch.log_softmax(logits.double(), dim=-1)
    k = min(2 * beam_width, vocab)
    assert cands.token_ids.shape == cands.logprobs.shape == (6, k)
    for r in range(6):
        best = sorted(range(vocab), key=lambda t: -raw[r, t].item())[:k]
        assert cands.token_ids[r].tolist() == best
        torch.testing.assert_close(cands.logprobs[r].double(), raw[r, best], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: sample(torch.zeros(4), [SamplingParams()]), "logits"),
        (lambda: sample(torch.zeros(2, 3, dtype=torch.long), [SamplingParams()] * 2), "logits"),
        (lambda: sample(torch.zeros(2, 0), [SamplingParams()] * 2), "logits"),
        (lambda: sample(torch.zeros(2, 3), [SamplingParams()]), "params"),
        (lambda: sample(torch.zeros(2, 3), [SamplingParams()] * 2, [None]), "generators"),
        (lambda: filter_logits(torch.zeros(2, 3), [0, 0], [1.0], [0.0, 0.0]), "top_p"),
        (lambda: beam_candidates(torch.zeros(2, 3), 0), "beam_width"),
        (lambda: beam_candidates(torch.zeros(3), 2), "logits"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        call()

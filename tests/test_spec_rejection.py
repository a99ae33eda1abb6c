"""Modified rejection sampling keeps the target's distribution (Leviathan et al. 2023).

The model is a tiny-vocabulary Markov chain: the target's next-token distribution is
``P[previous token]`` and the draft's ``Q[previous token]``, both known exactly.  So
the exact probability of every 3-token continuation is a product of ``P`` entries, the
oracle; thousands of seeded speculative samples are compared with it by a chi-square
test.  The same test fails on planted bugs (`test_a_planted_bug_fails_the_test`):
drawing the token after a rejection from ``p`` instead of ``norm(max(0, p - q))``,
or accepting every guess; so a pass means something.
"""

import itertools
from collections import Counter

import pytest
import torch

from minipaged.spec_decode import rejection_sampler
from minipaged.spec_decode.rejection_sampler import rejection_sample

V, LENGTH, NUM_SAMPLES = 4, 3, 4000


def chain(seed, sharpness):
    g = torch.Generator().manual_seed(seed)
    return (sharpness * torch.randn(V, V, generator=g)).softmax(-1)


P = chain(0, 0.5)  # the target
Q = chain(1, 2.0)  # a draft that disagrees with it


def exact(sequence):
    prob, prev = 1.0, 0
    for token in sequence:
        prob, prev = prob * float(P[prev, token]), token
    return prob


def speculative_samples(k, greedy_draft, seed):
    """``NUM_SAMPLES`` continuations of token 0, each ``LENGTH`` tokens, by rounds of
    draft-then-verify as the engine runs them."""
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(NUM_SAMPLES):
        seq = [0]
        while len(seq) <= LENGTH:
            guesses, draft_probs, prev = [], [], seq[-1]
            for _ in range(k):
                q = Q[prev]
                token = (
                    int(q.argmax()) if greedy_draft else int(torch.multinomial(q, 1, generator=g))
                )
                guesses.append(token)
                draft_probs.append(q)
                prev = token
            # The target's distribution after the real tokens and each guess before.
            target = torch.stack([P[t] for t in [seq[-1], *guesses]])
            seq += rejection_sample(
                target, guesses, None if greedy_draft else torch.stack(draft_probs), g
            )
        counts[tuple(seq[1 : LENGTH + 1])] += 1
    return counts


def chi_square_p_value(counts):
    sequences = list(itertools.product(range(V), repeat=LENGTH))
    expected = torch.tensor([exact(s) * NUM_SAMPLES for s in sequences], dtype=torch.float64)
    observed = torch.tensor([counts[s] for s in sequences], dtype=torch.float64)
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(len(sequences) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))  # chi2's survival function


@pytest.mark.parametrize("k,greedy_draft", [(1, False), (3, False), (3, True)])
def test_speculative_samples_follow_the_target(k, greedy_draft):
    assert min(exact(s) for s in itertools.product(range(V), repeat=LENGTH)) * NUM_SAMPLES > 5
    assert chi_square_p_value(speculative_samples(k, greedy_draft, seed=k)) > 1e-3


@pytest.mark.parametrize(
    "bug",
    [
        "residual_is_p",  # after a rejection, draw from p: tokens the draft liked too often
        "accept_all",  # every guess kept: the draft's distribution, not the target's
    ],
)
def test_a_planted_bug_fails_the_test(bug, monkeypatch):
    if bug == "residual_is_p":
        monkeypatch.setattr(rejection_sampler, "_residual", lambda p, q: p)
    else:
        monkeypatch.setattr(rejection_sampler, "_accepts", lambda *args: True)
    assert chi_square_p_value(speculative_samples(3, False, seed=3)) < 1e-6


def test_greedy_target_accepts_exactly_its_argmax_and_draws_nothing():
    target = torch.zeros(4, V)
    target[[0, 1, 2, 3], [2, 1, 3, 0]] = 1.0  # a greedy request: one-hot rows
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert rejection_sample(target, [2, 1, 3]) == [2, 1, 3, 0]  # all accepted + bonus
    assert rejection_sample(target, [2, 0, 3], generator=g) == [2, 1]  # corrected at 2nd
    assert rejection_sample(target[:1], [], generator=g) == [2]
    assert torch.equal(g.get_state(), state)


def test_seeded_verification_is_reproducible():
    target = P[[0, 1, 2]]
    draws = [
        rejection_sample(target, [1, 3], generator=torch.Generator().manual_seed(7))
        for _ in range(3)
    ]
    assert draws[0] == draws[1] == draws[2]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(torch.zeros(2, V), [1, 2])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, V), [1, 2], torch.zeros(3, V))

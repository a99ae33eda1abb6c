"""The proposers of speculative decoding.

The n-gram proposer is checked against a brute-force oracle written here: every
(n, start) pair scored by (longest n, latest start).
"""

import random

import pytest

from minipaged.spec_decode.ngram import NgramProposer


def brute_force(tokens, k, lo, hi):
    best = None
    for n in range(lo, hi + 1):
        for start in range(len(tokens) - n):  # an earlier occurrence, not the suffix
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                best = max(best or (0, -1), (n, start))
    if best is None:
        return []
    n, start = best
    return tokens[start + n : start + n + k]


def test_proposes_what_followed_the_suffix_before():
    proposer = NgramProposer(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]
    assert proposer.propose(tokens, 2) == [8, 9]
    assert proposer.propose(tokens, 10) == [8, 9, 1, 6, 7]  # up to the end
    assert proposer.propose([1, 2, 3], 4) == []  # nothing recurs


def test_the_longest_match_wins_over_a_later_shorter_one():
    proposer = NgramProposer(1, 3)
    #   [1 2 3] 4 ... [3] 5 ... [1 2 3]: the 3-gram occurred at 0, the 1-gram later.
    assert proposer.propose([1, 2, 3, 4, 0, 3, 5, 0, 1, 2, 3], 1) == [4]
    assert NgramProposer(1, 1).propose([1, 2, 3, 4, 0, 3, 5, 0, 1, 2, 3], 1) == [5]


def test_prompt_lookup_min_refuses_short_matches():
    assert NgramProposer(2, 3).propose([9, 4, 1, 7, 4], 2) == []
    assert NgramProposer(1, 3).propose([9, 4, 1, 7, 4], 2) == [1, 7]


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_brute_force_oracle(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 5)
    proposer = NgramProposer(lo, hi)
    for _ in range(50):
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 6)
        assert proposer.propose(tokens, k) == brute_force(tokens, k, lo, hi), tokens


def test_bad_lookup_bounds_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)

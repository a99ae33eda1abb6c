"""Modified rejection sampling keeps the target's distribution (Leviathan et al. 2023).

First on its own: the model is a tiny-vocabulary Markov chain, the target's
next-token distribution ``P[previous token]`` and the draft's ``Q[previous token]``,
both known exactly.  So the exact probability of every 3-token continuation is a
product of ``P`` entries, the oracle; thousands of seeded speculative samples are
compared with it by a chi-square test.

Then through the engine: a tiny Llama with a 12-token vocabulary and a draft model
that disagrees with it, thousands of seeded requests at temperature 1.5 with and
without speculation; the oracle is Hugging Face's model on the same weights, whose
logits give the exact distribution of the token at each output position.

Both tests fail on planted bugs (`test_a_planted_bug_fails_the_test`,
`test_a_planted_bug_fails_the_engine_test`): drawing the token after a rejection from
``p`` instead of ``norm(max(0, p - q))``, accepting every guess, or accepting with
``min(1, q/p)``; so a pass means something.
"""

import itertools
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import make_llm
from minipaged import SamplingParams
from minipaged.sample import rejection_sampler
from minipaged.sample.rejection_sampler import rejection_sample

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


# -- through the engine ------------------------------------------------------------------
# A tiny Llama with a 12-token vocabulary; its draft is a copy whose LM head is
# perturbed, so it mostly agrees with the target and sometimes does not.  Sampled at
# temperature 1.5 the target spreads its next token over several ids, and the draft's
# greedy guess (a distribution all on one token) is accepted about a fifth of the time:
# rejections, residual draws and bonus tokens all happen often.
ENGINE_V, TEMPERATURE, ENGINE_LENGTH = 12, 1.5, 4
ENGINE_PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def small_vocab(tiny, tmp_path_factory):
    """The target's checkpoint, its HF model, and the perturbed draft's checkpoint."""
    path, oracle = tiny("llama", vocab_size=ENGINE_V, pad_token_id=None)
    draft = tmp_path_factory.mktemp("perturbed-draft")
    shutil.copytree(path, draft, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    noise = torch.randn(weights["lm_head.weight"].shape, generator=torch.Generator().manual_seed(1))
    weights["lm_head.weight"] += 0.15 * noise
    save_file(weights, draft / "model.safetensors", metadata={"format": "pt"})
    return path, oracle.hf, draft


def exact_marginals(hf) -> list[torch.Tensor]:
    """The target's exact distribution of each of the first ``ENGINE_LENGTH`` output
    tokens, summed over every prefix before it (``V ** j`` prefixes at position j), from
    Hugging Face's logits at ``TEMPERATURE``."""
    marginals, prefixes, weights = [], [()], torch.ones(1, dtype=torch.float64)
    for _ in range(ENGINE_LENGTH):
        with torch.no_grad():
            logits = hf(torch.tensor([ENGINE_PROMPT + list(p) for p in prefixes])).logits
        joint = weights[:, None] * (logits[:, -1].double() / TEMPERATURE).softmax(-1)
        marginals.append(joint.sum(0))
        prefixes = [(*p, v) for p in prefixes for v in range(ENGINE_V)]
        weights = joint.reshape(-1)
    return marginals


def engine_samples(path, draft, num_samples: int) -> tuple[list[list[int]], dict]:
    """``num_samples`` seeded continuations of the prompt, ``ENGINE_LENGTH`` tokens each,
    with the draft's guesses verified (``draft`` None: without speculation), and the
    engine's stats."""
    spec = draft and {"model": str(draft), "num_speculative_tokens": 2}
    llm = make_llm(path, speculative_config=spec)
    params = [
        SamplingParams(temperature=TEMPERATURE, seed=i, max_tokens=ENGINE_LENGTH, ignore_eos=True)
        for i in range(num_samples)
    ]
    prompts = [{"prompt_token_ids": ENGINE_PROMPT}] * num_samples
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.stats()


def position_p_values(samples, marginals) -> list[float]:
    """A chi-square test per position of the observed tokens against the exact
    marginal (cells expected fewer than 5 times pooled into one)."""
    p_values = []
    for position, exact_p in enumerate(marginals):
        counts = Counter(tokens[position] for tokens in samples)
        observed = torch.tensor([counts[v] for v in range(ENGINE_V)], dtype=torch.float64)
        expected = exact_p * len(samples)
        rare = expected < 5
        if rare.any():
            observed = torch.cat([observed[~rare], observed[rare].sum(0, keepdim=True)])
            expected = torch.cat([expected[~rare], expected[rare].sum(0, keepdim=True)])
        statistic = ((observed - expected) ** 2 / expected).sum()
        df = torch.tensor(len(expected) - 1, dtype=torch.float64)
        p_values.append(float(torch.special.gammaincc(df / 2, statistic / 2)))
    return p_values


def test_engine_samples_follow_the_target_with_and_without_speculation(small_vocab):
    """2000 seeded samples through the engine with the perturbed draft (and 1000
    without one, which checks the oracle and the test): the tokens at every position,
    the prefill's, the two verified guesses' and the bonus's, follow the target's exact
    marginal distribution (p > 1e-3 at each; the values were 0.1 to 0.9)."""
    path, hf, draft = small_vocab
    marginals = exact_marginals(hf)
    plain, _ = engine_samples(path, None, 1000)
    assert all(p > 1e-3 for p in position_p_values(plain, marginals))
    speculative, stats = engine_samples(path, draft, 2000)
    assert 0.1 < stats["spec_decode_acceptance_rate"] < 0.5  # rejections happen
    assert stats["spec_decode_num_accepted_tokens_per_pos_1"] > 0  # so do bonus tokens
    assert all(p > 1e-3 for p in position_p_values(speculative, marginals))


@pytest.mark.parametrize(
    "bug",
    [
        # min(1, q/p) instead of min(1, p/q): a draft's certain guess is always kept
        # (the guessed positions' p-values were 0 and 2e-37).
        "accept_q_over_p",
        # after a rejection, a draw from p instead of norm(max(0, p - q)): the rejected
        # guess comes back too often (p-values 1e-16 and 3e-10).
        "residual_is_p",
    ],
)
def test_a_planted_bug_fails_the_engine_test(small_vocab, bug, monkeypatch):
    path, hf, draft = small_vocab
    if bug == "accept_q_over_p":

        def accepts(p, q, generator, device):
            return q >= p or float(torch.rand((), generator=generator, device=device)) * p < q

        monkeypatch.setattr(rejection_sampler, "_accepts", accepts)
    else:
        monkeypatch.setattr(rejection_sampler, "_residual", lambda p, q: p)
    samples, _ = engine_samples(path, draft, 1000)
    assert any(p < 1e-6 for p in position_p_values(samples, exact_marginals(hf)))

"""Parallel sampling's sample phase: it chooses tokens and changes no request.

``ParallelSampling.sample`` over hand-made scheduled sequences and logits.  Oracles:
the argmax and ``log_softmax`` of a row for greedy requests; for seeded ones, the
sampler drawing the same row alone from a generator seeded by hand with vLLM's rule
(completion ``i`` of a request with seed ``s`` draws from ``s + i``).
"""

import torch

from minipaged import SamplingParams
from minipaged.core.sched.output import ScheduledSeq
from minipaged.sample.parallel_sampling import ParallelSampling
from minipaged.sample.sampler import sample
from minipaged.sequence import Sequence, SequenceGroup

VOCAB, EOS = 50, 49


def request(request_id, params, prompt=(1, 2, 3), arrival=0):
    """A request whose prompt has just run: one sequence, about to sample."""
    group = SequenceGroup(request_id, None, list(prompt), params, arrival)
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    group.seqs.append(Sequence(f"{request_id}.0", list(prompt), len(prompt), generator=generator))
    seq = group.seqs[0]
    return group, ScheduledSeq(seq, group, 0, len(prompt), [0], [0, 1, 2], samples=True)


def sampler(seed=0):
    return ParallelSampling({EOS}, torch.Generator().manual_seed(seed))


def logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_a_seeded_prompt_with_n_draws_each_completion_from_its_own_stream():
    params = SamplingParams(n=3, temperature=1.0, seed=40)
    group, scheduled = request("r", params)
    row = logits(1)
    samples = sampler().sample([scheduled], row, [0])
    assert [(s.group, s.seq, s.fork) for s in samples] == [
        (group, scheduled.seq, False),
        (group, scheduled.seq, True),
        (group, scheduled.seq, True),
    ]
    for i, s in enumerate(samples):
        stream = torch.Generator().manual_seed(40 + i)
        want = sample(row, [params], [stream], token_ids=[[1, 2, 3]], prompt_lens=[3])
        assert (s.token_id, s.logprob) == (want.token_ids[0], want.logprobs[0])
        if s.fork:  # the fork goes on drawing from where its first draw left its stream
            assert torch.equal(s.generator.get_state(), stream.get_state())
    # Choosing changed nothing: one sequence, its prompt only.
    assert group.seqs == [scheduled.seq] and scheduled.seq.token_ids == [1, 2, 3]


def test_each_sequence_reads_its_own_row_when_a_prompt_forks_before_it():
    greedy = SamplingParams(temperature=0, logprobs=2)
    first, a = request("a", SamplingParams(n=2, temperature=0))
    second, b = request("b", greedy, arrival=1)
    rows = logits(2, seed=1)
    samples = sampler().sample([a, b], rows, [0, 1])
    assert [s.group for s in samples] == [first, first, second]
    best = rows.argmax(-1).tolist()
    assert [s.token_id for s in samples] == [best[0], best[0], best[1]]
    logprobs = rows.log_softmax(-1)
    torch.testing.assert_close(samples[2].logprob, logprobs[1, best[1]].item())
    top = samples[2].top_logprobs  # the chosen token first, then the 2 most likely
    assert list(top)[0] == best[1] and len(top) == 2
    assert samples[0].top_logprobs is None  # not asked for


def test_requests_without_a_seed_share_the_engines_stream():
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        shared = sampler(seed=7)
        before = shared.generator.get_state()
        _, scheduled = request("r", params)
        runs.append([s.token_id for s in shared.sample([scheduled] * 4, logits(4), [0, 1, 2, 3])])
        assert not torch.equal(shared.generator.get_state(), before)  # it drew from it
    assert runs[0] == runs[1]  # the same seed, the same draws

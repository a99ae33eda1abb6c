"""The model runner: one scheduled batch in, the logits of the sequences that sample out.

Hand-made `ScheduledSeq`s over a KV cache manager's blocks and slots, on the tiny Llama
checkpoint; the oracle is Hugging Face's model on the same weights, one full forward
per sequence (no KV cache).
"""

import pytest
import torch

from engine_helpers import FP32, random_prompt
from minipaged.core.memory import KVCacheManager
from minipaged.core.sched.output import ScheduledSeq
from minipaged.models.attention import allocate_kv_caches
from minipaged.models.loader import load_model
from minipaged.sequence import Sequence
from minipaged.worker.model_runner import ModelRunner

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def setup(tiny):
    path, oracle = tiny("llama")
    model = load_model(path, "float32", "cpu", "torch")
    runner = ModelRunner(model, BLOCK_SIZE, torch.device("cpu"))
    caches = allocate_kv_caches(model, 32, BLOCK_SIZE, torch.float32, "cpu")
    return runner, caches, oracle


def run(kv, seq, start, end):
    """``seq``'s tokens ``[start, end)``, with the manager's blocks and slots for them."""
    tokens = seq.token_ids[start:end]
    if kv.has_block_table(seq.seq_id):
        allocation = kv.append(seq.seq_id, tokens)
    else:
        allocation = kv.allocate(seq.seq_id, tokens)
    samples = end == len(seq.token_ids)
    return ScheduledSeq(
        seq, None, start, end - start, allocation.block_table, allocation.slot_mapping, samples
    )


def test_only_sequences_that_reach_their_end_sample(setup):
    runner, caches, oracle = setup
    kv = KVCacheManager(32, BLOCK_SIZE)
    a = Sequence("a", random_prompt(10, seed=1), 10)
    b = Sequence("b", random_prompt(5, seed=2), 5)
    # Step 1: a chunk of A (no logits) and all of B.
    chunk, whole = run(kv, a, 0, 6), run(kv, b, 0, 5)
    sampling, logits = runner.execute([chunk, whole], caches)
    assert sampling == [whole] and logits.shape == (1, oracle.hf.config.vocab_size)
    torch.testing.assert_close(logits[0].log_softmax(-1), oracle.next_logprobs(b.token_ids), **FP32)
    # Step 2: B decodes a token, listed first; A's last chunk runs before it (prefills
    # first), and both sample, in that order.
    b.token_ids.append(7)
    decode, rest = run(kv, b, 5, 6), run(kv, a, 6, 10)
    sampling, logits = runner.execute([decode, rest], caches)
    assert sampling == [rest, decode]
    for s, row in zip(sampling, logits):
        torch.testing.assert_close(
            row.log_softmax(-1), oracle.next_logprobs(s.seq.token_ids), **FP32
        )


def test_a_step_that_samples_nothing_returns_no_logits(setup):
    runner, caches, _ = setup
    kv = KVCacheManager(32, BLOCK_SIZE)
    a = Sequence("a", random_prompt(9, seed=3), 9)
    assert runner.execute([run(kv, a, 0, 4)], caches) == ([], None)
    assert runner.execute([], caches) == ([], None)

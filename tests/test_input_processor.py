"""The input processor: a request checked, then made the group the scheduler queues.

No model: a scheduler over a small KV cache manager, and a stand-in tokenizer (the
detokenizer only keeps it until it decodes).  The oracle for a seeded sequence's random
stream is a fresh ``torch.Generator`` seeded by hand.
"""

import pytest
import torch

from minipaged import BeamSearchParams, SamplingParams
from minipaged.core.memory import KVCacheManager
from minipaged.core.sched.scheduler import Scheduler
from minipaged.engine.input_processor import InputProcessor

VOCAB, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS = 100, 32, 4, 16
TOKENIZER = object()


def processor(max_num_seqs=4):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    scheduler = Scheduler(kv, max_num_seqs, 64, max_model_len=MAX_MODEL_LEN)
    return InputProcessor(TOKENIZER, VOCAB, MAX_MODEL_LEN, scheduler, torch.device("cpu"))


def test_a_request_becomes_a_group_of_its_prompt():
    inputs = processor()
    prompt = [5, 6, 7]
    group = inputs.process("r", prompt, SamplingParams(n=2, seed=11, logprobs=3), "text")
    assert (group.request_id, group.prompt, group.prompt_token_ids) == ("r", "text", prompt)
    (seq,) = group.seqs  # one sequence until the prompt has run and forks (n = 2)
    assert seq.seq_id == "r.0" and seq.token_ids == prompt and seq.prompt_len == 3
    assert seq.token_ids is not prompt  # the caller's list stays the caller's
    assert seq.logprobs == [] and seq.detokenizer.tokenizer is TOKENIZER
    want = torch.rand(4, generator=torch.Generator().manual_seed(11))
    assert torch.equal(torch.rand(4, generator=seq.generator), want)  # completion 0: seed + 0


def test_plain_and_beam_search_requests_carry_only_what_they_use():
    inputs = processor()
    plain = inputs.process("a", [1], SamplingParams()).seqs[0]
    assert plain.generator is None and plain.logprobs is None  # the shared stream, no logprobs
    beams = inputs.process("b", [1], BeamSearchParams(beam_width=2)).seqs[0]
    assert beams.detokenizer is None  # a beam's text is decoded once, at the end


def test_requests_are_numbered_in_arrival_order_refusals_aside():
    inputs = processor()
    first = inputs.process("a", [1], SamplingParams())
    with pytest.raises(ValueError):
        inputs.process("b", [], SamplingParams())
    assert inputs.process("c", [1], SamplingParams()).arrival == first.arrival + 1


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        (
            [1],
            {"n": 2},
            "params must be SamplingParams, BeamSearchParams or PoolingParams, got dict",
        ),
        ([], SamplingParams(), "prompt must not be empty"),
        (
            [1, VOCAB],
            SamplingParams(),
            f"prompt_token_ids must be ints in \\[0, {VOCAB}\\), got {VOCAB}",
        ),
        ([1, 2.0], SamplingParams(), "prompt_token_ids must be ints .* got 2.0"),
        ([-1], SamplingParams(), "prompt_token_ids must be ints .* got -1"),
        ([1] * (MAX_MODEL_LEN + 1), SamplingParams(), f"more than max_model_len={MAX_MODEL_LEN}"),
        ([1], SamplingParams(n=5), "n=5 is more than max_num_seqs=4"),
        ([1], BeamSearchParams(beam_width=5), "beam_width=5 is more than max_num_seqs=4"),
        # 3 sequences of up to 32 tokens need 3 * 8 blocks; the pool has 16.
        ([1], SamplingParams(n=3, max_tokens=40), "may need 24 KV blocks, more than the pool's 16"),
    ],
)
def test_a_request_that_could_never_run_is_refused_naming_the_argument(prompt, params, message):
    inputs = processor()
    with pytest.raises(ValueError, match=message):
        inputs.process("r", prompt, params)
    assert not inputs.scheduler.requests  # nothing queued


def test_a_running_request_id_is_refused():
    inputs = processor()
    inputs.scheduler.add(inputs.process("r", [1], SamplingParams()))
    with pytest.raises(ValueError, match="request_id 'r' is already running"):
        inputs.check("r", [2], SamplingParams())
    inputs.scheduler.abort("r")
    inputs.check("r", [2], SamplingParams())  # free again once it has left

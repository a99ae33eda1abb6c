"""Mixture-of-experts models through the whole engine, against Hugging Face ``generate``.

Each family under swap preemption, prefix caching, chunked prefill and n > 1 at once;
then split over gloo processes: tensor parallelism (every rank a slice of every expert)
and expert parallelism on 2 and 4 ranks (whole experts per rank, 5 or 6 of them: the
ranks cannot share them evenly), with each all2all_backend.  The routing counts rank 0
reports must be the whole step's: they equal those of one process on the same workload.
"""

from __future__ import annotations

import pytest

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.core.memory.block_table import blocks_for

MAX_TOKENS = 8
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
SHARED = random_prompt(3 * BLOCK_SIZE, seed=99)  # three full blocks, for the prefix cache
PROMPTS = [
    random_prompt(3, 0),
    SHARED + random_prompt(14, 1),
    random_prompt(17, 2),
    SHARED + random_prompt(5, 3),
    random_prompt(9, 4),
]
# A pool that holds the largest request but not the batch: requests are swapped out.
POOL = dict(
    block_size=BLOCK_SIZE,
    preemption_mode="swap",
    enable_prefix_caching=True,
    num_gpu_blocks=max(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS) + 1,
    attention_backend="torch",
)


def generate(llm, prompts, params):
    return llm.generate(as_inputs(prompts), params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe"])
def test_greedy_equals_hf_with_every_feature_at_once(tiny, arch):
    """Swap preemption, prefix caching, chunked prefill (8 tokens a step) and n = 2."""
    path, oracle = tiny(arch)
    llm = make_llm(path, max_num_seqs=4, max_num_batched_tokens=8, **POOL)
    assert_greedy_matches_hf(generate(llm, PROMPTS, GREEDY), PROMPTS, oracle, MAX_TOKENS, 2)
    short = [PROMPTS[0], PROMPTS[4]]  # n = 2 of each fits the pool
    twice = generate(llm, short, SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS))
    for prompt, output in zip(short, twice):
        expected, _ = oracle.greedy(prompt, MAX_TOKENS)
        assert [c.token_ids for c in output.outputs] == [expected, expected]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_swapped_out_blocks"] > 0
    assert stats["prefix_cache_hit_rate"] > 0
    assert stats["expert_load_imbalance"] >= 1
    pairs = sum(map(sum, stats["expert_tokens_total"])) / len(stats["expert_tokens_total"])
    assert pairs >= 2 * sum(len(p) for p in PROMPTS)  # top-2 of every prompt token, at least
    assert_all_blocks_free(llm)


SPLITS = {
    "tp2-qwen2_moe": ("qwen2_moe", dict(tensor_parallel_size=2)),
    "ep2-alltoall-mixtral": (
        "mixtral",
        dict(tensor_parallel_size=2, enable_expert_parallel=True, all2all_backend="alltoall"),
    ),
    "ep4-allgather_reducescatter-olmoe": (
        "olmoe",
        dict(
            tensor_parallel_size=4,
            enable_expert_parallel=True,
            all2all_backend="allgather_reducescatter",
        ),
    ),
}


@pytest.mark.parametrize("split", SPLITS)
def test_split_over_ranks_equals_hf_and_one_process(tiny, split):
    arch, parallel = SPLITS[split]
    path, oracle = tiny(arch)
    llm = make_llm(path, **POOL, **parallel)
    try:
        outputs = generate(llm, PROMPTS, GREEDY)
        assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, logprobs=2)
        assert llm.stats()["num_swapped_out_blocks"] > 0
        assert_all_blocks_free(llm)
        one = make_llm(path, **POOL)
        generate(one, PROMPTS, GREEDY)
        assert llm.stats()["expert_tokens_total"] == one.stats()["expert_tokens_total"]
    finally:
        llm.shutdown()


def test_expert_parallel_layer_equals_the_loop_on_four_ranks():
    """Both ways of moving tokens, on 4 ranks holding 5 to 7 experts, for a step of
    fewer tokens than ranks too (some ranks own none)."""
    import torch.multiprocessing as mp

    from minipaged.distributed.parallel_state import free_port
    from moe_ranks import expert_parallel_rank

    mp.spawn(expert_parallel_rank, args=(4, free_port()), nprocs=4)

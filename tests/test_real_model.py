"""The engine on real trained weights (SmolLM2-135M-Instruct: Llama, 9 query to 3 KV
heads, tied embeddings): greedy replies to chat prompts equal Hugging Face ``generate``
token for token under every memory regime (§4.2 blocks, §4.5 swap and recompute
preemption, §4.4 prefix caching, chunked prefill), and seeded sampling is reproducible
from one engine to the next.  The weights come from the ``smollm2`` fixture."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_helpers import assert_all_blocks_free
from minipaged import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about memory."}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
MAX_TOKENS = 24
# HF runs in float32 below; "auto" would follow the checkpoint, which is bfloat16 when
# it came from the hub, so the engines compared with it name float32 too.
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """Each conversation through the chat template, as Hugging Face tokenizes it."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    return [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]
        for c in CONVERSATIONS
    ]


@pytest.fixture(scope="module")
def hf_greedy(smollm2, prompts) -> list[list[int]]:
    """The oracle: transformers' ``generate`` on the same weights, one prompt at a time
    (no padding), stopping at EOS as minipaged does."""
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    replies = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
            )
            replies.append(out[0, len(prompt) :].tolist())
    return replies


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_chat_equals_hf_generate_with_blocks_of_16(smollm2, prompts, hf_greedy):
    llm = LLM(
        smollm2, device="cpu", dtype="float32", block_size=16, num_gpu_blocks=32, swap_space=0
    )
    replies = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [r.prompt_token_ids for r in replies] == prompts
    assert [r.outputs[0].token_ids for r in replies] == hf_greedy
    text = replies[0].outputs[0].text
    assert "Paris" in text, text  # real weights: a real answer
    assert llm.stats()["num_preemptions"] == 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_equals_hf_when_a_small_pool_preempts(smollm2, prompts, hf_greedy, mode):
    # Blocks of 8, 14 of them: the three requests need ~27, so some are preempted.
    llm = LLM(
        smollm2,
        device="cpu",
        dtype="float32",
        block_size=8,
        num_gpu_blocks=14,
        swap_space=0.05,
        preemption_mode=mode,
    )
    assert greedy(llm, prompts) == hf_greedy
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_out_blocks"] > 0) == (mode == "swap")
    assert_all_blocks_free(llm)


def test_greedy_equals_hf_with_prefix_caching_and_chunked_prefill(smollm2, prompts, hf_greedy):
    # SmolLM2's template opens every prompt with the same system turn: cached blocks.
    llm = LLM(
        smollm2,
        device="cpu",
        dtype="float32",
        block_size=8,
        enable_prefix_caching=True,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        num_gpu_blocks=48,
        swap_space=0,
    )
    assert max(map(len, prompts)) > 16  # so every prompt is chunked
    assert greedy(llm, prompts) == hf_greedy
    assert greedy(llm, prompts) == hf_greedy  # now from cached prefixes
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_across_engines(smollm2, prompts):
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=11, max_tokens=12)
    inputs = [{"prompt_token_ids": p} for p in prompts[:2]]
    runs = []
    for block_size in (16, 8):
        llm = LLM(
            smollm2,
            device="cpu",
            block_size=block_size,
            num_gpu_blocks=64,
            swap_space=0,
        )
        outputs = llm.generate(inputs, params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outputs])
        assert_all_blocks_free(llm)
    assert runs[0] == runs[1]
    assert all(len({tuple(t) for t in request}) > 1 for request in runs[0])  # they differ

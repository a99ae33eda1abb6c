"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's meaning) against an
independent oracle: Hugging Face's forward pass over the same token ids and the
``log_softmax`` of its logits at every position.  Checked alone, across chunked
prefill, after a prefix-cache hit (which such a request does not read, as in vLLM),
under swap and recompute preemption, with ``n`` > 1, in bounded memory, and on real
SmolLM2 weights.  Tensor parallelism: `tests/test_distributed.py`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_prompt_logprobs_match_hf,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.core.memory.block_table import blocks_for

K = 3
PROMPTS = [random_prompt(length, seed) for seed, length in enumerate([1, 2, 9, 37, 20])]


def scoring(k: int = K, **kwargs) -> SamplingParams:
    return SamplingParams(prompt_logprobs=k, max_tokens=1, temperature=0, **kwargs)


def test_prompt_logprobs_equal_hf_forward(tiny):
    path, oracle = tiny("llama")
    llm = make_llm(path, block_size=4, num_gpu_blocks=64)
    outputs = llm.generate(as_inputs(PROMPTS), scoring(), use_tqdm=False)
    for output in outputs:
        assert_prompt_logprobs_match_hf(output, oracle.hf, K)
    plain = llm.generate(as_inputs(PROMPTS[:1]), SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain[0].prompt_logprobs is None
    assert_all_blocks_free(llm)


def test_zero_alternatives_gives_the_prompt_token_alone(tiny):
    path, oracle = tiny("qwen3")
    llm = make_llm(path, block_size=4, num_gpu_blocks=64)
    (output,) = llm.generate(as_inputs(PROMPTS[3:4]), scoring(0), use_tqdm=False)
    assert all(len(entry) == 1 for entry in output.prompt_logprobs[1:])
    assert_prompt_logprobs_match_hf(output, oracle.hf, 0)


def test_chunked_prefill_collects_every_chunk_once(tiny):
    path, oracle = tiny("llama")
    llm = make_llm(path, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8, max_num_seqs=4)
    outputs = llm.generate(as_inputs(PROMPTS), scoring(), use_tqdm=False)
    for output in outputs:
        assert_prompt_logprobs_match_hf(output, oracle.hf, K)


def test_a_cached_prefix_is_recomputed_for_its_logprobs_and_still_serves_others(tiny):
    """vLLM's choice: a request that wants prompt logprobs reads no cached block, so
    every token has logits; the blocks it fills serve the requests after it."""
    path, oracle = tiny("llama")
    llm = make_llm(path, block_size=4, num_gpu_blocks=64, enable_prefix_caching=True)
    prefix = random_prompt(16, seed=99)
    first, second, third = (prefix + random_prompt(5, seed=s) for s in (1, 2, 3))
    llm.generate(as_inputs([first]), SamplingParams(max_tokens=1), use_tqdm=False)
    hits = llm.engine.kv.gpu.num_hit_tokens
    (output,) = llm.generate(as_inputs([second]), scoring(), use_tqdm=False)
    assert_prompt_logprobs_match_hf(output, oracle.hf, K)
    assert llm.engine.kv.gpu.num_hit_tokens == hits  # it read nothing from the cache
    llm.generate(as_inputs([third]), SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.kv.gpu.num_hit_tokens == hits + len(prefix)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_neither_duplicates_nor_loses_an_entry(tiny, mode):
    """A pool too small for the batch preempts requests mid-generation (and, chunked,
    mid-prompt); each still gets exactly one entry per prompt token, HF's."""
    path, oracle = tiny("llama")
    prompts = PROMPTS[2:]
    max_tokens = 12
    llm = make_llm(
        path,
        block_size=4,
        num_gpu_blocks=2 * max(blocks_for(len(p) + max_tokens, 4) for p in prompts) + 1,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        preemption_mode=mode,
    )
    params = SamplingParams(
        prompt_logprobs=K, n=2, max_tokens=max_tokens, temperature=0.8, seed=0, ignore_eos=True
    )
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for output in outputs:
        assert len(output.outputs) == 2
        assert_prompt_logprobs_match_hf(output, oracle.hf, K)
    assert_all_blocks_free(llm)


def test_a_long_prompt_is_projected_a_chunk_of_rows_at_a_time(tiny, monkeypatch):
    """Never a ``[prompt_len, vocab]`` tensor: with room for 7 rows of logits per chunk,
    no projection gets more rows, and the result is the same."""
    import minipaged.sample.prompt_logprobs as module

    path, oracle = tiny("llama")
    llm = make_llm(path, block_size=4, num_gpu_blocks=64)
    vocab = llm.engine.vocab_size
    monkeypatch.setattr(module, "CHUNK_BYTES", 7 * 4 * vocab)
    model, seen = llm.engine.model, []
    project = model.compute_logits

    def recording(hidden):
        seen.append(hidden.shape[0])
        return project(hidden)

    monkeypatch.setattr(model, "compute_logits", recording)
    prompt = random_prompt(60, seed=5)
    (output,) = llm.generate(as_inputs([prompt]), scoring(), use_tqdm=False)
    assert max(seen) == 7 and sum(seen) == 59 + 1  # 59 scored rows, 1 sampled
    assert_prompt_logprobs_match_hf(output, oracle.hf, K)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_prompt_logprobs_must_be_an_int_at_least_zero(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be an int >= 0"):
        SamplingParams(prompt_logprobs=bad)


def test_smollm2_prompt_logprobs_equal_hf(smollm2):
    """Real weights (fp32, as HF's): a chat-formatted prompt and a plain sentence."""
    llm = make_llm(smollm2, dtype="float32", num_gpu_blocks=32, max_model_len=256)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome."),
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is a cache?"}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"],
    ]
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    outputs = llm.generate(as_inputs(prompts), scoring(5), use_tqdm=False)
    for output in outputs:
        assert_prompt_logprobs_match_hf(output, hf, 5, atol=1e-3)

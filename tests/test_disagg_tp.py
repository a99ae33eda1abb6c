"""Disaggregated prefill with tensor parallelism on one side: each rank holds its share
of the KV heads, the stored entries hold all of them (the producer's ranks gather theirs
on rank 0, a consumer's ranks each load their own slice), so the two sides' sizes may
differ.

The oracle is Hugging Face transformers on the same checkpoint: the consumer's greedy
tokens are HF's, whichever side is split, and the tokens it loaded are the prompts'
whole blocks (never a prompt's last token), counted from their lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine_helpers import (
    Oracle,
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.distributed.parallel_state import free_port

BLOCK_SIZE = 4
MAX_TOKENS = 5
PROMPTS = [random_prompt(n, seed) for seed, n in enumerate([22, 9, 14])]
SETTINGS = dict(block_size=BLOCK_SIZE, num_gpu_blocks=48)
SMOLLM2_TOKENS = 6


def loadable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama")  # 2 KV heads: one per rank at tensor_parallel_size=2


@pytest.mark.parametrize(
    "connector, producer_tp, consumer_tp",
    [("P2pTcpConnector", 2, 1), ("SharedStorageConnector", 1, 2)],
)
def test_one_side_split_over_two_ranks_decodes_as_hf(
    model, tmp_path, connector, producer_tp, consumer_tp
):
    extra = {"shared_storage_path": str(tmp_path)} if connector == "SharedStorageConnector" else {}
    port = free_port()

    def transfer(role):
        return {
            "kv_connector": connector,
            "kv_role": role,
            "kv_port": port,
            "kv_connector_extra_config": extra,
        }

    producer = make_llm(
        model[0],
        tensor_parallel_size=producer_tp,
        kv_transfer_config=transfer("kv_producer"),
        **SETTINGS,
    )
    producer.generate(as_inputs(PROMPTS), SamplingParams(max_tokens=1), use_tqdm=False)
    consumer = make_llm(
        model[0],
        tensor_parallel_size=consumer_tp,
        kv_transfer_config=transfer("kv_consumer"),
        **SETTINGS,
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = consumer.generate(as_inputs(PROMPTS), greedy, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS, model[1], MAX_TOKENS)
    assert consumer.stats()["num_external_computed_tokens"] == sum(map(loadable, PROMPTS))
    for llm in (producer, consumer):
        assert_all_blocks_free(llm)
        llm.shutdown()


# Four engines' processes and HF's model: about a minute on 2 cores.
def test_smollm2_prefilled_on_one_rank_decodes_as_hf_on_three(smollm2):
    """SmolLM2-135M (3 KV heads: one per rank at tensor_parallel_size=3) prefilled by a
    one-rank producer, decoded by a three-rank consumer over `P2pTcpConnector`: each
    consumer rank pulls its own KV head over its own connection, so the engine's
    counter (rank 0's) reads a third of the loaded blocks' bytes, computed from
    config.json; the greedy tokens are HF's, in float32."""
    config = json.loads((Path(smollm2) / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [
        tokenizer.encode(text)
        for text in (
            "The capital of France is Paris. The capital of Germany is Berlin. "
            "The capital of Italy is",
            "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively\n",
        )
    ]
    port = free_port()
    settings = dict(dtype="float32", num_gpu_blocks=32, max_model_len=128)

    def transfer(role):
        return {"kv_connector": "P2pTcpConnector", "kv_role": role, "kv_port": port}

    producer = make_llm(smollm2, kv_transfer_config=transfer("kv_producer"), **settings)
    producer.generate(as_inputs(prompts), SamplingParams(max_tokens=1), use_tqdm=False)
    consumer = make_llm(
        smollm2, tensor_parallel_size=3, kv_transfer_config=transfer("kv_consumer"), **settings
    )
    greedy = SamplingParams(temperature=0, max_tokens=SMOLLM2_TOKENS)
    outputs = consumer.generate(as_inputs(prompts), greedy, use_tqdm=False)
    stats = consumer.stats()
    for llm in (producer, consumer):
        assert_all_blocks_free(llm)
        llm.shutdown()
    oracle = Oracle(smollm2)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == oracle.greedy(prompt, SMOLLM2_TOKENS)[0]
    block_size = 16  # the engine's default
    loaded = sum((len(p) - 1) // block_size * block_size for p in prompts)
    assert loaded and stats["num_external_computed_tokens"] == loaded
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token_per_head = config["num_hidden_layers"] * 2 * head_dim * 4  # K and V, float32
    assert config["num_key_value_heads"] == 3
    assert stats["kv_connector_bytes_received"] == loaded * per_token_per_head


def test_kv_heads_replicated_over_ranks_are_refused(tiny):
    path, _ = tiny("llama", num_key_value_heads=1)
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/nonexistent"},
    }
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(path, tensor_parallel_size=2, kv_transfer_config=config, **SETTINGS)

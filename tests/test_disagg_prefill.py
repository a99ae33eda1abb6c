"""Disaggregated prefill through vLLM V1's KV connector API (``kv_transfer_config``,
`minipaged.distributed.kv_transfer`): a producer engine runs each prompt with
``max_tokens=1`` and its `SharedStorageConnector` saves the prompt's KV; a fresh
consumer engine asked the same prompts loads that KV into its own blocks instead of
computing it, and decodes.

The oracles: Hugging Face transformers on the same checkpoint (the consumer's greedy
output, and the keys the producer stored against HF's own cache of the prompt), and
arithmetic on the prompts for how many tokens each side computes (whole blocks load,
never a prompt's last token).  Both engines live in this one process.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.arg_utils import engine_kwargs
from minipaged.cli import build_parser
from minipaged.config import EngineConfig, KVTransferConfig
from minipaged.core.memory.block_table import blocks_for
from minipaged.distributed.kv_transfer.kv_connector.v1.shared_storage_connector import (
    prompt_key,
)
from minipaged.sampling_params import BeamSearchParams

BLOCK_SIZE = 4
MAX_TOKENS = 8
SHARED = random_prompt(12, 99)  # three blocks two prompts begin with
PROMPTS = [random_prompt(n, seed) for seed, n in enumerate([3, 30, 17, 9, 25])]
PROMPTS.append(SHARED + random_prompt(9, 50))
LOCAL = SHARED + random_prompt(6, 51)  # never stored: the consumer computes it
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PREFILL = SamplingParams(temperature=0, max_tokens=1)
POOL = 4 * sum(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS)
# Chunked prefill: a prompt takes several steps on both sides.
CHUNKED = dict(max_num_batched_tokens=8, max_num_seqs=4)


def transfer(role: str, storage) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def loadable(prompt: list[int], cached: int = 0) -> int:
    """The tokens a consumer loads: whole blocks, never the last token, past ``cached``."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE - cached


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def storage(model, tmp_path_factory):
    """A producer's prefills of PROMPTS (chunked), saved; its stats."""
    root = tmp_path_factory.mktemp("kv-store")
    producer = make_llm(
        model[0],
        block_size=BLOCK_SIZE,
        num_gpu_blocks=POOL,
        kv_transfer_config=transfer("kv_producer", root),
        **CHUNKED,
    )
    outputs = producer.generate(as_inputs(PROMPTS), PREFILL, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * len(PROMPTS)
    stats = producer.stats()
    assert_all_blocks_free(producer)
    producer.shutdown()
    return root, stats


def consume(model, root, prompts=PROMPTS, **kwargs):
    """A fresh consumer's greedy outputs of ``prompts``, checked against HF, and its
    stats, after checking no block leaked."""
    kwargs.setdefault("num_gpu_blocks", POOL)
    consumer = make_llm(
        model[0], block_size=BLOCK_SIZE, kv_transfer_config=transfer("kv_consumer", root), **kwargs
    )
    outputs = consumer.generate(as_inputs(prompts), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outputs, prompts, model[1], MAX_TOKENS)
    stats = consumer.stats()
    assert_all_blocks_free(consumer)
    consumer.shutdown()
    return stats


def hf_layer(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``i``'s keys and values in HF's cache, ``[batch, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache[i][0], cache[i][1]


def test_the_producer_computes_every_prompt_token_and_stores_only_its_blocks(model, storage):
    root, stats = storage
    assert stats["num_computed_prompt_tokens"] == sum(map(len, PROMPTS))
    assert stats["num_external_computed_tokens"] == 0
    hf = model[1].hf
    for prompt in PROMPTS:
        folder = root / prompt_key(prompt)
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["num_tokens"] == len(prompt)
        assert len(meta["files"]) == hf.config.num_hidden_layers
        with torch.no_grad():
            cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
        for i in range(hf.config.num_hidden_layers):
            stored = load_file(folder / f"model.layers.{i}.self_attn.attn.safetensors")
            keys, values = stored["0"], stored["1"]
            assert keys.shape[0] == blocks_for(len(prompt), BLOCK_SIZE)  # its blocks only
            # HF's cache is [batch, kv_heads, tokens, head_dim]; ours per token.
            hf_keys, hf_values = (t[0].transpose(0, 1) for t in hf_layer(cache, i))
            torch.testing.assert_close(
                keys.flatten(0, 1)[: len(prompt)], hf_keys, atol=2e-4, rtol=1e-5
            )
            torch.testing.assert_close(
                values.flatten(0, 1)[: len(prompt)], hf_values, atol=2e-4, rtol=1e-5
            )


def test_a_consumer_loads_what_it_lacks_and_computes_the_rest(model, storage):
    """Chunked, with prefix caching: LOCAL (not stored) is computed first and leaves
    SHARED's three blocks cached, so the last stored prompt loads only the blocks after
    them; every stored prompt computes only what does not load."""
    stats = consume(model, storage[0], [LOCAL, *PROMPTS], **dict(CHUNKED, max_num_seqs=1))
    cached = len(SHARED)
    loaded = [loadable(p) for p in PROMPTS[:-1]] + [loadable(PROMPTS[-1], cached)]
    assert stats["num_external_computed_tokens"] == sum(loaded)
    computed = len(LOCAL) + sum(len(p) - n for p, n in zip(PROMPTS, loaded)) - cached
    assert stats["num_computed_prompt_tokens"] == computed


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_preempted_consumer_request_loads_again_or_swaps(model, storage, preemption_mode):
    tight = max(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS) + 2
    stats = consume(
        model,
        storage[0],
        num_gpu_blocks=tight,
        preemption_mode=preemption_mode,
        enable_prefix_caching=False,
    )
    assert stats["num_preemptions"] > 0
    # Every admission loads: a request recomputed after preemption loads again.
    assert stats["num_external_computed_tokens"] >= sum(map(loadable, PROMPTS))
    if preemption_mode == "swap":
        assert stats["num_swapped_out_blocks"] > 0


def test_a_corrupt_or_missing_entry_is_computed_instead(model, storage, tmp_path, caplog):
    root = tmp_path / "store"
    shutil.copytree(storage[0], root)
    corrupt, missing = PROMPTS[1], PROMPTS[2]
    layer = root / prompt_key(corrupt) / "model.layers.0.self_attn.attn.safetensors"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    shutil.rmtree(root / prompt_key(missing))
    with caplog.at_level(logging.WARNING):
        stats = consume(model, root, enable_prefix_caching=False)
    assert "does not match its hash" in caplog.text
    stored = [p for p in PROMPTS if p not in (corrupt, missing)]
    assert stats["num_external_computed_tokens"] == sum(map(loadable, stored))


def test_an_aborted_consumer_request_frees_its_loaded_blocks(model, storage):
    consumer = make_llm(
        model[0],
        block_size=BLOCK_SIZE,
        num_gpu_blocks=POOL,
        kv_transfer_config=transfer("kv_consumer", storage[0]),
        enable_prefix_caching=False,
    )
    engine = consumer.engine
    engine.add_request("a", PROMPTS[1], GREEDY)
    engine.add_request("b", PROMPTS[4], GREEDY)
    engine.step()
    assert engine.stats()["num_external_computed_tokens"] == loadable(PROMPTS[1]) + loadable(
        PROMPTS[4]
    )
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(consumer)
    consumer.shutdown()


@pytest.mark.parametrize(
    ("setting", "field"),
    [({"block_size": 8}, "block_size"), ({"kv_cache_dtype": "int8"}, "kv_cache_dtype")],
)
def test_a_consumer_unlike_the_producer_is_refused_naming_the_field(model, storage, setting, field):
    kwargs = {"block_size": BLOCK_SIZE, **setting}
    with pytest.raises(ValueError, match=f"{field}="):
        make_llm(
            model[0],
            num_gpu_blocks=POOL,
            kv_transfer_config=transfer("kv_consumer", storage[0]),
            **kwargs,
        )


# -- the settings ----------------------------------------------------------------------
GOOD = transfer("kv_both", "/tmp/kv")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"kv_connector": "P2pNcclConnector"}, "kv_connector"),
        ({"kv_role": "kv_sender"}, "kv_role"),
        ({"kv_rank": 3}, "kv_rank"),
        ({"kv_parallel_size": 0}, "kv_parallel_size"),
        ({"kv_port": 70000}, "kv_port"),
        ({"kv_connector_extra_config": {}}, "shared_storage_path"),
        ({"kv_connector_extra_config": {"shared_storage_path": "/x", "x": 1}}, "'x'"),
        ({"kv_buffer_size": -1}, "kv_buffer_size"),
    ],
)
def test_a_bad_kv_transfer_config_is_refused_naming_the_field(change, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(model="m", kv_transfer_config={**GOOD, **change})


@pytest.mark.parametrize(
    "combo",
    [
        {"pipeline_parallel_size": 2},
        {"kv_cache_dtype": "fp8"},
        {"memory_mode": "contiguous-max"},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"compilation_config": 1},
    ],
)
def test_what_a_kv_connector_cannot_run_with_is_refused(combo):
    with pytest.raises(ValueError, match=f"kv_transfer_config cannot run with {next(iter(combo))}"):
        EngineConfig(model="m", kv_transfer_config=GOOD, **combo)


def test_the_serve_flag_takes_vllms_json():
    args = build_parser().parse_args(["serve", "m", "--kv-transfer-config", json.dumps(GOOD)])
    config = EngineConfig(model="m", **engine_kwargs(args))
    assert config.kv_transfer_config == KVTransferConfig(**GOOD)
    assert config.kv_transfer_config.is_kv_producer and config.kv_transfer_config.is_kv_consumer


def test_parallel_sampling_after_a_load_draws_what_a_single_engine_draws(model, storage):
    """n = 2, seeded: the completions fork from the loaded prompt's blocks (copy-on-write)
    and draw the same tokens as an engine without a connector that computed the prompt."""
    params = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = PROMPTS[1:3]
    runs = []
    for transfer_config in (None, transfer("kv_consumer", storage[0])):
        llm = make_llm(
            model[0], block_size=BLOCK_SIZE, num_gpu_blocks=POOL, kv_transfer_config=transfer_config
        )
        outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outputs])
        loaded = llm.stats()["num_external_computed_tokens"]
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert loaded == sum(map(loadable, prompts))
    assert runs[0] == runs[1]


def test_beam_search_after_a_load_ranks_what_a_single_engine_ranks(model, storage):
    """Beams fork from the loaded prompt's blocks; their tokens and scores are those of
    an engine without a connector."""
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    runs = []
    for transfer_config in (None, transfer("kv_consumer", storage[0])):
        llm = make_llm(
            model[0], block_size=BLOCK_SIZE, num_gpu_blocks=POOL, kv_transfer_config=transfer_config
        )
        outputs = llm.beam_search(as_inputs(PROMPTS[1:3]), params)
        runs.append([[(s.tokens, s.cum_logprob) for s in o.sequences] for o in outputs])
        loaded = llm.stats()["num_external_computed_tokens"]
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert loaded == sum(map(loadable, PROMPTS[1:3]))
    assert [[t for t, _ in r] for r in runs[0]] == [[t for t, _ in r] for r in runs[1]]
    for ours, theirs in zip(runs[0], runs[1]):
        assert [s for _, s in ours] == pytest.approx([s for _, s in theirs], abs=1e-4)


def test_an_int8_cache_moves_its_scales_with_its_blocks(model, tmp_path):
    """int8's scales are per token and KV head, in blocks like the values: a consumer's
    greedy tokens equal those of an int8 engine that computed the prompts."""
    runs = []
    for role in (None, "kv_producer", "kv_consumer"):
        llm = make_llm(
            model[0],
            block_size=BLOCK_SIZE,
            num_gpu_blocks=POOL,
            kv_cache_dtype="int8",
            kv_transfer_config=role and transfer(role, tmp_path),
        )
        params = PREFILL if role == "kv_producer" else GREEDY
        outputs = llm.generate(as_inputs(PROMPTS), params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outputs])
        loaded = llm.stats()["num_external_computed_tokens"]
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert loaded == sum(map(loadable, PROMPTS))
    assert runs[2] == runs[0]


def test_an_entry_removed_after_the_check_still_loads_what_was_checked(model, storage, tmp_path):
    """The worker copies the bytes the scheduler checked, not the files as they are
    when the step runs: removing the entry between the two changes nothing."""
    root = tmp_path / "store"
    shutil.copytree(storage[0], root)
    consumer = make_llm(
        model[0],
        block_size=BLOCK_SIZE,
        num_gpu_blocks=POOL,
        kv_transfer_config=transfer("kv_consumer", root),
    )
    execute = consumer.engine.executor.execute

    def remove_then_execute(batch):
        shutil.rmtree(root / prompt_key(PROMPTS[1]), ignore_errors=True)
        return execute(batch)

    consumer.engine.executor.execute = remove_then_execute
    outputs = consumer.generate(as_inputs([PROMPTS[1]]), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outputs, [PROMPTS[1]], model[1], MAX_TOKENS)
    assert consumer.stats()["num_external_computed_tokens"] == loadable(PROMPTS[1])
    assert not (root / prompt_key(PROMPTS[1])).exists()
    assert_all_blocks_free(consumer)
    consumer.shutdown()

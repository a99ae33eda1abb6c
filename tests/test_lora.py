"""Multi-LoRA serving against PEFT: each adapter alone, many in one batch, and what
they must not share.

The oracle is PEFT over Hugging Face's model with the same adapter files
(`lora_helpers`): minipaged's greedy tokens equal its ``generate``, whether a request
runs alone or interleaved with requests of other adapters and of the base model, under
swap preemption, chunked prefill, with fewer adapter slots than adapters (requests wait
for a slot) and over two tensor-parallel ranks.  The Punica ops are checked against a
per-token loop, the slot bookkeeping on its own, and the prefix cache by block ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from engine_helpers import as_inputs, assert_all_blocks_free, make_llm, random_prompt
from lora_helpers import PeftOracle, make_adapter
from minipaged import BeamSearchParams, SamplingParams
from minipaged.core.memory import KVCacheManager, prefix_cache
from minipaged.core.memory.lora_slots import LoRASlots
from minipaged.lora_request import LoRARequest
from minipaged.models.lora import read_adapter
from minipaged.ops.punica import bgmv, sgmv
from test_beam_search import reference_beam_search

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PROMPTS = [random_prompt(length, seed) for seed, length in enumerate([5, 23, 11, 3, 17, 9, 30, 14])]
# Three adapters unlike each other: every module at rank 8; three modules at rank 4;
# rank 16 with rsLoRA's scaling on the rest.
ADAPTERS = {
    "all8": dict(seed=1, r=8),
    "qvd4": dict(seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"]),
    "rs16": dict(
        seed=3, r=16, alpha=8, targets=["k_proj", "o_proj", "gate_proj", "up_proj"], use_rslora=True
    ),
}


@pytest.fixture(scope="module")
def lora(tiny, tmp_path_factory):
    """The tiny Llama, its adapters as LoRARequests (None: the base model), and the
    PEFT oracle of each."""
    base, _ = tiny("llama")
    root = tmp_path_factory.mktemp("adapters")
    requests, oracles = {None: None}, {None: PeftOracle(base)}
    for i, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        path = make_adapter(base, root / name, **spec)
        requests[name] = LoRARequest(name, i, str(path))
        oracles[name] = PeftOracle(base, path)
    return base, requests, oracles


def expected(oracles, names, prompts, max_tokens=MAX_TOKENS):
    return [oracles[n].greedy(tuple(p), max_tokens) for n, p in zip(names, prompts)]


def run(llm, requests, names, prompts, params=GREEDY):
    outputs = llm.generate(
        as_inputs(prompts), params, use_tqdm=False, lora_request=[requests[n] for n in names]
    )
    return [o.outputs[0].token_ids for o in outputs]


# -- the ops and the bookkeeping -------------------------------------------------------
def test_bgmv_and_sgmv_equal_a_per_token_loop():
    torch.manual_seed(0)
    slots, rank, d_in, d_out = 3, 4, 16, 24
    a, b = torch.randn(slots, rank, d_in), torch.randn(slots, d_out, rank)
    x = torch.randn(10, d_in)
    indices = torch.tensor([2, 2, -1, 0, 0, 0, 1, -1, 2, 2])
    loop = torch.stack(
        [
            x[t] @ a[i].T @ b[i].T if i >= 0 else torch.zeros(d_out)
            for t, i in enumerate(indices.tolist())
        ]
    )
    torch.testing.assert_close(bgmv(x, a, b, indices), loop)
    segments = [(2, 0, 2), (0, 3, 6), (1, 6, 7), (2, 8, 10)]
    torch.testing.assert_close(sgmv(x, a, b, segments), loop)


def test_slots_are_held_while_running_and_reused_least_recently_used_first():
    slots = LoRASlots(2)
    assert slots.acquire(None) == (-1, False)  # the base model needs no slot
    assert slots.acquire(7) == (0, True)
    assert slots.acquire(7) == (0, False)  # resident: no load
    assert slots.acquire(8) == (1, True)
    assert not slots.can_acquire(9)  # both held
    with pytest.raises(ValueError, match="no slot for adapter 9"):
        slots.acquire(9)
    slots.release(7)
    assert not slots.can_acquire(9)  # 7 still has a holder
    slots.release(7)
    slots.release(8)
    assert slots.acquire(8) == (1, False)  # idle but resident: back without a load
    assert slots.acquire(9) == (0, True)  # 7, idle longest, gives its slot
    assert slots.slot_of == {8: 1, 9: 0}
    assert not slots.unload(9)  # held
    slots.release(9)
    assert slots.unload(9) and slots.acquire(10) == (0, True)


# -- each adapter alone, then mixed ----------------------------------------------------
@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_each_adapter_alone_equals_peft(lora, name):
    base, requests, oracles = lora
    llm = make_llm(base, enable_lora=True, max_lora_rank=16)
    names = [name] * 3
    assert run(llm, requests, names, PROMPTS[:3]) == expected(oracles, names, PROMPTS[:3])


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(lora):
    """Three adapters and the base model interleaved, two slots: requests wait for a
    slot, the batch mixes adapters (prefills and decodes), each equals PEFT alone."""
    base, requests, oracles = lora
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=8)
    names = ["all8", None, "qvd4", "rs16", "all8", "qvd4", None, "rs16"]
    assert run(llm, requests, names, PROMPTS) == expected(oracles, names, PROMPTS)
    slots = llm.engine.scheduler.lora_slots
    assert slots.num_loads > 2  # three adapters through two slots
    assert not slots.holders  # every request let its slot go
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_mixed_adapters_under_preemption_and_chunked_prefill(lora, mode):
    """A preempted request gives its slot back, and gets one again to resume."""
    base, requests, oracles = lora
    llm = make_llm(
        base,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        num_gpu_blocks=14,  # the largest request fits, the batch does not
        preemption_mode=mode,
        max_num_batched_tokens=16,  # the 23- and 30-token prompts run in chunks
        max_num_seqs=8,
    )
    names = ["rs16", "all8", None, "qvd4", "all8", "rs16", "qvd4", None]
    assert run(llm, requests, names, PROMPTS) == expected(oracles, names, PROMPTS)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_out_blocks"] > 0) == (mode == "swap")
    assert_all_blocks_free(llm)


def test_beam_search_with_adapters_equals_the_reference_on_peft(lora):
    base, requests, oracles = lora
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    names = ["all8", "rs16", None]
    prompts = PROMPTS[:3]
    expected_beams = [reference_beam_search(oracles[n], p, params) for n, p in zip(names, prompts)]
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16)
    outputs = llm.beam_search(as_inputs(prompts), params, lora_request=[requests[n] for n in names])
    for out, best in zip(outputs, expected_beams):
        assert [s.tokens for s in out.sequences] == [t for t, _ in best]
    assert_all_blocks_free(llm)


def test_seeded_parallel_sampling_with_adapters_equals_each_alone(lora):
    base, requests, _ = lora
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16)
    names = ["all8", "qvd4", None]
    mixed = llm.generate(
        as_inputs(PROMPTS[:3]), params, use_tqdm=False, lora_request=[requests[n] for n in names]
    )
    for name, prompt, out in zip(names, PROMPTS, mixed):
        alone = llm.generate(
            as_inputs([prompt]), params, use_tqdm=False, lora_request=requests[name]
        )[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert_all_blocks_free(llm)


# -- the prefix cache keys on the adapter ----------------------------------------------
def test_prefix_cache_shares_blocks_within_an_adapter_never_across(lora):
    base, requests, oracles = lora
    llm = make_llm(base, enable_lora=True, max_loras=2, block_size=4, enable_prefix_caching=True)
    engine = llm.engine
    prompt = random_prompt(13, 50)  # three full blocks, one more token
    for i, name in enumerate(["all8", "all8", "qvd4", None]):
        engine.add_request(str(i), prompt, GREEDY, lora_request=requests[name])
    engine.step()  # every prompt allocated (the first's blocks are registered as it goes)
    tables = [engine.kv.block_table(f"{i}.0")[:3] for i in range(4)]
    assert tables[0] == tables[1]  # same adapter, same prompt: the same blocks
    assert not set(tables[0]) & set(tables[2]) and not set(tables[0]) & set(tables[3])
    assert not set(tables[2]) & set(tables[3])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    names = ["all8", "all8", "qvd4", None]
    assert [outputs[str(i)] for i in range(4)] == expected(oracles, names, [prompt] * 4)


# -- refusals --------------------------------------------------------------------------
def test_bad_requests_and_settings_are_refused_by_name(lora):
    base, requests, _ = lora
    plain = make_llm(base)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate("hi", GREEDY, lora_request=requests["all8"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        make_llm(base, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "somewhere")
    llm = make_llm(base, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"adapter_config.json: r must be .* max_lora_rank=8"):
        llm.generate("hi", GREEDY, lora_request=requests["rs16"])
    clash = LoRARequest("other", requests["all8"].lora_int_id, requests["qvd4"].lora_path)
    llm.generate("hi", GREEDY, use_tqdm=False, lora_request=requests["all8"])
    with pytest.raises(ValueError, match="give 'other' an id of its own"):
        llm.generate("hi", GREEDY, lora_request=clash)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], GREEDY, lora_request=[requests["all8"]])
    assert_all_blocks_free(llm)


def write_copy(src, dst, config_edit=None, weights_edit=None):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(
        json.dumps(config_edit(config) if config_edit else config)
    )
    weights = load_file(src / "adapter_model.safetensors")
    save_file(weights_edit(weights) if weights_edit else weights, dst / "adapter_model.safetensors")
    return dst


def test_malformed_adapters_name_the_file(lora, tmp_path):
    base, requests, _ = lora
    src = Path(requests["all8"].lora_path)
    config = AutoConfig.from_pretrained(base)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty/adapter_config.json: cannot read"):
        read_adapter(tmp_path / "empty", config, 16)
    dora = write_copy(src, tmp_path / "dora", lambda c: {**c, "use_dora": True})
    with pytest.raises(ValueError, match=r"dora/adapter_config.json: use_dora=True"):
        read_adapter(dora, config, 16)
    extra = write_copy(
        src,
        tmp_path / "embed",
        weights_edit=lambda w: {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},
    )
    with pytest.raises(ValueError, match=r"embed/adapter_model.safetensors: .*lm_head"):
        read_adapter(extra, config, 16)
    key = next(iter(load_file(src / "adapter_model.safetensors")))
    shape = write_copy(
        src, tmp_path / "shape", weights_edit=lambda w: {**w, key: torch.zeros(8, 3)}
    )
    with pytest.raises(ValueError, match=r"shape/adapter_model.safetensors: layer 0"):
        read_adapter(shape, config, 16)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "adapter_config.json").write_text(
        (src / "adapter_config.json").read_text()
    )
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"torn/adapter_model.safetensors: cannot read"):
        read_adapter(tmp_path / "torn", config, 16)


# -- tensor parallelism and the real model ---------------------------------------------
def test_two_ranks_shard_the_adapters_and_equal_peft(lora):
    """A and B split as their layers are (column: B's rows; row: A's columns, the term
    summed with the partial outputs); swap preemption in the mix."""
    base, requests, oracles = lora
    llm = make_llm(
        base,
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=4,
        num_gpu_blocks=14,
        preemption_mode="swap",
    )
    try:
        names = ["rs16", None, "all8", "qvd4", "all8", "rs16"]
        assert run(llm, requests, names, PROMPTS[:6]) == expected(oracles, names, PROMPTS[:6])
        assert llm.stats()["num_preemptions"] > 0
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_smollm2_with_adapters_equals_peft(smollm2, tmp_path):
    """Real weights: two adapters and the base model in one batch."""
    specs = {"a": dict(seed=4, r=8), "b": dict(seed=5, r=16, targets=["q_proj", "v_proj"])}
    requests = {None: None}
    oracles = {None: PeftOracle(smollm2)}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        path = make_adapter(smollm2, tmp_path / name, alpha=spec["r"] // 2, **spec)
        requests[name] = LoRARequest(name, i, str(path))
        oracles[name] = PeftOracle(smollm2, path)
    llm = make_llm(smollm2, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):")] * 3
    names = ["a", "b", None, "b", "a", None]
    assert run(llm, requests, names, prompts) == expected(oracles, names, prompts)


def test_the_prefix_cache_keeps_adapters_apart_when_hashes_collide(monkeypatch):
    """Blocks are told apart by their extra key itself, not only by its hash."""
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent_hash, tokens: 0)
    kv = KVCacheManager(8, 2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    kv.allocate("a", prompt, extra_key=1)
    assert kv.num_cached_tokens(prompt, 1) > 0
    assert kv.num_cached_tokens(prompt, 2) == kv.num_cached_tokens(prompt) == 0


def test_a_mixture_of_experts_model_is_refused_by_name(tiny):
    path, _ = tiny("mixtral")
    with pytest.raises(ValueError, match="enable_lora serves dense models"):
        make_llm(path, enable_lora=True)

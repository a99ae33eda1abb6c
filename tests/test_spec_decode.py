"""Speculative decoding end to end: lossless, whatever proposes, whatever the engine does.

The oracle is Hugging Face transformers on the same tiny checkpoint (greedy tokens and
raw logprobs), as in test_engine.py: with any proposer (the n-gram one; the target as
its own draft, which guesses right every time; a random draft, which rarely does) and
under preemption by recompute and swap, prefix caching, chunked prefill and n > 1, the
tokens and logprobs are HF's.  The stop conditions and penalties, which HF cannot
express all together, are checked against the same engine without speculation, which
is what losslessness promises.  After every workload every block of both pools (and
of the draft's) is free.  Then every attention backend, the other features (an fp8
cache against the fp8 engine without a draft, LoRA adapters against PEFT, mixtures of
experts against HF; int8 too), the draft's share of the KV budget against byte
counts taken from its checkpoint, and SmolLM2's real weights.  The rejection rule's
distribution is tested in test_spec_rejection.py, the lookahead slots in
test_spec_memory.py.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from lora_helpers import PeftOracle, make_adapter
from minipaged import LLM, BeamSearchParams, SamplingParams
from minipaged.config import EngineConfig
from minipaged.core.memory.block_table import blocks_for
from minipaged.lora_request import LoRARequest
from minipaged.worker.cache_engine import pool_sizes

MAX_TOKENS = 20
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


def draft(path, k=4):
    return {"model": str(path), "num_speculative_tokens": k}


def workload(oracle):
    """Ragged prompts, one that repeats itself (the n-gram proposer's case), and one
    whose greedy continuation stops at EOS early."""
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 23, 40)]
    return [*prompts, random_prompt(12, seed=3) * 3, oracle.eos_prompt(MAX_TOKENS)]


def generate(llm, prompts, params):
    return llm.generate(as_inputs(prompts), params, use_tqdm=False)


def assert_spec_done(llm):
    """Every block free, the draft's too, and no guess left over."""
    assert_all_blocks_free(llm)
    proposer = llm.engine.speculator.proposer
    if hasattr(proposer, "kv"):
        assert not proposer.kv.tables
        assert proposer.kv.gpu.num_free_blocks == proposer.kv.gpu.num_blocks


@pytest.fixture
def proposers(tiny):
    """name -> (speculative_config, the acceptance rate it must show)."""
    path, _ = tiny("llama")
    other, _ = tiny("llama", num_hidden_layers=1)  # other weights: a random draft
    return {
        "ngram": (NGRAM, lambda rate: rate > 0),
        "self-draft": (draft(path), lambda rate: rate == 1.0),
        "random-draft": (draft(other), lambda rate: rate < 0.5),
    }


@pytest.mark.parametrize("name", ["ngram", "self-draft", "random-draft"])
def test_greedy_equals_hf_whatever_proposes(tiny, proposers, name):
    path, oracle = tiny("llama")
    config, rate_ok = proposers[name]
    prompts = workload(oracle)
    llm = make_llm(path, speculative_config=config)
    outputs = generate(llm, prompts, GREEDY_LOGPROBS)
    assert_greedy_matches_hf(outputs, prompts, oracle, MAX_TOKENS, logprobs=3)
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert rate_ok(stats["spec_decode_acceptance_rate"]), stats
    assert stats["spec_decode_num_accepted_tokens"] == sum(
        stats[f"spec_decode_num_accepted_tokens_per_pos_{i}"]
        for i in range(config["num_speculative_tokens"])
    )
    assert_spec_done(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["ngram", "self-draft"])
def test_greedy_equals_hf_under_preemption(tiny, proposers, name, mode):
    """A pool barely larger than the largest request: lookahead slots preempt others
    like any tokens, and a preempted request's guesses are proposed again later."""
    path, oracle = tiny("llama")
    prompts = workload(oracle)
    block_size = 4
    largest = max(blocks_for(len(p) + MAX_TOKENS, block_size) for p in prompts)
    llm = make_llm(
        path,
        block_size=block_size,
        num_gpu_blocks=largest + 2,
        preemption_mode=mode,
        speculative_config=proposers[name][0],
    )
    assert_greedy_matches_hf(
        generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
    )
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert (stats["num_swapped_out_blocks"] > 0) == (mode == "swap")
    assert_spec_done(llm)


def test_greedy_equals_hf_with_prefix_caching(tiny):
    """Prompts sharing a prefix, twice: cached blocks are reused, and no block that held
    a rejected guess is ever found in the cache (the tokens would differ from HF's)."""
    path, oracle = tiny("llama")
    prefix = random_prompt(24, seed=99)
    prompts = [prefix + random_prompt(n, seed=200 + n) for n in (3, 11)] + [prefix * 2]
    llm = make_llm(
        path, block_size=4, enable_prefix_caching=True, speculative_config=draft(path, k=5)
    )
    for _ in range(2):
        assert_greedy_matches_hf(
            generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
        )
    assert llm.stats()["prefix_cache_hit_rate"] > 0.3
    assert_spec_done(llm)


def test_greedy_equals_hf_with_chunked_prefill(tiny):
    """A step budget of 8 tokens: prompts are chunked beside other requests' verifying
    decodes, whose guesses are cut to fit the budget."""
    path, oracle = tiny("llama")
    prompts = workload(oracle)
    llm = make_llm(
        path,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        trace=True,
        speculative_config=draft(path, k=6),
    )
    assert_greedy_matches_hf(
        generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
    )
    steps = {}
    for e in llm.engine.trace.events:
        if e.kind == "schedule":
            steps[e.step] = steps.get(e.step, 0) + e.detail["num_tokens"]
    assert max(steps.values()) == 8
    assert any(e.kind == "append" and e.detail["num_lookahead"] for e in llm.engine.trace.events)
    assert_spec_done(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_greedy_completions_equal_hf(tiny, mode):
    """n=3 forks share their prompt's blocks; each writes its guesses into its own copy
    of a shared last block (copy-on-write), under preemption too."""
    path, oracle = tiny("llama")
    prompts = [random_prompt(n, seed=400 + n) for n in (7, 18)]
    block_size = 4
    worst = max(3 * blocks_for(len(p) + MAX_TOKENS, block_size) for p in prompts)
    llm = make_llm(
        path,
        block_size=block_size,
        num_gpu_blocks=worst + 2,
        preemption_mode=mode,
        speculative_config=draft(path),
    )
    outputs = generate(llm, prompts, SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, outputs):
        expected, _ = oracle.greedy(prompt, MAX_TOKENS)
        assert [c.token_ids for c in out.outputs] == [expected] * 3
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0
    assert_spec_done(llm)


def test_stops_penalties_and_logprobs_behave_as_without_speculation(tiny):
    """The target as its own draft accepts every guess, so guesses run past every stop:
    max_tokens, stop token ids, stop strings, min_tokens and penalties must still end
    and score each completion exactly as plain decoding does."""
    path, oracle = tiny("llama")
    prompt = random_prompt(10, seed=5)
    plain_tokens, _ = oracle.greedy(prompt, MAX_TOKENS)
    text = oracle.tokenizer.decode(plain_tokens[6:9])
    cases = [
        SamplingParams(temperature=0, max_tokens=7, logprobs=2),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[plain_tokens[5]]),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[text]),
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[plain_tokens[2]], min_tokens=4
        ),
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            repetition_penalty=1.5,
            frequency_penalty=0.7,
            presence_penalty=0.3,
            logprobs=1,
        ),
    ]
    prompts = [prompt] * len(cases)
    plain = generate(make_llm(path), prompts, cases)
    llm = make_llm(path, speculative_config=draft(path, k=5))
    spec = generate(llm, prompts, cases)
    for params, a, b in zip(cases, plain, spec):
        a, b = a.outputs[0], b.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.text,
            a.finish_reason,
            a.stop_reason,
        ), params
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)
        if params.logprobs:
            assert [list(d) for d in b.logprobs] == [list(d) for d in a.logprobs]
    # HF's greedy tokens say where the first two end.
    stop_at = plain_tokens.index(plain_tokens[5]) + 1
    assert [o.outputs[0].token_ids for o in spec][:2] == [plain_tokens[:7], plain_tokens[:stop_at]]
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_spec_done(llm)


def test_seeded_sampling_reproduces_alone_in_a_batch_and_across_instances(tiny):
    """With temperature > 0 the guesses are accepted at random, yet a seeded request
    draws the same tokens alone, in a batch, and in another LLM instance."""
    path, _ = tiny("qwen2")
    prompt = random_prompt(8, seed=1) * 3
    seeded = SamplingParams(temperature=0.7, seed=1234, max_tokens=16)
    llm = make_llm(path, speculative_config=NGRAM)
    alone = generate(llm, [prompt], seeded)[0].outputs[0].token_ids
    batch = generate(
        llm,
        [random_prompt(30, seed=2), prompt],
        [SamplingParams(temperature=1.0, max_tokens=16), seeded],
    )
    assert batch[1].outputs[0].token_ids == alone
    again = make_llm(path, seed=42, speculative_config=NGRAM)
    assert generate(again, [prompt], seeded)[0].outputs[0].token_ids == alone
    assert again.stats()["spec_decode_num_drafts"] > 0
    assert_spec_done(llm)
    assert_spec_done(again)


@pytest.mark.parametrize(
    "config,key",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "draft_tensor_parallel_size",
        ),  # fmt: skip
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(tiny, config, key):
    path, _ = tiny("llama")
    with pytest.raises(ValueError, match=key):
        make_llm(path, speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused(tiny):
    path, _ = tiny("llama")
    other, _ = tiny("llama", vocab_size=300)
    with pytest.raises(ValueError, match="'model'.*vocabulary"):
        make_llm(path, speculative_config=draft(other))


def test_beam_search_and_contiguous_memory_are_refused(tiny):
    path, _ = tiny("llama")
    llm = make_llm(path, speculative_config=NGRAM)
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search([{"prompt_token_ids": [1, 2, 3]}], BeamSearchParams(beam_width=2))
    assert_spec_done(llm)
    with pytest.raises(ValueError, match="memory_mode"):
        make_llm(path, memory_mode="contiguous-max", speculative_config=NGRAM)


def test_greedy_equals_hf_with_two_ranks(tiny, proposers):
    """Tensor parallelism: every rank runs the guesses in its step (the plan carries
    them) and computes the same 1 + k logit rows; the draft runs on rank 0 only."""
    path, oracle = tiny("llama")
    prompts = workload(oracle)
    llm = make_llm(
        path, tensor_parallel_size=2, block_size=4, speculative_config=proposers["self-draft"][0]
    )
    try:
        assert_greedy_matches_hf(
            generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
        )
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
        assert_spec_done(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_every_attention_backend_verifies_multi_token_queries(tiny, backend):
    """The verifying pass is a prefill of ``1 + k`` tokens over a sequence's paged
    context: the torch reference, Triton (interpreted) and CUDA (emulated) kernels give
    HF's tokens and logprobs too (the C++ CPU kernel, the default, in every test above),
    on a checkpoint with a head_dim the CUDA kernels are built for."""
    path, oracle = tiny("llama", head_dim=64)
    prompts = [random_prompt(n, seed=n) for n in (5, 11)]
    llm = make_llm(
        path,
        block_size=8,
        num_gpu_blocks=8,
        attention_backend=backend,
        speculative_config=draft(path, k=3),
    )
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    assert_greedy_matches_hf(generate(llm, prompts, params), prompts, oracle, 8, logprobs=2)
    assert llm.stats()["spec_decode_acceptance_rate"] == 1.0
    assert_spec_done(llm)


# -- beside the quantized KV cache, LoRA adapters and mixtures of experts ---------------
@pytest.mark.parametrize(
    "kv_cache_dtype, calculate_kv_scales", [("fp8", False), ("fp8", True), ("int8", False)]
)
def test_quantized_kv_cache_decodes_as_without_speculation(
    tiny, proposers, kv_cache_dtype, calculate_kv_scales
):
    """A quantized cache changes the tokens (HF is no oracle here), speculation must
    not: greedy tokens equal the same engine's without a draft.  The draft's pool is
    quantized too, so the target as its own draft still guesses right every time; fp8's
    scales, when calculated, come from its own first batch; int8's are each token's own,
    so a rejected guess's slot, written again later, leaves no trace."""
    path, oracle = tiny("llama")
    prompts = workload(oracle)
    quantized = dict(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales)
    plain = generate(make_llm(path, **quantized), prompts, GREEDY_LOGPROBS)
    for name in ("ngram", "self-draft"):
        config, _ = proposers[name]
        llm = make_llm(path, speculative_config=config, **quantized)
        spec = generate(llm, prompts, GREEDY_LOGPROBS)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
        assert llm.stats()["spec_decode_num_drafts"] > 0
        assert_spec_done(llm)
    assert llm.stats()["spec_decode_acceptance_rate"] == 1.0
    if kv_cache_dtype == "fp8":
        draft_scale = float(llm.engine.speculator.proposer.caches[0][2])
        assert (draft_scale != 1.0) == calculate_kv_scales


def test_lora_adapters_equal_peft(tiny, tmp_path):
    """Requests of two adapters and of the base model in one batch: the base model as
    draft guesses without any adapter, and the verification keeps exactly PEFT's
    greedy tokens for each request's own adapter."""
    base, _ = tiny("llama")
    adapters = {
        None: (None, PeftOracle(base)),
        "all8": (path := make_adapter(base, tmp_path / "all8", seed=1), PeftOracle(base, path)),
        "qv4": (
            path := make_adapter(base, tmp_path / "qv4", seed=2, r=4, targets=["q_proj", "v_proj"]),
            PeftOracle(base, path),
        ),
    }
    requests = {None: None, "all8": LoRARequest("all8", 1, str(adapters["all8"][0]))}
    requests["qv4"] = LoRARequest("qv4", 2, str(adapters["qv4"][0]))
    names = ["all8", None, "qv4", "all8", "qv4"]
    prompts = [random_prompt(n, seed=500 + n) for n in (5, 17, 9, 30, 12)]
    llm = make_llm(
        base, enable_lora=True, max_loras=2, max_lora_rank=8, speculative_config=draft(base)
    )
    outputs = llm.generate(
        as_inputs(prompts),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
        lora_request=[requests[n] for n in names],
    )
    expected = [adapters[n][1].greedy(tuple(p), MAX_TOKENS) for n, p in zip(names, prompts)]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert 0 < llm.stats()["spec_decode_acceptance_rate"] < 1  # the adapters disagree
    assert_spec_done(llm)


@pytest.mark.parametrize("arch,draft_arch", [("mixtral", "mixtral"), ("qwen2_moe", "llama")])
def test_mixture_of_experts_equals_hf(tiny, arch, draft_arch):
    """A mixture-of-experts target verifies 1 + k tokens per sequence like any step
    (each routed on its own); its draft may be itself or a dense model."""
    path, oracle = tiny(arch)
    draft_path, _ = tiny(draft_arch)
    prompts = workload(oracle)
    llm = make_llm(path, speculative_config=draft(draft_path, k=3))
    assert_greedy_matches_hf(
        generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
    )
    rate = llm.stats()["spec_decode_acceptance_rate"]
    assert rate == 1.0 if draft_arch == arch else rate < 0.5
    assert_spec_done(llm)


# -- memory ----------------------------------------------------------------------------
def kv_bytes_per_block(path, block_size: int) -> int:
    """A block's keys and values over every layer, from the checkpoint's config.json
    (float32 weights, hence a float32 cache)."""
    c = json.loads((path / "config.json").read_text())
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * block_size * 4


def test_the_draft_model_shares_the_kv_budget_and_shows_its_bytes(tiny):
    """1 MiB of KV pool on the CPU: with a one-layer draft, a block costs the target's
    bytes and the draft's, so the budget holds fewer blocks; the tensors both pools
    really allocated fit it.  stats() shows the draft's weights (the bytes of its
    checkpoint's tensors) and its block bytes."""
    path, _ = tiny("llama")
    other, _ = tiny("llama", num_hidden_layers=1)
    budget, block_size = 1 << 20, 16
    target_block, draft_block = (kv_bytes_per_block(p, block_size) for p in (path, other))
    llm = make_llm(
        path,
        cpu_kv_space=budget / (1 << 30),
        block_size=block_size,
        speculative_config=draft(other),
    )
    stats = llm.stats()
    assert stats["num_gpu_blocks"] == budget // (target_block + draft_block)
    assert stats["kv_cache_block_bytes"] == target_block
    assert stats["draft_kv_cache_block_bytes"] == draft_block
    pools = [llm.engine.cache_engine.gpu_cache, llm.engine.speculator.proposer.caches]
    allocated = sum(t.nbytes for pool in pools for layer in pool for t in layer)
    assert budget - (target_block + draft_block) < allocated <= budget
    with safe_open(other / "model.safetensors", "pt") as checkpoint:
        weights = sum(checkpoint.get_tensor(k).nbytes for k in checkpoint.keys())  # noqa: SIM118
    assert stats["draft_weight_bytes"] == weights
    ngram = make_llm(
        path, cpu_kv_space=budget / (1 << 30), block_size=block_size, speculative_config=NGRAM
    ).stats()
    assert ngram["num_gpu_blocks"] == budget // target_block
    assert "draft_weight_bytes" not in ngram


def test_smollm2_with_the_ngram_proposer_equals_hf(smollm2):
    """Real weights: asked to repeat a sentence, SmolLM2 copies its prompt, the n-gram
    proposer guesses the copy, and the tokens are still transformers' greedy ones."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    sentence = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree."
    conversation = [{"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}]
    prompt = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24
        )
    llm = LLM(
        smollm2,
        device="cpu",
        num_gpu_blocks=16,
        swap_space=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    params = SamplingParams(temperature=0, max_tokens=24)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == out[0, len(prompt) :].tolist()
    assert llm.stats()["spec_decode_acceptance_rate"] > 0.3  # (0.5 when written)
    assert_spec_done(llm)


def test_a_profiled_budget_pays_for_both_pools_and_swaps_the_targets_blocks_only():
    """On CUDA the budget is what profiling leaves (the draft's weights already loaded,
    so already taken): each block of it costs the target's bytes and the draft's, and
    the swap pool, which holds only the target's blocks, is sized by the target's."""
    config = EngineConfig(model="unused", num_gpu_blocks=None, swap_space=1 / 1024)
    target_block, draft_block, budget = 3000, 1000, 10**6
    gpu, cpu = pool_sizes(
        config, 64, torch.device("cuda"), target_block, lambda: budget, draft_block
    )
    assert gpu == 250  # 10**6 // 4000
    assert cpu == (1 << 20) // 3000

"""Pipeline parallelism end to end: the engine's layers cut into stages over gloo
processes on the CPU, alone and with tensor parallelism inside each stage.

The oracle is Hugging Face's ``generate`` on the same weights, and minipaged without
stages for what has no HF counterpart (seeded sampling, beam search).  The tiny models
have 3 layers, which 2 stages split unevenly (vLLM's rule: 2 then 1); SmolLM2's 30
split 10/10/10.  The checks run under swap and recompute preemption, chunked prefill
and prefix caching, as the pools are set up; every block is free after each.  Spawning
ranks costs seconds, so one engine serves several checks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged.core.memory.block_table import blocks_for
from minipaged.sampling_params import BeamSearchParams, SamplingParams

MAX_TOKENS = 10
BLOCK_SIZE = 4
LAYERS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
SEEDED = SamplingParams(
    n=2, temperature=0.9, top_p=0.9, max_tokens=MAX_TOKENS, seed=7, ignore_eos=True
)
PROMPTS = [random_prompt(length, seed) for seed, length in enumerate([3, 30, 17, 9])]
# A pool that holds the largest request but not the batch: requests are preempted; a
# step's budget of 16 tokens chunks the 30- and 17-token prompts.
POOL = dict(
    block_size=BLOCK_SIZE,
    enable_prefix_caching=True,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    num_gpu_blocks=max(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS) + 1,
)


def generate(llm, prompts, params):
    return llm.generate(as_inputs(prompts), params, use_tqdm=False)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def three_layers(tiny):
    return tiny("llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="class")
def engines(three_layers):
    """The 3-layer tiny Llama in 2 stages and in one, both swapping."""
    path, oracle = three_layers
    pp2 = make_llm(path, pipeline_parallel_size=2, preemption_mode="swap", **POOL)
    yield pp2, make_llm(path, preemption_mode="swap", **POOL), oracle
    pp2.shutdown()


class TestTwoStages:
    def test_greedy_equals_hf_under_swap_preemption_and_chunked_prefill(self, engines):
        pp2, _, oracle = engines
        outputs = generate(pp2, PROMPTS, GREEDY)
        assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, logprobs=2)
        stats = pp2.stats()
        assert stats["num_preemptions"] > 0 and stats["num_swapped_out_blocks"] > 0
        assert_all_blocks_free(pp2)
        # Stage 0 holds layers 0-1, stage 1 layer 2, each in the same number of blocks.
        assert pp2.engine.executor.cache_layers == [2, 1]
        assert pp2.engine.executor.cache_shapes == [(POOL["num_gpu_blocks"], BLOCK_SIZE, 2, 16)] * 2

    def test_a_block_is_sized_by_the_biggest_stage(self, engines):
        pp2, pp1, _ = engines
        # Keys and values of 2 layers, 2 KV heads of 16 float32s, 4 tokens (not 3 layers).
        assert pp2.engine.block_bytes == 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE
        assert pp1.engine.block_bytes == 2 * LAYERS * 2 * 16 * 4 * BLOCK_SIZE

    def test_prefix_caching_reuses_blocks_on_every_stage(self, engines):
        pp2, _, oracle = engines
        shared = random_prompt(3 * BLOCK_SIZE, 99)
        prompts = [shared + [65], shared + [66, 67]]
        first = generate(pp2, prompts[:1], GREEDY)
        before = pp2.stats()["prefix_cache_hit_rate"]
        second = generate(pp2, prompts[1:], GREEDY)  # its 3 full blocks come from the cache
        assert_greedy_matches_hf(first + second, prompts, oracle, MAX_TOKENS, logprobs=2)
        assert pp2.stats()["prefix_cache_hit_rate"] > before
        assert_all_blocks_free(pp2)

    def test_seeded_sampling_and_copy_on_write_equal_one_stage(self, engines):
        pp2, pp1, _ = engines
        prompts = [PROMPTS[0], PROMPTS[3]]
        ours = tokens(generate(pp2, prompts, SEEDED))
        assert ours == tokens(generate(pp1, prompts, SEEDED))
        assert ours[0][0] != ours[0][1]  # truly sampled, not greedy twice
        assert_all_blocks_free(pp2)

    def test_beam_search_equals_one_stage(self, engines):
        pp2, pp1, _ = engines
        params = BeamSearchParams(beam_width=2, max_tokens=6)
        prompts = as_inputs([PROMPTS[0], PROMPTS[3]])
        ours, theirs = pp2.beam_search(prompts, params), pp1.beam_search(prompts, params)
        assert [[b.tokens for b in o.sequences] for o in ours] == [
            [b.tokens for b in o.sequences] for o in theirs
        ]
        assert_all_blocks_free(pp2)

    def test_the_timeline_counts_what_went_between_the_stages(self, engines):
        pp2, _, _ = engines
        executor = pp2.engine.executor
        executor.timelines()  # start afresh
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        generate(pp2, [random_prompt(5, 123)], params)
        driver, last = executor.timelines()
        # 5 prompt tokens, then 2 decodes: 7 rows of 64 float32s go to stage 1, whose
        # 3 sampled rows of logits (vocabulary 272) come back.
        assert driver["bytes_sent"] == 7 * 64 * 4
        assert last["bytes_sent"] == 3 * 272 * 4
        kinds = [{kind for kind, _, _ in rank["events"]} for rank in (driver, last)]
        assert kinds == [{"forward", "send", "recv"}] * 2
        assert all(end >= start for rank in (driver, last) for _, start, end in rank["events"])

    def test_prompt_logprobs_are_refused_alone(self, engines):
        pp2, _, oracle = engines
        bad = SamplingParams(prompt_logprobs=1, max_tokens=2)
        with pytest.raises(ValueError, match="prompt_logprobs cannot run with pipeline"):
            generate(pp2, PROMPTS[:1], bad)
        assert_greedy_matches_hf(
            generate(pp2, PROMPTS[:1], GREEDY), PROMPTS[:1], oracle, MAX_TOKENS
        )
        assert_all_blocks_free(pp2)


def test_two_ranks_by_two_stages_equal_hf_under_recompute_preemption(three_layers):
    """vLLM's layout: ranks 0-1 are stage 0, 2-3 stage 1; each stage's two ranks hold
    one KV head each of its layers.  Then a rank of the last stage dies mid-step, while
    the driver waits for its logits: the driver names it and stops the others."""
    path, oracle = three_layers
    llm = make_llm(path, tensor_parallel_size=2, pipeline_parallel_size=2, **POOL)
    outputs = generate(llm, PROMPTS, GREEDY)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, logprobs=2)
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)
    assert llm.engine.executor.cache_layers == [2, 2, 1, 1]
    assert llm.engine.executor.cache_shapes == [(POOL["num_gpu_blocks"], BLOCK_SIZE, 1, 16)] * 4
    victim, execute = llm.engine.workers.processes[2], llm.engine.runner.execute_model

    def kill_then_execute(*args):
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        return execute(*args)

    llm.engine.runner.execute_model = kill_then_execute
    named = f"worker rank 3 on .* \\(127.0.0.1, pid {victim.pid}\\) died"
    with pytest.raises(RuntimeError, match=named):
        generate(llm, PROMPTS[:1], GREEDY)
    assert not any(p.is_alive() for p in llm.engine.workers.processes)
    assert_all_blocks_free(llm)


def test_smollm2_in_three_stages_equals_hf_generate(smollm2):
    """SmolLM2-135M's 30 layers in 3 stages of 10; its tied LM head on the last stage,
    read from the embedding's tensor, gives HF's greedy answer."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
        prompt = prompt["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12
        )[0, len(prompt) :].tolist()
    del hf
    llm = make_llm(  # in HF's float32, whatever the checkpoint's dtype
        smollm2, dtype="float32", pipeline_parallel_size=3, num_gpu_blocks=16, max_model_len=256
    )
    out = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=12))
    assert out[0].outputs[0].token_ids == expected
    assert llm.engine.executor.cache_layers == [10, 10, 10]
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2"])
def test_pipeline_parallel_size_must_be_a_positive_int(size):
    from minipaged.config import EngineConfig

    with pytest.raises(
        ValueError, match=f"pipeline_parallel_size must be an int >= 1, got {size!r}"
    ):
        EngineConfig(model="m", pipeline_parallel_size=size)


@pytest.mark.parametrize(
    "other",
    [
        {"enable_lora": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"enable_expert_parallel": True},
    ],
)
def test_what_stages_cannot_run_is_refused(other):
    from minipaged.config import EngineConfig

    name = next(iter(other))
    with pytest.raises(ValueError, match=f"{name} cannot run with pipeline_parallel_size=2"):
        EngineConfig(model="m", pipeline_parallel_size=2, **other)


def test_more_stages_than_layers_is_refused_before_any_process_starts(three_layers):
    path, _ = three_layers
    before = set(multiprocessing.active_children())
    with pytest.raises(
        ValueError,
        match="pipeline_parallel_size=4 must be at most the model's num_hidden_layers \\(3\\)",
    ):
        make_llm(path, pipeline_parallel_size=4)
    assert set(multiprocessing.active_children()) == before


def test_a_mixture_of_experts_model_is_refused(tiny):
    path, _ = tiny("mixtral")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported for Mixtral"):
        make_llm(path, pipeline_parallel_size=2)


@pytest.mark.parametrize(
    "command", [["generate", "--model", "M", "hi"], ["serve", "M"], ["bench", "throughput"]]
)
def test_pipeline_parallel_size_flag(command):
    from minipaged.arg_utils import engine_kwargs
    from minipaged.cli import build_parser

    args = build_parser().parse_args([*command, "--pipeline-parallel-size", "2"])
    assert engine_kwargs(args)["pipeline_parallel_size"] == 2


def test_bench_throughput_measures_the_bubble_and_the_bytes_between_stages(three_layers, tmp_path):
    from minipaged.cli import main

    path, _ = three_layers
    json_path = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--preset", "cpu", "--num-requests", "6"]
    argv += ["--length-scale", "0.25", "--overhead-steps", "0", "--systems", "minipaged-cpu"]
    argv += ["--pipeline-parallel-size", "2", "--model", str(path), "--json", str(json_path)]
    argv += ["--no-enable-prefix-caching"]  # so every prompt token runs
    assert main(argv) == 0
    doc = json.loads(json_path.read_text())
    one, staged = doc["results"]
    assert [one["system"], staged["system"]] == ["minipaged-cpu", "minipaged-cpu-pp2"]
    assert staged["speedup_vs_one_rank"] == pytest.approx(
        staged["output_tokens_per_s"] / one["output_tokens_per_s"]
    )
    # Every prompt token and every output token but the last runs once, its 64 float32s
    # sent from stage 0 to stage 1 (no preemption in a pool this big).
    workload = doc["workload"]
    rows = sum(workload["prompt_lens"]) + sum(n - 1 for n in workload["output_lens"])
    stats = staged["pipeline"]
    assert stats["activation_bytes_per_step"] * staged["num_steps"] == pytest.approx(rows * 64 * 4)
    assert stats["num_stages"] == 2 and 0 < stats["bubble_fraction"] < 1
    assert stats["bubble_fraction"] == pytest.approx(1 - sum(stats["busy_fraction_per_stage"]) / 2)
    link = staged["projection"]["InfiniBand NDR 400 Gb/s (between nodes)"]
    assert link["transfer_us"] == pytest.approx(stats["activation_bytes_per_step"] / 50e9 * 1e6)
    assert link["us_per_step"] == pytest.approx(link["transfer_us"] + 3.6 + 2.7)
    assert "CPU cores" in doc["notes"][-1] and json_path.with_suffix(".png").is_file()


@pytest.mark.parametrize(
    ("layers", "stages", "counts"),
    # vLLM's documented partitions (its get_pp_indices): the remainder goes to the
    # stages before the last, counting back.
    [(32, 4, [8, 8, 8, 8]), (22, 4, [5, 6, 6, 5]), (5, 3, [2, 2, 1]), (61, 4, [15, 15, 16, 15])],
)
def test_layers_split_as_vllm_splits_them(layers, stages, counts):
    from minipaged.distributed.parallel_state import PipelineStage, pp_layer_counts

    assert pp_layer_counts(layers, stages) == counts
    ranges = [PipelineStage(s, stages).layers(layers) for s in range(stages)]
    assert [len(r) for r in ranges] == counts
    assert [i for r in ranges for i in r] == list(range(layers))


@pytest.mark.parametrize("counts", [[1], [5, 1, 1, 1], [1, 1, 1, 1, 1], [30, 2], [3, 3, 3]])
def test_micro_batches_cut_the_batch_in_order(counts):
    from types import SimpleNamespace

    from minipaged.worker.model_runner import micro_batches

    seqs = [SimpleNamespace(num_new_tokens=n) for n in counts]
    for stages in (1, 2, 3):
        batches = micro_batches(seqs, stages)
        assert [s for b in batches for s in b] == seqs
        assert all(batches) and len(batches) <= stages

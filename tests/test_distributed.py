"""Tensor parallelism end to end (paper §4.6): the engine over gloo processes on the CPU.

The oracle is Hugging Face's ``generate`` on the same weights, and minipaged at
``tensor_parallel_size=1``; the checks cover what changes only the metadata the workers
receive (swap preemption, copy-on-write, prefix caching, beam search), seeded sampling
(drawn once, on the driver), and the workers' lives: ``shutdown``, ``del``, a
simulated Ctrl-C and a killed worker leave no process behind.  Spawning workers costs
seconds, so one engine serves several checks.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    assert_prompt_logprobs_match_hf,
    make_llm,
    random_prompt,
)
from minipaged import LLM, SamplingParams
from minipaged.core.memory.block_table import blocks_for
from minipaged.sampling_params import BeamSearchParams

MAX_TOKENS = 10
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
SEEDED = SamplingParams(
    n=2, temperature=0.9, top_p=0.9, max_tokens=MAX_TOKENS, seed=7, ignore_eos=True
)
PROMPTS = [random_prompt(length, seed) for seed, length in enumerate([3, 30, 17, 9])]
# A pool that holds the largest request but not the batch: requests are swapped out.
POOL = dict(
    block_size=BLOCK_SIZE,
    preemption_mode="swap",
    enable_prefix_caching=True,
    num_gpu_blocks=max(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS) + 1,
)


def generate(llm, prompts, params):
    return llm.generate(as_inputs(prompts), params, use_tqdm=False)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_no_worker_left(llm) -> None:
    for process in llm.engine.workers.processes:
        assert not process.is_alive() and process.exitcode is not None
        assert not os.path.exists(f"/proc/{process.pid}")  # reaped, not even a zombie


@pytest.fixture(scope="class")
def engines(tiny):
    """The tiny Llama (4 query heads, 2 KV heads) at TP=2 and at TP=1, same settings."""
    path, oracle = tiny("llama")
    tp2 = make_llm(path, tensor_parallel_size=2, **POOL)
    yield tp2, make_llm(path, **POOL), oracle
    tp2.shutdown()


class TestTwoRanks:
    def test_greedy_equals_hf_and_tp1_under_swap_preemption(self, engines):
        tp2, tp1, oracle = engines
        outputs = generate(tp2, PROMPTS, GREEDY)
        assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, logprobs=2)
        assert tokens(outputs) == tokens(generate(tp1, PROMPTS, GREEDY))
        stats = tp2.stats()
        assert stats["num_preemptions"] > 0 and stats["num_swapped_out_blocks"] > 0
        assert_all_blocks_free(tp2)
        # Every rank holds one KV head (of 2) in the same number of blocks.
        assert tp2.engine.executor.cache_shapes == [(POOL["num_gpu_blocks"], BLOCK_SIZE, 1, 16)] * 2

    def test_prefix_caching_reuses_blocks_on_every_rank(self, engines):
        tp2, _, oracle = engines
        shared = random_prompt(3 * BLOCK_SIZE, 99)
        prompts = [shared + [65], shared + [66, 67]]
        first = generate(tp2, prompts[:1], GREEDY)
        before = tp2.stats()["prefix_cache_hit_rate"]
        second = generate(tp2, prompts[1:], GREEDY)  # its 3 full blocks come from the cache
        assert_greedy_matches_hf(first + second, prompts, oracle, MAX_TOKENS, logprobs=2)
        assert tp2.stats()["prefix_cache_hit_rate"] > before
        assert_all_blocks_free(tp2)

    def test_seeded_sampling_and_copy_on_write_equal_tp1(self, engines):
        tp2, tp1, _ = engines
        # n=2 forks after the prompt: the children share its last block until one writes.
        prompts = [PROMPTS[0], PROMPTS[3]]
        ours = tokens(generate(tp2, prompts, SEEDED))
        assert ours == tokens(generate(tp1, prompts, SEEDED))
        assert ours[0][0] != ours[0][1]  # truly sampled, not greedy twice
        assert_all_blocks_free(tp2)

    def test_prompt_logprobs_equal_hf_forward(self, engines):
        """Every rank projects the scored rows (the logits are gathered); rank 0 keeps
        them.  Under swap preemption, as the pool is set up."""
        tp2, _, oracle = engines
        params = SamplingParams(prompt_logprobs=2, temperature=0, max_tokens=MAX_TOKENS)
        for output in generate(tp2, PROMPTS, params):
            assert_prompt_logprobs_match_hf(output, oracle.hf, 2)
        assert_all_blocks_free(tp2)

    def test_beam_search_equals_tp1(self, engines):
        tp2, tp1, _ = engines
        params = BeamSearchParams(beam_width=2, max_tokens=6)
        prompts = as_inputs([PROMPTS[0], PROMPTS[3]])
        ours, theirs = tp2.beam_search(prompts, params), tp1.beam_search(prompts, params)
        assert [[b.tokens for b in o.sequences] for o in ours] == [
            [b.tokens for b in o.sequences] for o in theirs
        ]
        assert_all_blocks_free(tp2)

    def test_shutdown_stops_every_worker(self, engines):
        tp2, _, _ = engines
        tp2.shutdown()
        assert_no_worker_left(tp2)
        with pytest.raises(RuntimeError, match="shut down"):
            generate(tp2, PROMPTS[:1], GREEDY)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen2", {}),  # q/k/v biases, tied embeddings
        ("qwen3", {}),  # q/k norms, head_dim 32 != hidden_size / num_heads
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # row-parallel biases, added once
    ],
)
def test_variants_split_two_ways_equal_hf(tiny, arch, overrides):
    path, oracle = tiny(arch, **overrides)
    llm = make_llm(path, tensor_parallel_size=2, block_size=BLOCK_SIZE, num_gpu_blocks=64)
    assert_greedy_matches_hf(
        generate(llm, PROMPTS, GREEDY), PROMPTS, oracle, MAX_TOKENS, logprobs=2
    )
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_four_ranks_replicate_kv_heads_and_survive_ctrl_c(tiny):
    """4 ranks, 2 KV heads: each KV head on two ranks.  Then a Ctrl-C mid-step (after
    the plan went out, before rank 0's forward): the driver stops the workers, which
    would wait forever in the step's first collective, and refuses further steps."""
    path, oracle = tiny("llama")
    llm = make_llm(path, tensor_parallel_size=4, block_size=BLOCK_SIZE, num_gpu_blocks=64)
    outputs = generate(llm, PROMPTS, GREEDY)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, logprobs=2)
    assert llm.engine.executor.cache_shapes == [(64, BLOCK_SIZE, 1, 16)] * 4
    assert_all_blocks_free(llm)

    def interrupted(*args):
        raise KeyboardInterrupt

    llm.engine.runner.execute_model = interrupted
    with pytest.raises(KeyboardInterrupt):
        generate(llm, PROMPTS[:1], GREEDY)
    assert_no_worker_left(llm)
    assert_all_blocks_free(llm)  # the interrupted request was aborted
    with pytest.raises(RuntimeError, match="KeyboardInterrupt"):
        generate(llm, PROMPTS[:1], GREEDY)


def test_killed_worker_fails_fast_naming_its_rank(tiny):
    """A worker dies mid-step, while the driver waits for it in a collective: gloo's
    closed socket ends the wait, and the driver names the rank and its host, stops the
    rest and refuses further steps (as under torchrun: test_launch.py)."""
    path, _ = tiny("llama")
    llm = make_llm(path, tensor_parallel_size=2, block_size=BLOCK_SIZE, num_gpu_blocks=64)
    victim, execute = llm.engine.workers.processes[0], llm.engine.runner.execute_model

    def kill_then_execute(*args):
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        return execute(*args)

    llm.engine.runner.execute_model = kill_then_execute
    named = f"worker rank 1 on {socket.gethostname()} \\(127.0.0.1, pid {victim.pid}\\) died"
    with pytest.raises(RuntimeError, match=named):
        generate(llm, PROMPTS[:1], GREEDY)
    assert_no_worker_left(llm)
    assert_all_blocks_free(llm)
    with pytest.raises(RuntimeError, match="worker rank 1"):
        generate(llm, PROMPTS[:1], GREEDY)


def test_smollm2_tp3_equals_hf_generate(smollm2):
    """The acceptance test: SmolLM2-135M (9 query heads, 3 KV heads, intermediate 1536,
    a tied 49152-row vocabulary) split over 3 ranks gives HF's greedy answer."""
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
        smollm2, dtype="float32", tensor_parallel_size=3, num_gpu_blocks=16, max_model_len=256
    )
    out = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=12))
    assert out[0].outputs[0].token_ids == expected
    assert llm.engine.executor.cache_shapes == [(16, 16, 1, 64)] * 3
    processes = llm.engine.workers.processes
    del llm, out
    gc.collect()
    for process in processes:
        assert not process.is_alive()
        assert not os.path.exists(f"/proc/{process.pid}")


@pytest.mark.gpu
def test_nccl_greedy_equals_tp1_on_every_gpu(tiny):
    if torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism over NCCL needs at least 2 GPUs")
    path, oracle = tiny("llama")
    size = min(4, torch.cuda.device_count())  # the tiny model's 4 query heads split 2 or 4 ways
    size = 2 if size == 3 else size
    settings = dict(device="cuda", swap_space=0.01, block_size=BLOCK_SIZE, num_gpu_blocks=64)
    llm = LLM(str(path), tensor_parallel_size=size, **settings)
    outputs = generate(llm, PROMPTS, GREEDY)
    llm.shutdown()
    assert_no_worker_left(llm)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS)
    assert tokens(outputs) == tokens(generate(LLM(str(path), **settings), PROMPTS, GREEDY))


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2"])
def test_tensor_parallel_size_must_be_a_positive_int(size):
    from minipaged.config import EngineConfig

    with pytest.raises(ValueError, match=f"tensor_parallel_size must be an int >= 1, got {size!r}"):
        EngineConfig(model="m", tensor_parallel_size=size)


def test_a_model_that_does_not_split_is_refused_before_any_process_starts(tiny):
    path, _ = tiny("llama")  # 4 query heads
    before = set(multiprocessing.active_children())
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=3 must divide the model's num_attention_heads \\(4\\)",
    ):
        make_llm(path, tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.parametrize(
    "command", [["generate", "--model", "M", "hi"], ["serve", "M"], ["bench", "throughput"]]
)
def test_tensor_parallel_size_flag(command):
    from minipaged.arg_utils import engine_kwargs
    from minipaged.cli import build_parser

    args = build_parser().parse_args([*command, "--tensor-parallel-size", "3"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 3


def test_bench_throughput_reports_communication_per_step(tiny):
    from minipaged.bench.throughput import run_minipaged
    from minipaged.core.memory.workloads import RequestSpec

    path, _ = tiny("llama")
    requests = [RequestSpec(5, 4), RequestSpec(9, 6)]
    prompts = [random_prompt(r.prompt_len, i) for i, r in enumerate(requests)]
    settings = dict(device="cpu", tensor_parallel_size=2, num_gpu_blocks=32, swap_space=0.01)
    run = run_minipaged(path, "torch", requests, prompts, settings, progress=False)
    assert run.generated == [4, 6]
    assert run.row["system"] == "minipaged-torch-tp2" and run.row["tensor_parallel_size"] == 2
    comm = run.row["comm_ms_per_step"]
    assert set(comm) == {"broadcast", "all_reduce", "gather"} and all(v > 0 for v in comm.values())

"""Async scheduling (``async_scheduling=True``, vLLM's): the next step is scheduled while
the forward pass of this one runs, with placeholders for the tokens it will sample.  The
tokens are Hugging Face's greedy ones and the seeded samples those of the synchronous
engine, whatever ends the requests (length, EOS, a stop token, an abort mid-flight),
under preemption by recompute and with prefix caching; afterwards every block is free.
Combinations it does not support are refused.
"""

import re
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import (
    EOS,
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.bench import throughput
from minipaged.config import EngineConfig
from minipaged.core.memory.block_table import blocks_for
from minipaged.core.memory.workloads import RequestSpec
from minipaged.sampling_params import StructuredOutputsParams

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def async_llm(llama):
    return make_llm(llama[0], async_scheduling=True)


def generate(llm, prompts, params):
    return llm.generate(as_inputs(prompts), params, use_tqdm=False)


def workload(oracle) -> list[list[int]]:
    """Prompts of 1 to 40 tokens, and one whose greedy continuation stops at EOS."""
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 16, 23, 40)]
    return prompts + [oracle.eos_prompt(MAX_TOKENS)]


def test_greedy_equals_hf(llama, async_llm):
    """A ragged batch, its requests ending at EOS or at their length, decodes HF's
    greedy tokens with HF's logprobs, most steps scheduled ahead."""
    _, oracle = llama
    prompts = workload(oracle)
    before = async_llm.engine.num_steps_ahead
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    outputs = generate(async_llm, prompts, params)
    assert_greedy_matches_hf(outputs, prompts, oracle, MAX_TOKENS, logprobs=2)
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}
    assert async_llm.engine.num_steps_ahead - before >= MAX_TOKENS // 2
    assert_all_blocks_free(async_llm)
    # The count reaches stats() and a server's /metrics.
    stats = async_llm.stats()
    assert stats["num_steps_ahead"] == async_llm.engine.num_steps_ahead
    pytest.importorskip("prometheus_client")
    from minipaged.server.metrics import make_registry

    registry = make_registry(SimpleNamespace(stats=stats))
    sample = registry.get_sample_value("minipaged:engine_steps_scheduled_ahead_total")
    assert sample == stats["num_steps_ahead"]


def test_each_request_stops_at_its_own_step(llama, async_llm):
    """Requests with different ``max_tokens`` and a stop token finish at different
    steps: each one's tokens are HF's up to its own end, none run past it."""
    _, oracle = llama
    prompts = [random_prompt(n, seed=100 + n) for n in (3, 12, 17, 30)]
    lengths = [1, 4, 9, 15]
    stop_at = oracle.greedy(prompts[3], 15)[0][6]  # a token HF's greedy reaches
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    params[3] = SamplingParams(temperature=0, max_tokens=15, stop_token_ids=[stop_at])
    outputs = generate(async_llm, prompts, params)
    for prompt, n, out in zip(prompts, lengths, outputs):
        expected = oracle.greedy(prompt, n)[0]
        if n == 15:
            expected = expected[: expected.index(stop_at) + 1]
        elif EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        assert out.outputs[0].token_ids == expected
    assert outputs[3].outputs[0].finish_reason == "stop"
    assert async_llm.engine._in_flight is None  # the last step ahead, all finished: drained
    assert_all_blocks_free(async_llm)


def test_seeded_samples_equal_the_synchronous_engine(llama, async_llm):
    """Sampling, seeded per request or from the engine's seed, with a penalty that
    reads each sequence's history, and one request with ``n`` = 2 (whose steps wait):
    the same tokens with async scheduling on and off."""
    path, _ = llama
    prompts = [random_prompt(n, seed=200 + n) for n in (5, 14, 26)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=7),
        SamplingParams(temperature=1.0, max_tokens=16, repetition_penalty=1.3, seed=8),
        SamplingParams(temperature=0.8, max_tokens=10, n=2, seed=9),
    ]

    def tokens(llm):
        return [[c.token_ids for c in o.outputs] for o in generate(llm, prompts, params)]

    assert tokens(async_llm) == tokens(make_llm(path))
    assert_all_blocks_free(async_llm)


def test_launching_in_this_thread_as_on_a_gpu_gives_the_same_tokens(llama):
    """On a GPU the forward pass is launched by the stepping thread itself (no worker
    thread, `LLMEngine._launch`); made to do so on a CPU, the engine still decodes
    HF's greedy tokens, steps ahead, and samples what the synchronous engine samples."""
    path, oracle = llama
    llm = make_llm(path, async_scheduling=True)
    llm.engine._forward_thread.shutdown()
    llm.engine._forward_thread = None  # what the engine does on a GPU
    prompts = workload(oracle)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    assert_greedy_matches_hf(generate(llm, prompts, greedy), prompts, oracle, MAX_TOKENS)
    assert llm.engine.num_steps_ahead > 0
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    assert [o.outputs[0].token_ids for o in generate(llm, prompts, seeded)] == [
        o.outputs[0].token_ids for o in generate(make_llm(path), prompts, seeded)
    ]
    assert_all_blocks_free(llm)


def test_structured_outputs_keep_their_grammar(llama, async_llm):
    """A grammar advances on step N's token (in N's update) before step N+1's logits are
    masked, so sampled completions match their regex, as the synchronous engine's do,
    token for token."""
    pytest.importorskip("llguidance")  # absent from a GPU's stock image
    path, _ = llama
    regex = r"[a-c]{2,6}-[0-9]{1,4}"
    spec = StructuredOutputsParams(regex=regex)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_outputs=spec)
    prompts = [random_prompt(n, seed=700 + n) for n in (3, 6, 11)]
    outputs = generate(async_llm, prompts, params)
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outputs), outputs
    synchronous = generate(make_llm(path), prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in synchronous
    ]
    assert_all_blocks_free(async_llm)


def test_greedy_equals_hf_under_preemption_and_prefix_caching(llama):
    """A pool just big enough for the largest request preempts by recompute; prompts
    that share a prefix, generated twice, hit the prefix cache the second time (blocks
    filled by a token scheduled as a placeholder among them).  HF's tokens throughout."""
    path, oracle = llama
    prefix = random_prompt(24, seed=99)
    prompts = [prefix + random_prompt(n, seed=300 + n) for n in (3, 8, 13)]
    block_size = 8
    largest = max(blocks_for(len(p) + MAX_TOKENS, block_size) for p in prompts)
    llm = make_llm(
        path,
        block_size=block_size,
        num_gpu_blocks=largest + 2,
        async_scheduling=True,
        trace=True,  # its records of the steps scheduled ahead too
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for _ in range(2):
        assert_greedy_matches_hf(generate(llm, prompts, params), prompts, oracle, MAX_TOKENS)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and llm.engine.num_steps_ahead > 0
    assert stats["prefix_cache_hit_rate"] > 0
    assert_all_blocks_free(llm)


def test_generated_blocks_reach_the_prefix_cache(llama, async_llm):
    """Blocks whose tokens were scheduled as placeholders are offered to the prefix
    cache once the tokens are known: after a 5-token prompt and 30 generated tokens,
    both full 16-token blocks (filled by generated tokens) serve a later prompt."""
    prompt = random_prompt(5, seed=500)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (out,) = generate(async_llm, [prompt], params)
    tokens = prompt + list(out.outputs[0].token_ids)
    assert async_llm.engine.kv.num_cached_tokens(tokens) == 32
    assert_all_blocks_free(async_llm)


def test_abort_while_a_step_runs(llama, async_llm):
    """A request aborted between steps, while the step scheduled ahead runs with its
    token: it is dropped, the others go on to HF's tokens, and no block is leaked."""
    _, oracle = llama
    engine = async_llm.engine
    prompts = [random_prompt(n, seed=400 + n) for n in (4, 10)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None  # a step scheduled ahead is running
    engine.abort_request("abort-0")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["abort-1"]
    assert outputs[0].outputs[0].token_ids == oracle.greedy_ignoring_eos(prompts[1], MAX_TOKENS)
    assert_all_blocks_free(async_llm)


def test_a_failed_step_gives_back_the_step_scheduled_ahead(llama, async_llm, monkeypatch):
    """A step whose sampling raises (without ``fail_alone``) gives back the placeholders
    of the step scheduled while it ran, leaving its sequences as a synchronous step
    would; after aborting its requests every block is free, and the engine goes on to
    HF's tokens."""
    _, oracle = llama
    engine = async_llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, n in enumerate((6, 13)):
        engine.add_request(f"fail-{i}", random_prompt(n, seed=800 + n), params)
    for _ in range(3):
        engine.step()
    ahead_before = engine.num_steps_ahead

    def broken(sampling, logits):
        raise RuntimeError("sampler broke")

    monkeypatch.setattr(engine, "sample", broken)
    with pytest.raises(RuntimeError, match="sampler broke"):
        engine.step()
    monkeypatch.undo()
    assert engine.num_steps_ahead == ahead_before and engine._in_flight is None
    for group in engine.scheduler.running:  # as a synchronous failed step leaves them
        seq = group.seqs[0]
        assert engine.kv.num_tokens(seq.seq_id) == seq.num_computed_tokens == len(seq.token_ids)
    for i in range(2):
        engine.abort_request(f"fail-{i}")
    assert_all_blocks_free(async_llm)
    prompt = random_prompt(9, seed=809)
    (out,) = generate(async_llm, [prompt], params)
    assert out.outputs[0].token_ids == oracle.greedy_ignoring_eos(prompt, MAX_TOKENS)
    assert_all_blocks_free(async_llm)


def test_a_request_failing_alone_leaves_the_step_ahead_to_the_others(llama, monkeypatch):
    """With ``fail_alone`` (a server's), a request whose sampling raises is aborted
    after the next step already started with its row (token 0, no sample to give it):
    that row is dropped, the other request gets HF's tokens, no block is leaked."""
    path, oracle = llama
    engine = make_llm(path, async_scheduling=True).engine
    prompts = [random_prompt(n, seed=900 + n) for n in (5, 11)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"alone-{i}", prompt, params)
    for _ in range(4):
        engine.step(fail_alone=True)
    sample = engine.sample

    def breaks_for_the_first(sampling, logits):
        if any(s.group.request_id == "alone-0" for s in sampling):
            raise RuntimeError("this request's sampling broke")
        return sample(sampling, logits)

    monkeypatch.setattr(engine, "sample", breaks_for_the_first)
    ahead_before = engine.num_steps_ahead
    engine.step(fail_alone=True)
    assert set(engine.failed) == {"alone-0"}
    assert engine.num_steps_ahead == ahead_before + 1  # the next step ran with its row
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(fail_alone=True)
    assert [o.request_id for o in outputs] == ["alone-1"]
    assert outputs[0].outputs[0].token_ids == oracle.greedy_ignoring_eos(prompts[1], MAX_TOKENS)
    counters = engine.counters()
    assert counters["num_free_gpu_blocks"] == counters["num_gpu_blocks"]


@pytest.mark.parametrize(
    "option",
    [
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"runner": "pooling"},
        {"memory_mode": "contiguous-max"},
        {
            "kv_transfer_config": {
                "kv_connector": "SharedStorageConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"},
            }
        },
    ],
)
def test_refused_combinations(option):
    (name,) = option
    with pytest.raises(ValueError, match=f"async_scheduling cannot run with {name}"):
        EngineConfig(model="m", async_scheduling=True, **option)


def test_bench_throughput_runs_the_async_system(llama):
    """``minipaged-cpu-async`` in `bench throughput` is the CPU engine with async
    scheduling: its row says so, and it generates every request's tokens."""
    requests = [RequestSpec(5, 7), RequestSpec(12, 3), RequestSpec(3, 9)]
    prompts = [random_prompt(r.prompt_len, seed=600 + i) for i, r in enumerate(requests)]
    result = throughput.bench_throughput(
        llama[0], [throughput.ASYNC], requests, prompts, {"device": "cpu"}, progress=False
    )
    run = result.runs[throughput.ASYNC]
    assert run.row["system"] == throughput.ASYNC
    assert run.generated == [7, 3, 9]


def test_by_default_on_a_gpu_unless_a_setting_rules_it_out_and_off_on_a_cpu(llama):
    """``async_scheduling`` None, as vLLM 0.14's default: on for CUDA where nothing rules
    it out, off on a CPU or beside a setting it cannot run with (no error then, unlike
    asking for it)."""
    assert EngineConfig(model="m").async_scheduling is None
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig(model="m").resolve_async_scheduling(cuda) is True
    assert EngineConfig(model="m").resolve_async_scheduling(cpu) is False
    for option in ({"tensor_parallel_size": 2}, {"memory_mode": "contiguous-max"}):
        assert EngineConfig(model="m", **option).resolve_async_scheduling(cuda) is False
    assert EngineConfig(model="m", async_scheduling=False).resolve_async_scheduling(cuda) is False
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None, got 'yes'"):
        EngineConfig(model="m", async_scheduling="yes")
    engine = make_llm(llama[0]).engine  # on this CPU
    assert engine.config.async_scheduling is False and engine._forward_thread is None


def test_the_rows_kept_of_a_step_ahead_are_those_indexing_picks():
    """`drop_aborted` joins slices instead of indexing with a list (which would wait
    for a GPU): the same rows for every ascending subset of ten."""
    from minipaged.engine.llm_engine import _rows

    logits = torch.randn(10, 7)
    for mask in range(2**10):
        keep = [i for i in range(10) if mask >> i & 1]
        assert torch.equal(_rows(logits, keep), logits[keep])

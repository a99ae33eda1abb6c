"""Decode steps through the model compiled by inductor (`minipaged.worker.compiled_decode`,
``compilation_config`` mode 1).

The oracles: Hugging Face's model on the same tiny checkpoints (greedy tokens and
their logprobs), and the eager model (every logit of a schedule of prefills and
decodes, and the sampled and beam-searched outputs of the same engine settings).  One
graph must serve every batch size and block-table width, so the tests count the
graphs torch compiled.  The pairs with the engine's other features run here: prefix
caching, chunked prefill, preemption by recompute and by swap, a quantized cache,
n > 1, beam search, speculative decoding; the features that cannot run in one graph
are refused.  ``bench throughput``'s compiled system runs its decode steps through it.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from engine_helpers import (
    Oracle,
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import LLM, SamplingParams
from minipaged.bench import throughput as bench
from minipaged.config import CompilationConfig
from minipaged.core.memory.workloads import RequestSpec
from minipaged.models import load_model, make_tiny_model
from minipaged.worker.compiled_decode import CompiledDecode
from test_models import FP32, PagedRunner, hf_logits, random_tokens

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN"
)
# Prompts of 1 to 40 tokens: block tables 1 to 3 blocks of 16 wide.
PROMPTS = [random_prompt(length, seed=length) for length in (1, 7, 16, 23, 40)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=0)
    return path, Oracle(path)


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def engines(llama):
    """An eager and a compiled engine with the same settings: prefix caching, prompts
    chunked by 16 tokens, and a pool small enough that sequences are preempted."""
    settings = dict(
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        num_gpu_blocks=12,
        dtype="float32",
    )
    before = compiled_graphs()
    compiled = make_llm(llama[0], compilation_config={"mode": 1}, **settings)
    assert compiled_graphs() == before + 1
    return make_llm(llama[0], **settings), compiled


def test_greedy_tokens_and_logprobs_are_hfs_with_one_graph(llama, engines):
    """Five sequences, then one (padded to two rows), through tables 1 to 3 blocks
    wide, sharing and evicting cached blocks, preempted for want of them: one graph."""
    path, oracle = llama
    _, llm = engines
    before, runs = compiled_graphs(), llm.engine.runner.graphs.num_runs
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    outputs = llm.generate(as_inputs(PROMPTS), params, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, max_tokens=24, logprobs=2)
    alone = llm.generate(as_inputs(PROMPTS[3:4]), params, use_tqdm=False)
    assert_greedy_matches_hf(alone, PROMPTS[3:4], oracle, max_tokens=24, logprobs=2)
    assert llm.engine.runner.graphs.num_runs > runs + 20
    assert llm.stats()["num_preemptions"] > 0
    assert compiled_graphs() == before
    assert_all_blocks_free(llm)


def test_sampling_with_n_and_a_seed_gives_the_eager_engines_tokens(engines):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    results = [llm.generate(as_inputs(PROMPTS[:3]), params, use_tqdm=False) for llm in engines]
    eager, compiled = ([[c.token_ids for c in o.outputs] for o in r] for r in results)
    assert compiled == eager and len(compiled[0]) == 3
    assert_all_blocks_free(engines[1])


def test_beam_search_gives_the_eager_engines_beams(engines):
    from minipaged import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    results = [llm.beam_search(as_inputs(PROMPTS[1:3]), params) for llm in engines]
    eager, compiled = ([[s.tokens for s in r.sequences] for r in result] for result in results)
    assert compiled == eager
    assert_all_blocks_free(engines[1])


@pytest.mark.parametrize(
    "settings",
    [
        {"preemption_mode": "swap", "kv_cache_dtype": "int8"},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    ],
    ids=["swap-int8", "ngram"],
)
def test_with_swapping_a_quantized_cache_or_speculation_the_eager_tokens(llama, settings):
    """Greedy tokens equal the eager engine's on the same settings (the quantized
    cache's are not HF's, its keys being rounded; speculation's are the plain ones)."""
    prompts = [random_prompt(5, seed=1) * 4, *PROMPTS[1:4]]  # a repeating one to look up
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = {}
    for config in (0, 1):
        llm = make_llm(llama[0], compilation_config=config, num_gpu_blocks=10, **settings)
        outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        tokens[config] = [o.outputs[0].token_ids for o in outputs]
        assert_all_blocks_free(llm)
    assert llm.engine.runner.graphs.num_runs > 0
    assert tokens[1] == tokens[0]


class CompiledRunner(PagedRunner):
    """`PagedRunner` with its decode-only steps through `CompiledDecode`."""

    def __init__(self, model, block_size):
        super().__init__(model, block_size)
        with torch.inference_mode():
            self.compiled = CompiledDecode(model, self.kv_caches, torch.device("cpu"))
        self.forward = self._forward

    @torch.inference_mode()  # as the engine's steps: torch compiled for such tensors
    def step(self, chunks):
        return super().step(chunks)

    def _forward(self, input_ids, positions, kv_caches, attn):
        hidden = self.compiled.run(input_ids, positions, attn)
        return self.model(input_ids, positions, kv_caches, attn) if hidden is None else hidden


# Prefills of A (13 tokens) and B (6), three decode steps of both, then B alone, then C
# (2 tokens: one block of 4) prefilled and decoded alone: batches of 2 and 1 (padded),
# tables of 1 to 5 blocks.
SCHEDULE = [
    [("A", 0, 13), ("B", 0, 6)],
    *([("A", 13 + i, 14 + i), ("B", 6 + i, 7 + i)] for i in range(3)),
    [("B", 9, 10)],
    [("C", 0, 2)],
    [("C", 2, 3)],
    [("C", 3, 4)],
]
SEQUENCES = {
    "A": random_tokens(16, seed=4),
    "B": random_tokens(10, seed=5),
    "C": random_tokens(4, seed=6),
}


def run(runner):
    """Each sequence's logits of each step, in order."""
    logits = []
    for step in SCHEDULE:
        chunks = [(seq, SEQUENCES[seq][start:end], start) for seq, start, end in step]
        logits += runner.step(chunks)
    return logits


# Against HF in float32, bfloat16's error grows over a schedule: each decode step reads
# keys and values rounded to bfloat16 when they were stored (the eager path's error too).
BF16_SCHEDULE_TOLERANCE = 0.12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_schedules_logits_are_the_eager_models_and_bf16_within_its_bound(llama, dtype):
    """Every logit the eager model's, to the order of its sums (float32) or within a
    hundredth of the largest (bfloat16, whose roundings the compiled code may place
    otherwise); bfloat16's within a stated bound of Hugging Face in float32."""
    before = compiled_graphs()
    model = load_model(llama[0], dtype=dtype, attention_backend="cpu")
    runner = CompiledRunner(model, block_size=4)
    actual = run(runner)
    assert runner.compiled.num_runs == 6 and compiled_graphs() == before + 1
    eager = run(PagedRunner(load_model(llama[0], dtype=dtype, attention_backend="cpu"), 4))
    for ours, expected in zip(actual, eager, strict=True):
        if dtype == "float32":
            torch.testing.assert_close(ours, expected, **FP32)
            assert torch.equal(ours.argmax(-1), expected.argmax(-1))
        else:
            assert (ours - expected).abs().max() <= 0.01 * expected.abs().max()
    if dtype == "bfloat16":
        chunks = [chunk for step in SCHEDULE for chunk in step]
        for (seq, start, end), ours in zip(chunks, actual, strict=True):
            hf = hf_logits(llama[1].hf, SEQUENCES[seq][:end])[start:end]
            assert (ours - hf).abs().max() <= BF16_SCHEDULE_TOLERANCE * hf.abs().max()


def test_the_mode_is_vllms_int_or_dict():
    assert CompilationConfig.from_value(None).mode == 0
    assert CompilationConfig.from_value(1).mode == 1
    assert CompilationConfig.from_value({"mode": 1}).mode == 1


@pytest.mark.parametrize(
    "value, message",
    [
        (3, "compilation_config mode must be one of \\(0, 1\\), got 3"),
        ({"mode": 2}, "got 2"),
        ({"mode": 1, "backend": "eager"}, "key 'backend' is not supported"),
        ("1", "must be a mode \\(int\\), a dict or None"),
        (True, "must be a mode"),
    ],
)
def test_what_minipaged_does_not_run_is_refused(tmp_path, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(tmp_path, compilation_config=value)


def test_enforce_eager_and_a_compile_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match="enforce_eager=True runs every step eagerly"):
        LLM(tmp_path, enforce_eager=True, compilation_config=1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"attention_backend": "torch"}, "with the 'cpu' attention backend, not 'torch'"),
        ({"enable_lora": True}, "without enable_lora"),
    ],
)
def test_what_one_graph_cannot_hold_is_refused_before_loading(llama, settings, message):
    with pytest.raises(ValueError, match=f"compilation_config mode 1 compiles {message}"):
        make_llm(llama[0], compilation_config=1, **settings)


def test_the_compiled_system_runs_its_decode_steps_through_the_graph(llama):
    requests = [RequestSpec(5, 7), RequestSpec(12, 3), RequestSpec(3, 9)]
    prompts = [[(7 * i + j) % 256 for j in range(r.prompt_len)] for i, r in enumerate(requests)]
    result = bench.bench_throughput(
        llama[0],
        ["minipaged-cpu", bench.COMPILED],
        requests,
        prompts,
        {"device": "cpu"},
        progress=False,
    )
    eager, compiled = (result.runs[s].row for s in ("minipaged-cpu", bench.COMPILED))
    assert compiled["system"] == bench.COMPILED and eager["num_compiled_steps"] == 0
    # Every step after the three prompts' (one step: they fit its token budget) decodes.
    assert compiled["num_compiled_steps"] == compiled["num_steps"] - 1 == 8
    assert result.runs[bench.COMPILED].generated == [7, 3, 9]

"""The engine end to end (`LLM.generate`), against Hugging Face transformers on the same
weights: greedy tokens equal and logprobs close, whatever the engine does underneath
(preemption by recompute or swap, chunked prefill, prefix caching, block sizes, the
Triton backend); parallel sampling sharing blocks; seeded sampling; bad input refused
without side effects; stop conditions.  After every workload every block is free.
"""

import pytest
import torch

from engine_helpers import (
    EOS,
    FP32,
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import LLM, BeamSearchParams, SamplingParams
from minipaged.core.memory.block_table import blocks_for
from minipaged.sampling_params import RequestOutputKind

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)


def workload(oracle) -> list[list[int]]:
    """Prompts of different lengths (1 to 40 tokens: within, at and across block
    boundaries), plus one whose greedy continuation stops at EOS early."""
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 16, 23, 40)]
    return prompts + [oracle.eos_prompt(MAX_TOKENS)]


def generate(llm, prompts, params):
    return llm.generate(as_inputs(prompts), params, use_tqdm=False)


# -- 1. Hugging Face parity -----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_batch_equals_hf_generate(tiny, arch):
    """A ragged batch with the default engine settings (block size 16, pool sized for
    the CPU) decodes exactly HF's greedy tokens, stopping where HF stops at EOS, with
    HF's log-probabilities for the chosen and the top-3 tokens at every step."""
    path, oracle = tiny(arch)
    prompts = workload(oracle)
    llm = make_llm(path)
    outputs = generate(llm, prompts, GREEDY_LOGPROBS)
    assert_greedy_matches_hf(outputs, prompts, oracle, MAX_TOKENS, logprobs=3)
    reasons = {o.outputs[0].finish_reason for o in outputs}
    assert reasons == {"stop", "length"}  # both ways of ending are exercised
    assert_all_blocks_free(llm)


VARIANT_ARCHS = ["llama", "qwen3"]  # qwen3: head_dim 32 != hidden/heads, q/k norms


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_greedy_equals_hf_for_block_size(tiny, arch, block_size):
    """The block size only changes where keys and values live, never the tokens."""
    path, oracle = tiny(arch)
    prompts = workload(oracle)
    need = sum(blocks_for(len(p) + MAX_TOKENS, block_size) for p in prompts)
    llm = make_llm(path, block_size=block_size, num_gpu_blocks=need)
    assert_greedy_matches_hf(
        generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
    )
    assert llm.stats()["num_preemptions"] == 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_hf_under_preemption(tiny, arch, mode):
    """A KV pool just big enough for the largest single request cannot hold the batch,
    so requests are preempted (§4.5): recomputed from their tokens, or swapped out to
    the CPU pool and back.  Either way the tokens and logprobs are HF's."""
    path, oracle = tiny(arch)
    prompts = workload(oracle)
    block_size = 8
    largest = max(blocks_for(len(p) + MAX_TOKENS, block_size) for p in prompts)
    llm = make_llm(path, block_size=block_size, num_gpu_blocks=largest + 1, preemption_mode=mode)
    assert_greedy_matches_hf(
        generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
    )
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out_blocks"] > 0
        assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
    else:
        assert stats["num_swapped_out_blocks"] == 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_greedy_equals_hf_with_chunked_prefill(tiny, arch):
    """A step budget of 8 tokens cuts long prompts into chunks that run beside other
    requests' decodes (§4.5); the trace shows a prompt resumed mid-way."""
    path, oracle = tiny(arch)
    prompts = workload(oracle)
    llm = make_llm(path, max_num_seqs=4, max_num_batched_tokens=8, trace=True)
    assert_greedy_matches_hf(
        generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
    )
    events = llm.engine.trace.events
    prompt_len = {e.request_id: e.detail["num_prompt_tokens"] for e in events if e.kind == "arrive"}
    steps = [e for e in events if e.kind == "schedule"]
    assert all(e.detail["num_tokens"] <= 8 for e in steps)
    # A chunk starting inside a prompt: that prompt was split across steps.
    assert any(0 < e.detail["start"] < prompt_len[e.request_id] for e in steps)
    # Some step ran a piece of a prompt beside another request's decode.
    by_step = {}
    for e in steps:
        kind = "decode" if e.detail["start"] >= prompt_len[e.request_id] else "prompt"
        by_step.setdefault(e.step, set()).add(kind)
    assert {"prompt", "decode"} in by_step.values()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_greedy_equals_hf_with_prefix_caching(tiny, arch):
    """Prompts sharing a 40-token prefix, generated twice: the second time their full
    prefix blocks come from the prefix cache (§4.4), and the tokens are still HF's."""
    path, oracle = tiny(arch)
    prefix = random_prompt(40, seed=99)
    prompts = [prefix + random_prompt(n, seed=100 + n) for n in (1, 5, 13)] + [prefix]
    llm = make_llm(path, block_size=8, enable_prefix_caching=True, trace=True)
    for _ in range(2):
        assert_greedy_matches_hf(
            generate(llm, prompts, GREEDY_LOGPROBS), prompts, oracle, MAX_TOKENS, logprobs=3
        )
        assert_all_blocks_free(llm)  # cached blocks stay, but only as evictable
    stats = llm.stats()
    assert stats["prefix_cache_hit_rate"] > 0 and stats["num_cached_blocks"] > 0
    cached = [
        e.detail["num_cached_tokens"] for e in llm.engine.trace.events if e.kind == "allocate"
    ]
    assert max(cached) >= 40  # the whole shared prefix (5 full blocks) was reused


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernel_backend_equals_torch_backend(tiny, backend):
    """The Triton and the CUDA kernels (interpreted and emulated on a CPU) decode the
    same greedy tokens as the torch reference, and all equal HF: a small batch with a
    prompt spanning blocks and decodes crossing a block boundary, on a checkpoint with a
    head_dim the CUDA kernels are built for."""
    path, oracle = tiny("llama", head_dim=64)
    prompts = [random_prompt(n, seed=n) for n in (5, 11)]
    params = SamplingParams(temperature=0, max_tokens=6)
    outputs = {}
    for name in ("torch", backend):
        llm = make_llm(path, block_size=8, num_gpu_blocks=8, attention_backend=name)
        outputs[name] = generate(llm, prompts, params)
        assert_greedy_matches_hf(outputs[name], prompts, oracle, 6)
        assert_all_blocks_free(llm)
    assert [o.outputs[0].token_ids for o in outputs[backend]] == [
        o.outputs[0].token_ids for o in outputs["torch"]
    ]


@pytest.mark.parametrize(
    "arch, block_size, bad",
    [("llama", 16, "head_dim"), ("qwen3", 16, "head_dim"), ("llama", 4, "block_size")],
)
def test_cuda_backend_refuses_shapes_it_is_not_built_for(tiny, arch, block_size, bad):
    path, _ = tiny(arch) if bad == "head_dim" else tiny(arch, head_dim=64)
    with pytest.raises(ValueError, match=f"{bad} must be one of"):
        make_llm(path, block_size=block_size, num_gpu_blocks=8, attention_backend="cuda")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_greedy_completions_under_preemption_equal_hf(tiny, mode):
    """n=3 greedy completions are forks of one prompt; a pool that fits one worst-case
    request preempts whole groups (all-or-nothing, §4.5), and every completion is
    still HF's greedy continuation."""
    path, oracle = tiny("llama")
    prompts = [random_prompt(n, seed=400 + n) for n in (7, 18, 29)]
    block_size = 8
    worst = max(3 * blocks_for(len(p) + MAX_TOKENS, block_size) for p in prompts)
    llm = make_llm(path, block_size=block_size, num_gpu_blocks=worst, preemption_mode=mode)
    outputs = generate(llm, prompts, SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, outputs):
        expected, _ = oracle.greedy(prompt, MAX_TOKENS)
        assert [c.token_ids for c in out.outputs] == [expected] * 3
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_out_blocks"] > 0) == (mode == "swap")
    assert_all_blocks_free(llm)


# -- 2. Parallel sampling and seeds ---------------------------------------------------


def run_stepwise(llm, prompt, requests, decode_steps):
    """Queue ``requests`` (id -> params) on the engine, run the prompt step and
    ``decode_steps`` decodes, read the stats, then finish: ``(stats, outputs)``."""
    for request_id, params in requests.items():
        llm.engine.add_request(request_id, prompt, params)
    for _ in range(1 + decode_steps):
        llm.engine.step()
    stats = llm.stats()
    outputs = {}
    while llm.engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.engine.step())
    assert_all_blocks_free(llm)
    return stats, outputs


def test_parallel_sampling_shares_the_prompt_blocks(tiny):
    """n=4 completions of one prompt fork after the prompt runs and share its blocks
    (§4.4): at the first decode they hold the prompt's 4 full blocks once plus one last
    block each (the partly filled one copied on write), where 4 separate requests hold
    4 x 5 blocks (without the prefix cache, which would share their full blocks too).
    With seeds, completion i draws as a request seeded ``seed + i``."""
    path, _ = tiny("llama")
    prompt = random_prompt(37, seed=37)  # 4 full blocks of 8 and 5 tokens in a fifth
    sampled = dict(temperature=1.0, max_tokens=12)
    llm = make_llm(path, block_size=8, num_gpu_blocks=32, enable_prefix_caching=False)
    together, n_out = run_stepwise(
        llm, prompt, {"n": SamplingParams(n=4, seed=3, **sampled)}, decode_steps=1
    )
    apart, sep_out = run_stepwise(
        llm,
        prompt,
        {f"s{i}": SamplingParams(seed=3 + i, **sampled) for i in range(4)},
        decode_steps=1,
    )
    assert together["num_used_gpu_blocks"] == 37 // 8 + 4
    assert together["num_shared_gpu_blocks"] == 37 // 8
    assert apart["num_used_gpu_blocks"] == 4 * blocks_for(37 + 1, 8)
    assert apart["num_shared_gpu_blocks"] == 0
    completions = n_out["n"].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert [c.token_ids for c in completions] == [
        sep_out[f"s{i}"].outputs[0].token_ids for i in range(4)
    ]


def test_seeded_sampling_reproduces_alone_in_a_batch_and_across_instances(tiny):
    """A seeded request's tokens depend on its seed only: not on what shares its batch
    (unseeded, differently seeded, n > 1 requests), nor on the LLM instance or its
    engine seed.  Different seeds, and the n completions of one seed, differ."""
    path, _ = tiny("qwen2")
    prompt, other = random_prompt(12, seed=1), random_prompt(30, seed=2)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)

    def tokens(out):
        return out.outputs[0].token_ids

    llm = make_llm(path)
    alone = tokens(generate(llm, [prompt], seeded)[0])
    assert_all_blocks_free(llm)
    batch = generate(
        llm,
        [other, prompt, other, prompt, prompt],
        [
            SamplingParams(temperature=1.0, max_tokens=16),
            seeded,
            SamplingParams(temperature=0.8, seed=7, max_tokens=16),
            SamplingParams(n=3, temperature=1.0, max_tokens=9),
            SamplingParams(temperature=1.0, seed=1235, max_tokens=16),
        ],
    )
    assert tokens(batch[1]) == alone
    assert tokens(batch[4]) != alone  # another seed, another draw
    assert_all_blocks_free(llm)
    again = make_llm(path, seed=42)
    assert tokens(generate(again, [prompt], seeded)[0]) == alone
    greedy = generate(again, [prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    assert tokens(greedy) != alone  # it really sampled
    n4 = generate(again, [prompt], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=16))[0]
    assert len({tuple(c.token_ids) for c in n4.outputs}) == 4
    assert_all_blocks_free(again)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_does_not_depend_on_preemption(tiny, mode):
    """Seeded n=2 requests draw the same tokens from a pool so small they are preempted
    as from one where they never are: a recomputed sequence does not draw again for the
    tokens it already has, and a swapped one keeps its generator."""
    path, _ = tiny("qwen3")
    prompts = [random_prompt(n, seed=500 + n) for n in (5, 17, 33)]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=10 + i, max_tokens=MAX_TOKENS) for i in range(3)
    ]

    def completions(llm):
        outputs = generate(llm, prompts, params)
        assert_all_blocks_free(llm)
        return [[c.token_ids for c in o.outputs] for o in outputs]

    roomy = make_llm(path, block_size=8)
    expected = completions(roomy)
    worst = max(2 * blocks_for(len(p) + MAX_TOKENS, 8) for p in prompts)
    tight = make_llm(path, block_size=8, num_gpu_blocks=worst, preemption_mode=mode)
    assert completions(tight) == expected
    assert roomy.stats()["num_preemptions"] == 0 < tight.stats()["num_preemptions"]


# -- 4. Bad input ---------------------------------------------------------------------

GOOD = random_prompt(10, seed=10)
GOOD_PARAMS = SamplingParams(temperature=0, max_tokens=8)
MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def served(tiny):
    """One engine serving every bad-input case in turn (max_model_len 48, 8 blocks of
    16, 4 sequences at most), with its answer to a good request before any of them."""
    path, oracle = tiny("llama")
    llm = make_llm(path, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=8, max_num_seqs=4)
    first = llm.generate({"prompt_token_ids": GOOD}, GOOD_PARAMS, use_tqdm=False)
    assert_greedy_matches_hf(first, [GOOD], oracle, 8)
    return llm, first[0].outputs[0].token_ids


BAD_CALLS = {
    "empty prompt_token_ids": (lambda llm: llm.generate({"prompt_token_ids": []}), "prompt"),
    "prompt longer than max_model_len": (
        lambda llm: llm.generate({"prompt_token_ids": random_prompt(MAX_MODEL_LEN + 1, 1)}),
        "max_model_len",
    ),
    "max_tokens 0": (lambda llm: llm.generate(GOOD, SamplingParams(max_tokens=0)), "max_tokens"),
    "n 0": (lambda llm: llm.generate(GOOD, SamplingParams(n=0)), "n"),
    "negative temperature": (
        lambda llm: llm.generate(GOOD, SamplingParams(temperature=-0.5)),
        "temperature",
    ),
    "top_p 0": (lambda llm: llm.generate(GOOD, SamplingParams(top_p=0.0)), "top_p"),
    "top_p above 1": (lambda llm: llm.generate(GOOD, SamplingParams(top_p=1.5)), "top_p"),
    "token id outside the vocabulary": (
        lambda llm: llm.generate({"prompt_token_ids": [1, 2, 100_000]}),
        "prompt_token_ids",
    ),
    "no prompts": (lambda llm: llm.generate([]), "prompts"),
    "one params per prompt, miscounted": (
        lambda llm: llm.generate(as_inputs([GOOD, GOOD]), [GOOD_PARAMS]),
        "sampling_params",
    ),
    "n more than max_num_seqs": (
        lambda llm: llm.generate(as_inputs([GOOD]), SamplingParams(n=5)),
        "n",
    ),
    "more blocks than the pool": (
        lambda llm: llm.generate(as_inputs([GOOD]), SamplingParams(n=4, max_tokens=32)),
        "max_tokens",
    ),
    "beam_width more than max_num_seqs": (
        lambda llm: llm.beam_search(as_inputs([GOOD]), BeamSearchParams(beam_width=5)),
        "beam_width",
    ),
    "good prompts around an empty one": (
        lambda llm: llm.generate(
            [
                {"prompt_token_ids": GOOD},
                {"prompt_token_ids": []},
                {"prompt_token_ids": random_prompt(20, 3)},
            ],
            GOOD_PARAMS,
        ),
        "prompt",
    ),
    "good prompts around a too long one": (
        lambda llm: llm.generate(as_inputs([GOOD, random_prompt(60, 4), GOOD]), GOOD_PARAMS),
        "max_model_len",
    ),
    "good and bad params, one per prompt": (
        lambda llm: llm.generate(
            as_inputs([GOOD, GOOD]), [GOOD_PARAMS, SamplingParams(n=4, max_tokens=40)]
        ),
        "max_tokens",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_naming_the_argument_and_changes_nothing(served, case):
    """Each bad call raises ValueError naming the bad argument, before any request of
    the call is queued: the engine's counters and pools are exactly as before, and a
    good request still gets its earlier (HF-equal) answer."""
    llm, expected = served
    call, name = BAD_CALLS[case]
    before = llm.stats()
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call(llm)
    assert llm.stats() == before
    assert_all_blocks_free(llm)
    again = llm.generate({"prompt_token_ids": GOOD}, GOOD_PARAMS, use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected
    assert_all_blocks_free(llm)


def test_empty_string_prompt_is_refused(served):
    """An empty text prompt is as empty as an empty list of token ids."""
    llm, _ = served
    with pytest.raises(ValueError, match=r"\bprompt\b"):
        llm.generate("", GOOD_PARAMS, use_tqdm=False)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(attention_backend="nope"), "attention_backend"),
        (dict(preemption_mode="evict"), "preemption_mode"),
        (dict(block_size=0), "block_size"),
        (dict(max_model_len=4096), "max_model_len"),  # more than the model's 1024 positions
    ],
)
def test_bad_engine_arguments_raise_naming_them(tiny, kwargs, name):
    """LLM(...) refuses a bad setting with a ValueError that names it."""
    path, _ = tiny("llama")
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        LLM(path, **kwargs)


# -- 5. Sampling features end to end --------------------------------------------------


def decode(llm, token_ids):
    return llm.get_tokenizer().decode(token_ids, skip_special_tokens=True)


def test_stop_token_ids_end_the_completion_at_that_token(tiny):
    """A stop token id ends the completion when generated: it is the last token, the
    finish reason is "stop" with the id as stop reason, and the text leaves it out."""
    path, oracle = tiny("llama")
    prompt = random_prompt(9, seed=9)
    expected, _ = oracle.greedy(prompt, MAX_TOKENS)
    assert EOS not in expected
    # The first token that does not occur earlier, at least 3 tokens in.
    i = next(i for i in range(3, len(expected)) if expected[i] not in expected[:i])
    llm = make_llm(path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[expected[i]])
    (out,) = generate(llm, [prompt], params)[0].outputs
    assert out.token_ids == expected[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", expected[i])
    assert out.text == decode(llm, expected[:i])
    assert_all_blocks_free(llm)


def stop_string_case(oracle, max_tokens):
    """A prompt, HF's greedy tokens for it, and the index ``i`` of a token completing a
    two-character ASCII string that the text before it does not contain."""
    printable = range(32, 127)
    for seed in range(50):
        prompt = random_prompt(5 + seed, seed=seed)
        expected, _ = oracle.greedy(prompt, max_tokens)
        for i in range(3, len(expected)):
            if expected[i - 1] in printable and expected[i] in printable:
                stop = chr(expected[i - 1]) + chr(expected[i])
                if stop not in bytes(t for t in expected[:i] if t < 256).decode("latin-1"):
                    return prompt, expected, i, stop
    raise AssertionError("no greedy continuation with two printable characters in a row")


def test_stop_string_truncates_the_text_before_it(tiny):
    """A stop string ends the completion with the token that completes it (a string
    spanning two tokens here); the text is cut just before the stop string."""
    path, oracle = tiny("llama")
    prompt, expected, i, stop = stop_string_case(oracle, MAX_TOKENS)
    llm = make_llm(path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["never here", stop])
    (out,) = generate(llm, [prompt], params)[0].outputs
    assert out.token_ids == expected[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    full = decode(llm, expected[: i + 1])
    assert out.text == full[: full.index(stop)]
    assert_all_blocks_free(llm)


def test_max_tokens_finishes_with_length(tiny):
    """Without EOS or a stop, a completion is exactly max_tokens long, ends "length",
    and its text is its tokens decoded."""
    path, oracle = tiny("llama")
    prompt = random_prompt(9, seed=9)
    expected, _ = oracle.greedy(prompt, 7)
    llm = make_llm(path)
    (out,) = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=7))[0].outputs
    assert out.token_ids == expected and len(expected) == 7
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert out.text == decode(llm, expected)
    assert_all_blocks_free(llm)


def test_max_model_len_caps_the_completion(tiny):
    """A sequence never grows past max_model_len: the completion stops there with
    "length", before max_tokens."""
    path, oracle = tiny("llama")
    prompt = random_prompt(20, seed=20)
    expected, _ = oracle.greedy(prompt, 4)
    llm = make_llm(path, max_model_len=24)
    (out,) = generate(llm, [prompt], GREEDY)[0].outputs
    assert out.token_ids == expected and len(expected) == 24 - 20
    assert out.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_text_prompts_are_tokenized_as_hf_does(tiny):
    """A text prompt becomes the checkpoint tokenizer's ids (BOS first), which the
    output reports along with the text, and is completed as HF completes those ids."""
    path, oracle = tiny("qwen2")
    llm = make_llm(path)
    texts = ["Hello, world", "PagedAttention"]
    outputs = llm.generate(texts, GREEDY, use_tqdm=False)
    ids = [oracle.tokenizer(t).input_ids for t in texts]
    assert [o.prompt for o in outputs] == texts
    assert all(i[0] == oracle.tokenizer.bos_token_id for i in ids)
    assert_greedy_matches_hf(outputs, ids, oracle, MAX_TOKENS)
    assert_all_blocks_free(llm)


def test_ignore_eos_generates_past_eos(tiny):
    """With ignore_eos, a prompt whose greedy continuation stops at EOS goes on through
    it to max_tokens, as a cache-free greedy loop on HF's model does."""
    path, oracle = tiny("llama")
    prompt = oracle.eos_prompt(MAX_TOKENS)
    stopped, _ = oracle.greedy(prompt, MAX_TOKENS)
    max_tokens = len(stopped) + 5
    llm = make_llm(path)
    (plain,) = generate(llm, [prompt], GREEDY)[0].outputs
    assert plain.token_ids == stopped and plain.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    (out,) = generate(llm, [prompt], params)[0].outputs
    assert out.token_ids == oracle.greedy_ignoring_eos(prompt, max_tokens)
    assert out.token_ids[len(stopped) - 1] == EOS and out.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_sampled_logprobs_are_the_models_raw_logprobs(tiny):
    """With temperature, top-k and top-p on, each step's logprobs are still log_softmax
    of the model's raw logits (vLLM's default): the sampled token's, and the top 2,
    equal to HF's full forward over the same tokens; the cumulative logprob sums them."""
    path, oracle = tiny("qwen3")
    prompt = random_prompt(15, seed=15)
    llm = make_llm(path)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=10, logprobs=2)
    (out,) = generate(llm, [prompt], params)[0].outputs
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for step, (token, ours) in enumerate(zip(out.token_ids, out.logprobs)):
        hf = oracle.next_logprobs(prompt + out.token_ids[:step])
        assert set(ours) == {token, *hf.topk(2).indices.tolist()}
        ids = list(ours)
        torch.testing.assert_close(torch.tensor([ours[t] for t in ids]), hf[ids], **FP32)
        total += float(hf[token])
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
    # Without logprobs, vLLM V1 reports no cumulative logprob either.
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=10)
    (plain,) = generate(llm, [prompt], params)[0].outputs
    assert plain.token_ids == out.token_ids
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert_all_blocks_free(llm)


# -- streaming outputs (output_kind) ---------------------------------------------------
def run_engine(llm, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add ``requests`` to the engine and step it dry; every output, in order."""
    for request_id, (prompt, params) in requests.items():
        llm.engine.add_request(request_id, prompt, params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    return outputs


STREAMED = dict(n=2, temperature=0.8, seed=7, max_tokens=MAX_TOKENS, logprobs=2)


@pytest.mark.parametrize("stop", ["none", "hit", "missed"])
def test_delta_outputs_join_to_the_final_output(tiny, stop):
    """A DELTA request reports every step's new tokens, text and logprobs; joined per
    completion they are exactly the finished FINAL_ONLY output of the same seeded
    request.  With stop strings a stream holds back text that could start one, so no
    streamed text is ever taken back."""
    path, _ = tiny("llama")
    prompt = random_prompt(11, seed=3)
    llm = make_llm(path, max_num_seqs=4, max_num_batched_tokens=4)  # chunked prefill: no news
    unstopped = generate(llm, [prompt], SamplingParams(**STREAMED))[0].outputs[1]
    assert unstopped.text == decode(llm, unstopped.token_ids)  # the oracle: a full decode
    text = unstopped.text  # two printable characters, from two tokens, make the stop
    k = next(
        k
        for k in range(3, len(text))
        if text[k : k + 2].isascii() and text[k : k + 2].isprintable() and len(text[k : k + 2]) == 2
    )
    stops = {"none": None, "hit": text[k : k + 2], "missed": "never here"}[stop]
    final = generate(llm, [prompt], SamplingParams(**STREAMED, stop=stops))[0]
    assert (final.outputs[1].stop_reason is not None) == (stop == "hit")
    deltas = run_engine(
        llm,
        {
            "s": (
                prompt,
                SamplingParams(**STREAMED, stop=stops, output_kind=RequestOutputKind.DELTA),
            )
        },
    )
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    for want in final.outputs:
        pieces = [c for d in deltas for c in d.outputs if c.index == want.index]
        assert all(c.token_ids for c in pieces)  # a completion is reported when it grows
        assert [c.finish_reason for c in pieces[:-1]] == [None] * (len(pieces) - 1)
        assert (pieces[-1].finish_reason, pieces[-1].stop_reason) == (
            want.finish_reason,
            want.stop_reason,
        )
        assert sum((c.token_ids for c in pieces), []) == want.token_ids
        assert sum((c.logprobs for c in pieces), []) == want.logprobs
        assert "".join(c.text for c in pieces) == want.text
    assert_all_blocks_free(llm)


def test_cumulative_outputs_grow_to_the_final_output(tiny):
    """CUMULATIVE: each report holds everything so far; the last is the final output."""
    path, _ = tiny("llama")
    prompt = random_prompt(5, seed=5)
    llm = make_llm(path)
    final = generate(llm, [prompt], SamplingParams(**STREAMED))[0]
    reports = run_engine(
        llm, {"c": (prompt, SamplingParams(**STREAMED, output_kind=RequestOutputKind.CUMULATIVE))}
    )
    assert len(reports) == MAX_TOKENS
    for earlier, later in zip(reports, reports[1:]):
        for a, b in zip(earlier.outputs, later.outputs):
            assert b.token_ids[: len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
    assert reports[-1].outputs == final.outputs
    assert_all_blocks_free(llm)


def test_final_only_requests_report_once_beside_streaming_ones(tiny):
    """In one batch, a FINAL_ONLY request appears only when it finishes."""
    path, _ = tiny("llama")
    llm = make_llm(path)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = run_engine(
        llm,
        {
            "final": (random_prompt(4, seed=1), greedy),
            "delta": (
                random_prompt(4, seed=2),
                SamplingParams(
                    temperature=0,
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    output_kind=RequestOutputKind.DELTA,
                ),
            ),
        },
    )
    assert [o.finished for o in outputs if o.request_id == "final"] == [True]
    assert sum(o.request_id == "delta" for o in outputs) == MAX_TOKENS
    assert_all_blocks_free(llm)


def test_generate_refuses_streaming_output_kinds(served):
    llm, _ = served
    with pytest.raises(ValueError, match="output_kind"):
        llm.generate("hi", SamplingParams(output_kind=RequestOutputKind.DELTA))
    assert_all_blocks_free(llm)

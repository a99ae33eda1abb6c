"""`LLM` as a vLLM user meets it: vLLM's keyword arguments (or a ValueError listing
minipaged's), ``LLM.chat`` through the tokenizer's chat template, a separate tokenizer,
and KV pools sized to what can be used and what the machine has."""

import dataclasses

import pytest
import torch

from engine_helpers import assert_all_blocks_free, make_llm
from minipaged import LLM, SamplingParams
from minipaged.config import EngineConfig
from minipaged.models.loader import read_config
from minipaged.worker import cache_engine
from minipaged.worker.cache_engine import GIB, block_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama")[0]


@pytest.fixture(scope="module")
def llm(llama):
    return make_llm(llama, num_gpu_blocks=32)


# -- vLLM's keyword arguments ---------------------------------------------------------
@pytest.mark.parametrize(
    "name, value",
    [
        ("mm_processor_kwargs", {"num_crops": 4}),
        ("load_format", "dummy"),
        ("cpu_offload_gb", 4),
        ("block_sise", 16),
    ],
)
def test_a_keyword_minipaged_lacks_is_a_value_error_listing_the_supported(llama, name, value):
    with pytest.raises(ValueError) as error:
        LLM(llama, **{name: value})
    message = str(error.value)
    assert message.startswith(f"{name}={value!r} is not supported by minipaged")
    supported = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    assert message.endswith("LLM(model, ...) takes " + ", ".join(supported))
    assert {"block_size", "gpu_memory_utilization", "tokenizer", "dtype"} <= set(supported)


def test_vllm_keywords_a_script_passes_are_accepted(llama, llm):
    copied = LLM(
        str(llama),
        trust_remote_code=True,
        gpu_memory_utilization=0.9,
        dtype="auto",
        tokenizer=str(llama),
        seed=0,
        max_model_len=256,
        enforce_eager=True,
        swap_space=0.01,
        num_gpu_blocks=32,
        device="cpu",
    )
    assert copied.engine.max_model_len == 256
    ours = copied.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"trust_remote_code": "yes"}, "trust_remote_code must be a bool, got 'yes'"),
        ({"tokenizer": 3}, "tokenizer must be a str, a path or None, got 3"),
    ],
)
def test_bad_values_of_the_new_keywords_name_them(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama, **kwargs)


def test_a_separate_tokenizer_is_the_one_used(llama, tiny):
    other = tiny("qwen2")[0]  # the same byte-level vocabulary, another tokenizer class
    llm = make_llm(llama, num_gpu_blocks=32, tokenizer=other)
    assert llm.get_tokenizer().name_or_path == str(other)


# -- chat -----------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because."},
        {"role": "user", "content": "Ok"},
    ],
]


def test_chat_is_generate_on_the_rendered_template(llm):
    tokenizer = llm.get_tokenizer()
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in CONVERSATIONS
    ]
    assert all(t.endswith("<|assistant|>\n") for t in texts)
    # The template writes BOS itself: exactly one, as the tokenizer's own rendering has
    # (generate(texts) would add a second).
    ids = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]
        for c in CONVERSATIONS
    ]
    assert all(i.count(tokenizer.bos_token_id) == 1 for i in ids)
    expected = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False)
    replies = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [r.prompt_token_ids for r in replies] == ids
    assert [r.prompt for r in replies] == texts
    assert [r.outputs[0].token_ids for r in replies] == [e.outputs[0].token_ids for e in expected]
    one = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == replies[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_chat_template_and_generation_prompt_are_honoured(llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    reply = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template=template)[0]
    assert reply.prompt == "[user] Hi there\n"
    bare = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert not bare.prompt.endswith("<|assistant|>\n")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [[]],
        [{"content": "no role"}],
        [[{"role": "user"}]],
        [["not a dict"]],
    ],
)
def test_malformed_messages_are_a_value_error(llm, messages):
    with pytest.raises(ValueError, match="messages must"):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_a_tokenizer_without_a_template_needs_chat_template(llm, monkeypatch):
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="chat_template must be given"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)


# -- pool sizing ----------------------------------------------------------------------
def pools(llm) -> tuple[int, int]:
    """The blocks the pools' tensors really hold, checked against what stats() says."""
    stats, cache = llm.stats(), llm.engine.cache_engine
    assert stats["num_gpu_blocks"] == cache.gpu_cache[0][0].shape[0]
    assert stats["num_cpu_blocks"] == cache.cpu_cache[0][0].shape[0]
    return stats["num_gpu_blocks"], stats["num_cpu_blocks"]


def test_pools_never_exceed_what_max_num_seqs_full_sequences_use(llama):
    # 4 sequences of 100 tokens in blocks of 16: 4 * 7 blocks, though 1 GiB of KV and
    # 4 GiB of swap space hold hundreds of thousands of the tiny model's blocks.
    llm = LLM(llama, device="cpu", max_num_seqs=4, max_model_len=100, swap_space=4)
    assert pools(llm) == (28, 28)


def test_pools_follow_the_gib_asked_for_when_they_are_smaller(llama):
    llm = LLM(llama, device="cpu", cpu_kv_space=0.001, swap_space=0.0005)
    per_block = block_bytes(llm.engine.model.config, 16, torch.float32)
    assert pools(llm) == (int(0.001 * GIB // per_block), int(0.0005 * GIB // per_block))


def test_pools_fit_half_the_memory_available(llama, monkeypatch):
    per_block = block_bytes(read_config(llama), 16, torch.float32)
    monkeypatch.setattr(cache_engine, "available_memory", lambda: 2 * 30 * per_block)
    llm = LLM(llama, device="cpu")  # 1 GiB and 4 GiB asked for; 30 blocks' worth allowed
    assert pools(llm) == (30, 0)  # the CPU device's pool takes it all; no swap is left
    llm = LLM(llama, device="cpu", num_gpu_blocks=12)
    assert pools(llm) == (12, 18)
    out = llm.generate(["Hello", "abc"], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
    assert_all_blocks_free(llm)


def test_available_memory_is_the_kernels_memavailable():
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    expected = int(fields["MemAvailable"].split()[0]) * 1024
    # Other processes allocate meanwhile: within 5% of a reading taken just before.
    assert cache_engine.available_memory() == pytest.approx(expected, rel=0.05)

"""What an evaluation harness asks of the server, in vLLM's shapes: completions that echo
the prompt with its logprobs (a batch of text or token-id prompts, lm-eval's exact
body), the ``prompt_logprobs`` field on completions and chat, ``/tokenize``,
``/detokenize`` and ``/tokenizer_info``; every request field that minipaged does not
implement refused by name; and a ``max_model_len`` the KV pool cannot hold refused at
start-up.  The oracle for every logprob is Hugging Face's forward pass on the same
tiny checkpoint; for tokens, its tokenizer.  The real client, lm-eval itself, runs in
`tests/test_lm_eval.py`.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi")  # the server extra; the GPU machine has none

import httpx  # noqa: E402
import torch  # noqa: E402

from engine_helpers import FP32, make_llm, random_prompt  # noqa: E402
from minipaged.server.protocol import (  # noqa: E402
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    UNSUPPORTED,
)
from server_helpers import MAX_MODEL_LEN, MODEL, in_process, wait_idle  # noqa: E402

TEXTS = ["The capital of France is", "Once upon a time", "a"]
IDS = [random_prompt(n, seed) for seed, n in enumerate([7, 1, 12])]
# lm-eval's loglikelihood request (lm_eval.models.openai_completions), prompts aside.
LM_EVAL = {"max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}


@pytest.fixture(scope="module")
def served(tiny):
    path, oracle = tiny("llama")
    for base_url, _ in in_process(path):
        yield base_url, oracle


@pytest.fixture
def post(served):
    base_url, _ = served

    def post(route: str, body: dict, status: int = 200) -> dict:
        response = httpx.post(f"{base_url}{route}", json=body, timeout=60)
        assert response.status_code == status, response.text
        return response.json()

    yield post
    wait_idle(base_url)


def hf_logprobs(oracle, token_ids: list[int]) -> torch.Tensor:
    """``[len, vocab]``: row p is log_softmax of HF's logits after ``token_ids[: p + 1]``."""
    with torch.no_grad():
        return oracle.hf(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def close(a, b) -> bool:
    return abs(a - b) <= FP32["atol"] + 1e-5 * abs(b)


@pytest.mark.parametrize("prompts", [TEXTS, IDS], ids=["text", "token-ids"])
def test_echo_with_logprobs_is_what_lm_eval_reads(served, post, prompts):
    """Per choice: the prompt's tokens then the generated one, the first logprob null,
    every other HF's logprob of that token, top_logprobs the token and the best one,
    text_offset where each token's text starts in the echoed text."""
    _, oracle = served
    reply = post("/v1/completions", {"model": MODEL, "prompt": prompts, **LM_EVAL})
    tokenizer = oracle.tokenizer
    for prompt, choice in zip(prompts, reply["choices"]):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        logprobs = choice["logprobs"]
        tokens = logprobs["tokens"]
        assert len(tokens) == len(ids) + 1 and tokens[: len(ids)] == [
            tokenizer.decode([t]) for t in ids
        ]
        expected = hf_logprobs(oracle, ids)
        generated = int(expected[-1].argmax())  # greedy
        assert tokens[-1] == tokenizer.decode([generated])
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for p, token in enumerate([*ids[1:], generated], start=1):
            assert close(logprobs["token_logprobs"][p], float(expected[p - 1, token]))
            top = logprobs["top_logprobs"][p]
            best = int(expected[p - 1].argmax())
            assert set(top) == {tokenizer.decode([token]), tokenizer.decode([best])}
            assert close(max(top.values()), float(expected[p - 1, best]))
        assert logprobs["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        assert choice["text"] == text + tokens[-1]
        assert "prompt_logprobs" not in choice  # not asked for by name


def test_streamed_echo_carries_the_prompt_logprobs_first(served, post):
    base_url, _ = served
    body = {"model": MODEL, "prompt": TEXTS[0], **LM_EVAL, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        chunks = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    whole = post("/v1/completions", {**body, "stream": False})["choices"][0]
    streamed = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in streamed) == whole["text"]
    # (Later chunks' text_offset counts the text sent, as vLLM's: not compared.)
    for key in ("tokens", "token_logprobs"):
        got = sum((c["logprobs"][key] for c in streamed), [])
        assert got[0] == whole["logprobs"][key][0]  # the prompt's first token
        assert got[1:] == pytest.approx(whole["logprobs"][key][1:], abs=1e-5), key


def test_prompt_logprobs_field_on_completions_and_chat(served, post):
    """vLLM's extra field: per prompt token null, then ``{id: {logprob, rank,
    decoded_token}}`` with the prompt token first and its 2 best alternatives; on a
    completion choice, and beside the choices of a chat reply."""
    _, oracle = served
    reply = post(
        "/v1/completions",
        {"model": MODEL, "prompt": IDS[2], "max_tokens": 2, "prompt_logprobs": 2},
    )
    (choice,) = reply["choices"]
    assert choice["logprobs"] is None  # not asked for
    assert_vllm_prompt_logprobs(oracle, IDS[2], choice["prompt_logprobs"], 2)
    messages = [{"role": "user", "content": "Hi there"}]
    chat = post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0},
    )
    templated = post("/tokenize", {"model": MODEL, "messages": messages})["tokens"]
    assert_vllm_prompt_logprobs(oracle, templated, chat["prompt_logprobs"], 0)


def assert_vllm_prompt_logprobs(oracle, ids: list[int], entries: list, k: int) -> None:
    expected = hf_logprobs(oracle, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for p, (token, entry) in enumerate(zip(ids[1:], entries[1:])):
        assert next(iter(entry)) == str(token)
        ranked = expected[p].argsort(descending=True).tolist()
        assert {int(t) for t in entry} == {token, *ranked[:k]}
        for t, logprob in entry.items():
            assert close(logprob["logprob"], float(expected[p, int(t)]))
            assert logprob["decoded_token"] == oracle.tokenizer.decode([int(t)])
            rank = ranked.index(int(t)) + 1
            assert logprob["rank"] == (rank if rank <= k else None)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": -1}, None),
        ({"prompt": "a", "echo": True, "logprobs": 21}, "logprobs"),
        (
            {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options",
        ),
    ],
)
def test_bad_logprob_requests_are_refused(post, body, param):
    error = post("/v1/completions", {"model": MODEL, **body}, 400)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


UNSUPPORTED_BY_ROUTE = {
    "/v1/completions": {**UNSUPPORTED, **COMPLETION_UNSUPPORTED},
    "/v1/chat/completions": {**UNSUPPORTED, **CHAT_UNSUPPORTED},
}


@pytest.mark.parametrize(
    "route, name",
    [
        pytest.param(route, name, id=f"{route.split('/')[-1]}-{name}")
        for route, table in UNSUPPORTED_BY_ROUTE.items()
        for name in table
    ],
)
def test_every_unimplemented_field_is_refused_by_name(post, route, name):
    """A value that asks for something is a 400 naming the field; each value that
    asks for nothing (vLLM's default) is answered."""
    base = (
        {"prompt": "a"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "a"}]}
    )
    base |= {"model": MODEL, "max_tokens": 1}
    error = post(route, {**base, name: "on"}, 400)["error"]
    assert error["param"] == name and name in error["message"]
    for off in UNSUPPORTED_BY_ROUTE[route][name]:
        post(route, {**base, name: off})


def test_tokenize_and_detokenize_equal_the_tokenizer(served, post):
    _, oracle = served
    tokenizer = oracle.tokenizer
    text = "Paged attention, step by step."
    reply = post("/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert reply["tokens"] == tokenizer.encode(text)
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == MAX_MODEL_LEN
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(reply["tokens"])
    bare = post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None
    messages = [{"role": "user", "content": text}]
    chat = post("/tokenize", {"messages": messages, "add_generation_prompt": False})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert post("/detokenize", {"tokens": reply["tokens"]})["prompt"] == tokenizer.decode(
        reply["tokens"]
    )


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/tokenize", {"prompt": "ab " * 200}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": [{}]}, "tools"),
        ("/tokenize", {"model": "gpt-9", "prompt": "a"}, "model"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input(post, route, body, param):
    status = 404 if param == "model" else 400
    assert post(route, body, status)["error"]["param"] == param


def test_tokenizer_info_is_vllms(served):
    """What lm-eval's remote tokenizer reads first: the special tokens and the chat
    template, as strings."""
    base_url, oracle = served
    info = httpx.get(f"{base_url}/tokenizer_info").json()
    tokenizer = oracle.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    json.dumps(info)  # every value is JSON


def test_max_model_len_must_fit_the_pool(tiny, caplog):
    """vLLM's start-up check when max_model_len is asked for: an error naming both
    numbers and the flags; taken from the model (1024 positions), lowered to the pool's
    160 tokens with a warning, and a request may then run to the end of it."""
    path, _ = tiny("llama")
    with pytest.raises(
        ValueError, match=r"max_model_len=512 .* pool has 10 \(160 tokens\).*--num-gpu-blocks"
    ):
        make_llm(path, num_gpu_blocks=10, block_size=16, max_model_len=512)
    with caplog.at_level(logging.WARNING, logger="minipaged"):
        llm = make_llm(path, num_gpu_blocks=10, block_size=16)
    assert llm.engine.max_model_len == 160
    assert "max_model_len lowered from the model's 1024 to 160" in caplog.text
    from minipaged import SamplingParams

    (output,) = llm.generate(
        {"prompt_token_ids": [1, 2, 3]},
        SamplingParams(max_tokens=1000, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(output.outputs[0].token_ids) == 160 - 3

"""The OpenAI-compatible server (minipaged.server), through the official ``openai`` client
and raw HTTP, against the app in this process and a real ``minipaged serve`` process.

The oracle for every answer is ``LLM.generate`` on the same checkpoint (itself checked
against Hugging Face in test_engine.py): greedy text equal, seeded samples equal.  After
each workload ``/metrics`` must show every block free.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")  # the server extra; the GPU machine has none

import httpx  # noqa: E402
import openai  # noqa: E402

from cli_helpers import run_main  # noqa: E402
from engine_helpers import make_llm, random_prompt  # noqa: E402
from minipaged import SamplingParams  # noqa: E402
from server_helpers import (  # noqa: E402
    ENGINE,
    MAX_MODEL_LEN,
    MODEL,
    in_process,
    metrics,
    openai_client,
    subprocess_server,
    wait_idle,
)

PROMPTS = ["Hello, my name is", "The capital of France", "a", "Once upon a time, there"]
GREEDY = dict(temperature=0, max_tokens=12)


@pytest.fixture(scope="module", params=["in-process", "subprocess"])
def base_url(request, tiny):
    path, _ = tiny("llama")
    if request.param == "in-process":
        for url, _ in in_process(path):
            yield url
    else:
        yield from subprocess_server(path)


@pytest.fixture(scope="module")
def oracle(tiny):
    path, _ = tiny("llama")
    return make_llm(path, **{k: v for k, v in ENGINE.items() if k != "device"})


@pytest.fixture
def client(base_url):
    with openai_client(base_url) as client:
        yield client


def expected(oracle, prompt, **params):
    """LLM.generate's completions of ``prompt`` (a str or token ids)."""
    given = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return oracle.generate(given, SamplingParams(**params), use_tqdm=False)[0].outputs


def chat_prompt(oracle, messages) -> list[int]:
    """The chat template as transformers renders it (the server's own path not used)."""
    tokenizer = oracle.get_tokenizer()
    return tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )


# -- answers ---------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "minipaged"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_llm_generate(client, oracle, prompt):
    (want,) = expected(oracle, prompt, **GREEDY)
    response = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    prompt_len = len(oracle.get_tokenizer().encode(prompt))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        prompt_len,
        len(want.token_ids),
    )


def test_streamed_completion_joins_to_the_same_text(client, oracle):
    (want,) = expected(oracle, PROMPTS[0], **GREEDY, ignore_eos=True)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    *pieces, last = chunks
    assert "".join(c.choices[0].text for c in pieces) == want.text
    assert len(pieces) == GREEDY["max_tokens"]  # one chunk per step: tokens arrive as made
    assert [c.choices[0].finish_reason for c in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert last.choices == [] and last.usage.completion_tokens == GREEDY["max_tokens"]


def test_prompts_as_token_ids_and_lists(client, oracle):
    """A list of prompts gives n choices each, prompt-major; token ids are taken as is."""
    ids = random_prompt(7, seed=7)
    response = client.completions.create(
        model=MODEL, prompt=[PROMPTS[1], PROMPTS[2]], n=2, seed=3, temperature=1.0, max_tokens=6
    )
    by_index = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    wants = [expected(oracle, p, n=2, seed=3, temperature=1.0, max_tokens=6) for p in PROMPTS[1:3]]
    assert by_index == [w.text for want in wants for w in want]
    (choice,) = client.completions.create(model=MODEL, prompt=ids, **GREEDY).choices
    assert choice.text == expected(oracle, ids, **GREEDY)[0].text


def test_seeded_sampling_is_reproducible_and_equals_llm_generate(client, oracle):
    params = dict(n=2, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, max_tokens=10)
    sample = dict(
        model=MODEL,
        prompt=PROMPTS[3],
        seed=1234,
        max_tokens=10,
        n=2,
        temperature=1.0,
        top_p=0.9,
        extra_body={"top_k": 50, "min_p": 0.01},
    )
    first = [c.text for c in client.completions.create(**sample).choices]
    assert [c.text for c in client.completions.create(**sample).choices] == first
    assert first == [w.text for w in expected(oracle, PROMPTS[3], seed=1234, **params)]
    other = [c.text for c in client.completions.create(**{**sample, "seed": 99}).choices]
    assert other != first


def test_stop_string_cuts_the_text(client, oracle):
    (full,) = expected(oracle, PROMPTS[0], **GREEDY, ignore_eos=True)
    stop = full.text[4:6]
    (want,) = expected(oracle, PROMPTS[0], **GREEDY, ignore_eos=True, stop=[stop])
    (choice,) = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], stop=[stop], extra_body={"ignore_eos": True}, **GREEDY
    ).choices
    assert (choice.text, choice.finish_reason) == (want.text, "stop")
    assert choice.model_extra["stop_reason"] == stop and stop not in choice.text
    streamed = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text  # nothing taken back


def test_echo_and_logprobs(client, oracle):
    (want,) = expected(oracle, PROMPTS[1], **GREEDY, logprobs=2)
    (echoed,) = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], echo=True, **GREEDY
    ).choices
    assert echoed.text == PROMPTS[1] + want.text
    (choice,) = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], logprobs=2, **GREEDY
    ).choices
    got = choice.logprobs.token_logprobs
    assert got == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)])
    assert len(choice.logprobs.tokens) == len(choice.logprobs.text_offset) == len(got)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_llm_generate_on_the_templated_prompt(client, oracle, stream):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi."}]},
    ]
    template_messages = [messages[0], {"role": "user", "content": "Say hi."}]
    (want,) = expected(oracle, chat_prompt(oracle, template_messages), **GREEDY, logprobs=1)
    response = client.chat.completions.create(
        model=MODEL, messages=messages, stream=stream, logprobs=True, top_logprobs=1, **GREEDY
    )
    if not stream:
        (choice,) = response.choices
        assert (choice.message.role, choice.message.content) == ("assistant", want.text)
        logprobs = [e.logprob for e in choice.logprobs.content]
        assert all(len(e.top_logprobs) == 1 for e in choice.logprobs.content)
    else:
        chunks = list(response)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
        logprobs = [e.logprob for c in chunks for e in c.choices[0].logprobs.content]
    assert logprobs == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)])


def test_chat_stream_reports_usage_last(client, oracle):
    messages = [{"role": "user", "content": "count"}]
    prompt = chat_prompt(oracle, messages)
    *_, last = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 5)


def test_32_concurrent_requests_share_batches_and_are_all_right(client, base_url, oracle):
    prompts = [random_prompt(3 + i % 13, seed=100 + i) for i in range(32)]
    wants = [expected(oracle, p, **GREEDY, ignore_eos=True)[0].text for p in prompts]
    before = metrics(base_url)

    def ask(prompt):
        return client.completions.create(
            model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **GREEDY
        )

    with ThreadPoolExecutor(32) as pool:
        texts = [r.choices[0].text for r in pool.map(ask, prompts)]
    assert texts == wants
    after = metrics(base_url)
    tokens, steps = (
        after[f"minipaged:{name}_total"] - before[f"minipaged:{name}_total"]
        for name in ("generation_tokens", "engine_steps")
    )
    assert tokens == 32 * 12
    assert steps < tokens / 4  # one at a time would take a step per token


# -- errors ----------------------------------------------------------------------------
TOO_LONG = "x" * (MAX_MODEL_LEN + 1)
BAD_REQUESTS = {  # name: (path, body, status, param)
    "negative max_tokens": ("completions", {"prompt": "a", "max_tokens": -1}, 400, None),
    "n = 0": ("completions", {"prompt": "a", "n": 0}, 400, None),
    "negative temperature": ("completions", {"prompt": "a", "temperature": -0.5}, 400, None),
    "temperature a string": (
        "completions",
        {"prompt": "a", "temperature": "hot"},
        400,
        "temperature",
    ),
    "prompt too long": ("completions", {"prompt": TOO_LONG}, 400, "prompt"),
    "prompt + max_tokens too long": (
        "completions",
        {"prompt": "abc", "max_tokens": 126},
        400,
        "prompt",
    ),
    "messages too long": (
        "chat/completions",
        {"messages": [{"role": "user", "content": TOO_LONG}]},
        400,
        "messages",
    ),
    "unknown model": ("completions", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    "missing prompt": ("completions", {"max_tokens": 3}, 400, "prompt"),
    "missing messages": ("chat/completions", {"max_tokens": 3}, 400, "messages"),
    "empty prompt list": ("completions", {"prompt": []}, 400, "prompt"),
    "empty messages": ("chat/completions", {"messages": []}, 400, "messages"),
    "chat max_tokens 0": (
        "chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
        400,
        None,
    ),
    "image content": (
        "chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        400,
        "messages",
    ),
    "token id out of range": ("completions", {"prompt": [1, 10**6]}, 400, None),
    "unsupported logit_bias": (
        "completions",
        {"prompt": "a", "logit_bias": {"5": 1.0}},
        400,
        "logit_bias",
    ),
    "presence_penalty out of range": (
        "completions",
        {"prompt": "a", "presence_penalty": 3.0},
        400,
        None,
    ),
    "top_p zero": ("completions", {"prompt": "a", "top_p": 0.0}, 400, None),
    "body not an object": ("completions", [1, 2], 400, None),
}


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(client, base_url, oracle, name):
    path, body, status, param = BAD_REQUESTS[name]
    assert_openai_error(httpx.post(f"{base_url}/v1/{path}", json=body), status, param)
    (choice,) = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY).choices
    assert choice.text == expected(oracle, PROMPTS[0], **GREEDY)[0].text


def test_malformed_json_and_unknown_routes(client, base_url):
    response = httpx.post(
        f"{base_url}/v1/completions",
        content=b'{"prompt": "a",',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, None)
    assert "JSON" in response.json()["error"]["message"]
    assert_openai_error(httpx.get(f"{base_url}/v1/nothing"), 404, None)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "a"}])


# -- aborts, health, soak --------------------------------------------------------------
def test_client_gone_mid_stream_aborts_and_frees_every_block(client, base_url):
    before = metrics(base_url)["minipaged:generation_tokens_total"]
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=100, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _ in zip(range(3), stream):
        pass
    assert metrics(base_url)["minipaged:kv_blocks_used"] > 0  # it holds blocks while running
    stream.close()
    after = wait_idle(base_url)
    assert after["minipaged:generation_tokens_total"] - before < 100  # it did stop early


def test_a_connection_idle_as_long_as_a_client_pool_keeps_one_is_still_served(base_url):
    """httpx (under the openai client and LangChain) sends a request on a pooled
    connection idle up to its keep-alive expiry; a server that closes it at that same
    moment (uvicorn's default 5 s) loses some of those requests to the race."""
    expiry = httpx.Limits().keepalive_expiry
    port = int(base_url.rsplit(":", 1)[1])
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(expiry + 0.5)
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # b"" if the server closed it


def test_health(base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200


async def soak_request(http: httpx.AsyncClient, i: int) -> str:
    """One of five kinds by ``i``: plain, streamed chat, n=2, invalid, aborted."""
    kind = ("plain", "chat", "n2", "invalid", "aborted")[i % 5]
    body = {
        "prompt": random_prompt(2 + i % 11, seed=i),
        "max_tokens": 4 + i % 9,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": i,
    }
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "stream": True, "max_tokens": 6}
    elif kind == "n2":
        body["n"] = 2
    elif kind == "invalid":
        body["top_p"] = 1.5
    elif kind == "aborted":
        body.update(stream=True, max_tokens=60)
    path = "chat/completions" if kind == "chat" else "completions"
    async with http.stream("POST", f"/v1/{path}", json=body) as response:
        if kind == "aborted":
            async for _ in response.aiter_lines():
                return "aborted"  # leaving the block closes the connection
        await response.aread()
    if kind == "invalid":
        return "invalid" if response.status_code == 400 else response.text
    assert response.status_code == 200, response.text
    if kind == "chat":
        assert response.text.rstrip().endswith("data: [DONE]")
        return kind
    choices = response.json()["choices"]
    return (
        kind
        if len(choices) == (2 if kind == "n2" else 1)
        and all(c["finish_reason"] == "length" for c in choices)
        else json.dumps(choices)
    )


def test_soak_of_mixed_requests_leaks_nothing(base_url):
    """300 requests, 32 at a time: plain, streamed, parallel-sampled, invalid and
    abandoned mid-stream; each answered as its kind should be, nothing left over."""

    async def soak():
        limit = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:

            async def one(i):
                async with limit:
                    return await soak_request(http, i)

            return await asyncio.gather(*(one(i) for i in range(300)))

    results = asyncio.run(soak())
    assert results == [("plain", "chat", "n2", "invalid", "aborted")[i % 5] for i in range(300)]
    wait_idle(base_url)
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_bench_serve_measures_the_server(base_url, tmp_path):
    """``minipaged bench serve`` end to end: every request completes with exactly the
    tokens it asked for (the server's own counter agrees), and the results file holds
    the contract's keys, sane latencies and a PNG."""
    before = metrics(base_url)["minipaged:generation_tokens_total"]
    out = tmp_path / "serve.json"
    assert (
        run_main(
            [
                "bench",
                "serve",
                "--base-url",
                base_url,
                "--request-rate",
                "40",
                "--num-requests",
                "16",
                "--workload",
                "alpaca",
                "--device",
                "cpu",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "results"} <= set(document)
    (row,) = document["results"]
    assert (row["completed"], row["failed"], row["model"]) == (16, 0, MODEL)
    asked = sum(r["output_len"] for r in document["requests"])
    assert row["total_output_tokens"] == asked
    generated = metrics(base_url)["minipaged:generation_tokens_total"] - before
    assert generated == asked + 1  # and the benchmark's untimed one-token warm-up
    assert all(0 < r["ttft_ms"] <= r["e2el_ms"] for r in document["requests"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < row[f"median_{name}_ms"] <= row[f"p99_{name}_ms"]
    assert out.with_suffix(".png").stat().st_size > 0
    wait_idle(base_url)


# -- the API key -----------------------------------------------------------------------
def test_api_key_guards_v1_only(tiny):
    path, _ = tiny("llama")
    for base_url, _ in in_process(path, api_key="sesame"):
        url = f"{base_url}/v1/models"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = httpx.get(url, headers=headers)
            assert_openai_error(response, 401, None)
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url, headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(f"{base_url}/health").status_code == 200
        assert httpx.get(f"{base_url}/metrics").status_code == 200


def test_a_failing_engine_fails_requests_clearly_and_health_says_so(tiny):
    """If a step raises, the engine's state is unknown: waiting requests get a 500 (or
    an error event mid-stream), new ones are refused, and /health turns 503."""
    path, _ = tiny("llama")
    for base_url, engine in in_process(path):

        def broken_step(fail_alone=False):
            raise RuntimeError("a kernel fell over")

        engine.engine.step = broken_step
        body = {"prompt": "a", "max_tokens": 4}
        streamed = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": True})
        first, done = [line for line in streamed.text.splitlines() if line]
        assert "a kernel fell over" in json.loads(first.removeprefix("data: "))["error"]["message"]
        assert done == "data: [DONE]"
        response = httpx.post(f"{base_url}/v1/completions", json=body)
        assert response.status_code == 500
        assert "a kernel fell over" in response.json()["error"]["message"]
        assert response.json()["error"]["type"] == "server_error"
        assert httpx.get(f"{base_url}/health").status_code == 503

"""The server survives every request: no single request can stop it, stall it or leak
from it.  Engine-level isolation of a failing request, then the server's limits, auth,
host checks, timeouts and shutdown, each against the app in this process (or a real
``minipaged serve`` where the process itself is the subject).

The oracle for outputs is ``LLM.generate`` on the same checkpoint; after each test every
KV block must be free again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")  # the server extra; the GPU machine has none

import httpx

import minipaged.sample.parallel_sampling as sampling_module
from cli_helpers import run_main
from engine_helpers import (
    assert_all_blocks_free,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.bench import chaos
from minipaged.server.app import default_model_name
from minipaged.server.guard import LOCAL_HOSTS, default_allowed_hosts, host_name
from minipaged.server.limits import ServerLimits
from server_helpers import (
    ENGINE,
    FLAGS,
    free_port,
    in_process_app,
    metrics,
    wait_healthy,
    wait_idle,
)


@pytest.fixture(scope="module")
def checkpoint(tiny):  # noqa: F811  (pytest passes the imported fixture)
    """The tiny Llama checkpoint every test here serves."""
    path, _ = tiny("llama")
    return path


CULPRIT_SEED = 666  # the request whose sampling is made to raise


def failing_sample(real):
    """``sample`` that raises for any batch holding the culprit, after drawing (so the
    other rows' generators have moved on and must be rolled back)."""

    def sample(logits, params, *args, **kwargs):
        out = real(logits, params, *args, **kwargs)
        if any(p.seed == CULPRIT_SEED for p in params):
            raise RuntimeError("the sampler fell over")
        return out

    return sample


def test_a_request_whose_sampling_raises_fails_alone(checkpoint, monkeypatch):
    """With ``fail_alone`` the culprit is aborted with its error and its blocks freed;
    the others (greedy, seeded, n=2) finish exactly as LLM.generate makes them."""
    path = checkpoint
    llm = make_llm(path)
    others = [
        (random_prompt(5 + i, seed=i), params)
        for i, params in enumerate(
            [
                SamplingParams(temperature=0, max_tokens=8),
                SamplingParams(temperature=1.0, seed=7, max_tokens=8),
                SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6),
            ]
        )
    ]
    wants = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0] for p, sp in others]
    monkeypatch.setattr(sampling_module, "sample", failing_sample(sampling_module.sample))
    engine = llm.engine
    culprit = SamplingParams(temperature=1.0, seed=CULPRIT_SEED, max_tokens=8)
    engine.add_request("culprit", random_prompt(9, seed=99), culprit)
    for i, (prompt, params) in enumerate(others):
        engine.add_request(f"r{i}", prompt, params)
    done, failed = {}, {}
    for _ in range(50):
        done.update((o.request_id, o) for o in engine.step(fail_alone=True))
        failed.update(engine.failed)
        if not engine.has_unfinished_requests():
            break
    assert list(failed) == ["culprit"] and "fell over" in str(failed["culprit"])
    assert sorted(done) == ["r0", "r1", "r2"]
    for i, want in enumerate(wants):
        got = done[f"r{i}"].outputs
        assert [(c.text, c.token_ids) for c in got] == [(c.text, c.token_ids) for c in want.outputs]
    assert_all_blocks_free(llm)


def test_without_fail_alone_the_error_propagates(checkpoint, monkeypatch):
    """LLM.generate keeps raising: the caller asked, the caller hears."""
    path = checkpoint
    llm = make_llm(path)
    monkeypatch.setattr(sampling_module, "sample", failing_sample(sampling_module.sample))
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate("a", SamplingParams(seed=CULPRIT_SEED, max_tokens=4), use_tqdm=False)
    assert_all_blocks_free(llm)


# -- the server ------------------------------------------------------------------------
LIMITS = {
    "max_prompts": 4,
    "max_n": 8,
    "max_body_bytes": 64 * 1024,
    "read_timeout_s": 1.0,
}
GREEDY = {"temperature": 0, "max_tokens": 8}
PROMPT = "Hello, my name is"


@pytest.fixture(scope="module")
def served(checkpoint):
    """One in-process server for this module: (base URL, AsyncEngine, app), with small
    limits so that tests can reach them."""
    path = checkpoint
    yield from in_process_app(path, limits=ServerLimits(**LIMITS))


@pytest.fixture
def base_url(served):
    yield served[0]
    wait_idle(served[0])  # every test leaves every block free


@pytest.fixture(scope="module")
def oracle(checkpoint):
    path = checkpoint
    return make_llm(path, **{k: v for k, v in ENGINE.items() if k != "device"})


def greedy_text(oracle, prompt, **params) -> str:
    return (
        oracle.generate(prompt, SamplingParams(**{**GREEDY, **params}), use_tqdm=False)[0]
        .outputs[0]
        .text
    )


def completion(base_url: str, **body) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        json={"prompt": PROMPT, **GREEDY, **body},
        timeout=60,
    )


def sse_events(text: str) -> list:
    """A stream's ``data:`` payloads, JSON decoded except the final ``[DONE]``."""
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def assert_alive(base_url: str, oracle) -> None:
    """The engine serves a normal request right, and /health says 200."""
    assert httpx.get(f"{base_url}/health").status_code == 200
    response = completion(base_url)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == greedy_text(oracle, PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_top_p_that_rounds_to_zero_never_kills_the_engine(base_url, oracle, stream):
    """top_p=1e-300 is 0 in float32: answered (or refused) alone, the engine goes on."""
    response = completion(base_url, top_p=1e-300, temperature=1.0, stream=stream)
    if response.status_code == 200 and stream:
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        assert all(
            "error" not in e or set(e["error"]) == {"message", "type", "param", "code"}
            for e in events[:-1]
        )
    elif response.status_code != 200:
        assert response.status_code in (400, 500)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    wait_idle(base_url)
    assert_alive(base_url, oracle)


def test_a_failing_request_fails_alone_while_others_run(base_url, oracle, monkeypatch):
    """The culprit gets a 500 (or an error event and [DONE]); 6 others running beside it
    finish exactly as LLM.generate makes them; every block is free after."""
    prompts = [random_prompt(4 + i, seed=50 + i) for i in range(6)]
    wants = [greedy_text(oracle, {"prompt_token_ids": p}, ignore_eos=True) for p in prompts]
    monkeypatch.setattr(sampling_module, "sample", failing_sample(sampling_module.sample))
    culprit = {"temperature": 1.0, "seed": CULPRIT_SEED}
    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(completion, base_url, prompt=p, ignore_eos=True) for p in prompts]
        plain = pool.submit(completion, base_url, **culprit)
        streamed = pool.submit(completion, base_url, stream=True, **culprit)
        assert [f.result().json()["choices"][0]["text"] for f in others] == wants
        assert plain.result().status_code == 500
        error = plain.result().json()["error"]
        assert error["type"] == "server_error" and "fell over" in error["message"]
        *_, last, done = sse_events(streamed.result().text)
        assert "fell over" in last["error"]["message"] and done == "[DONE]"
    monkeypatch.undo()
    wait_idle(base_url)
    assert_alive(base_url, oracle)


# -- size, length and time -------------------------------------------------------------
def assert_openai_error(
    response: httpx.Response,
    status: int,
    param: str | None = None,
    code: str | None = None,
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_a_body_over_the_cap_gets_413(base_url, oracle):
    huge = {"prompt": "x" * (LIMITS["max_body_bytes"] + 1)}
    assert_openai_error(
        httpx.post(f"{base_url}/v1/completions", json=huge),
        413,
        code="request_too_large",
    )

    def chunks():  # no Content-Length: the cap holds as the body streams in
        for _ in range(LIMITS["max_body_bytes"] // 1024 + 2):
            yield b" " * 1024

    response = httpx.post(
        f"{base_url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 413)
    assert_alive(base_url, oracle)


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(served, monkeypatch):
    base_url, engine, _ = served
    tokenizer = engine.engine.tokenizer
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    longest = max(map(len, tokenizer.get_vocab()))
    too_long = "y" * (engine.engine.max_model_len * longest + 1)
    error = assert_openai_error(completion(base_url, prompt=too_long), 400, "prompt")
    assert "characters" in error["message"]
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": too_long}]},
    )
    assert_openai_error(chat, 400, "messages")
    assert calls == []


def test_health_answers_while_a_slow_prompt_is_tokenized(served, monkeypatch):
    """Tokenizing runs off the event loop: a tokenizer that takes 2 s stalls only its
    own request."""
    base_url, engine, _ = served
    tokenizer = engine.engine.tokenizer
    encode = tokenizer.encode

    def slow_encode(*args, **kwargs):
        time.sleep(2)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(completion, base_url)
        time.sleep(0.3)  # the slow one is being tokenized
        start = time.monotonic()
        assert httpx.get(f"{base_url}/health").status_code == 200
        assert time.monotonic() - start < 1.0
        assert not slow.done()
        assert slow.result().status_code == 200


def test_a_half_sent_body_times_out_with_408(base_url, oracle):
    port = int(base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            b'{"prompt":'
        )
        start = time.monotonic()
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert time.monotonic() - start < LIMITS["read_timeout_s"] + 5
    assert_alive(base_url, oracle)


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-"],
    ids=["nothing", "half a head"],
)
def test_a_silent_or_half_sent_head_is_closed(base_url, oracle, sent):
    """uvicorn times neither: the connection is closed after the read timeout."""
    port = int(base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        assert sock.recv(65536) == b""  # closed, not held
    assert time.monotonic() - start < LIMITS["read_timeout_s"] + 5
    assert_alive(base_url, oracle)


def test_a_keep_alive_connection_still_serves_many_requests(base_url):
    """The head timer starts again after each response, and lets a prompt one through."""
    with httpx.Client(base_url=base_url) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(LIMITS["read_timeout_s"] / 2)


# -- disconnects, text, auth -----------------------------------------------------------
def test_client_gone_before_a_non_streamed_answer_aborts_it(served, monkeypatch):
    """A client that hangs up while waiting for a whole answer aborts it: the engine
    stops early and frees every block, as it does for a stream."""
    base_url, engine, _ = served
    step = engine.engine.step

    def slow_step(*args, **kwargs):  # 120 tokens take over 2 s: time to hang up
        time.sleep(0.02)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine.engine, "step", slow_step)
    before = metrics(base_url)["minipaged:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base_url}/v1/completions",
            timeout=0.5,
            json={"prompt": "a", "max_tokens": 120, "ignore_eos": True},
        )
    after = wait_idle(base_url)
    assert after["minipaged:generation_tokens_total"] - before < 100


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", '{"prompt": "ab\\ud800c"}', "prompt"),
        ("completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("completions", '{"prompt": "a", "stop": ["\\ud83d"]}', "stop"),
        ("completions", '{"prompt": "a", "model": "\\ud800"}', "model"),
        ("completions", '{"prompt": "a", "\\ud800": 1}', None),  # pydantic's own 400
        (
            "chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_gets_400(base_url, oracle, path, body, param):
    response = httpx.post(
        f"{base_url}/v1/{path}",
        content=body.encode(),
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, param)
    assert_alive(base_url, oracle)


@pytest.fixture(scope="module")
def guarded(checkpoint):
    """A server with an API key and the loopback host names only."""
    path = checkpoint
    yield from in_process_app(
        path, api_key="sesame", allowed_hosts=LOCAL_HOSTS, limits=ServerLimits(**LIMITS)
    )


def test_a_non_ascii_authorization_header_gets_401(guarded):
    base_url, *_ = guarded
    for value in ("Bearer s\xe9same".encode("latin-1"), "Bearer ☃".encode()):
        response = httpx.get(f"{base_url}/v1/models", headers={"Authorization": value})
        assert_openai_error(response, 401, code="invalid_api_key")
        assert response.headers["WWW-Authenticate"] == "Bearer"


def test_the_api_key_is_checked_before_the_body_is_read(guarded):
    """Without the key, malformed or oversized bodies get 401, not 400 or 413: the
    server read none of it."""
    base_url, *_ = guarded
    url = f"{base_url}/v1/completions"
    for content in (b'{"prompt": ', b"x" * (LIMITS["max_body_bytes"] + 1)):
        response = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert_openai_error(response, 401, code="invalid_api_key")
    authorized = {"Authorization": "Bearer sesame"}
    response = httpx.post(url, json={"prompt": "a", "max_tokens": 2}, headers=authorized)
    assert response.status_code == 200, response.text


def test_hosts_outside_the_allowed_list_get_400_and_no_redirect(guarded):
    """DNS rebinding: a page at evil.example resolving to 127.0.0.1 sends Host:
    evil.example.  It is refused, and a trailing slash never redirects to it."""
    base_url, *_ = guarded
    port = base_url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        response = httpx.get(f"{base_url}/health", headers={"Host": host})
        assert_openai_error(response, 400, code="invalid_host")
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert httpx.get(f"{base_url}/health", headers={"Host": host}).status_code == 200
    response = httpx.get(f"{base_url}/v1/models/", headers={"Authorization": "Bearer sesame"})
    assert response.status_code == 404 and "location" not in response.headers


def test_default_allowed_hosts():
    assert default_allowed_hosts("127.0.0.1") == default_allowed_hosts("::1") == LOCAL_HOSTS
    assert default_allowed_hosts("0.0.0.0") is None  # the operator chose to be reachable
    assert [host_name(h) for h in ("a.b:80", "[::1]:8000", "::1", "localhost")] == [
        "a.b",
        "::1",
        "::1",
        "localhost",
    ]


# -- caps and OpenAI compatibility -----------------------------------------------------
CAPPED = {  # name: (path, body, param)
    "too many prompts": ("completions", {"prompt": ["a"] * 5}, "prompt"),
    "n over the cap": ("completions", {"prompt": "a", "n": 9}, "n"),
    "logprobs over 20": ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    "top_logprobs over 20": (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "logprobs": True,
            "top_logprobs": 21,
        },
        "top_logprobs",
    ),
    "top_logprobs without logprobs": (
        "chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        "top_logprobs",
    ),
}


@pytest.mark.parametrize("name", CAPPED)
def test_caps_get_clear_400s(base_url, name):
    path, body, param = CAPPED[name]
    error = assert_openai_error(httpx.post(f"{base_url}/v1/{path}", json=body), 400, param)
    assert param in error["message"]


def test_at_the_caps_is_fine(base_url):
    response = completion(base_url, prompt=["a"] * 4, n=2, logprobs=20, max_tokens=2)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 8


def test_max_tokens_null_runs_to_the_context_length(base_url, oracle, served):
    max_model_len = served[1].engine.max_model_len
    prompt = random_prompt(10, seed=5)
    response = completion(base_url, prompt=prompt, max_tokens=None, ignore_eos=True)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    want = greedy_text(
        oracle,
        {"prompt_token_ids": prompt},
        ignore_eos=True,
        max_tokens=max_model_len - 10,
    )
    assert (choice["text"], choice["finish_reason"]) == (want, "length")
    assert response.json()["usage"]["completion_tokens"] == max_model_len - 10


def test_the_openapi_schema_documents_the_400_the_server_sends(base_url):
    schema = httpx.get(f"{base_url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "401", "413"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse"
        )
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "a", "n": "two"})
    assert_openai_error(response, 400, "n")


def test_405_names_the_allowed_methods(base_url):
    response = httpx.get(f"{base_url}/v1/completions")
    assert_openai_error(response, 405)
    assert response.headers["Allow"] == "POST"


def test_the_model_id_defaults_to_the_checkpoint_name(tmp_path):
    checkpoint = tmp_path / "models" / "tiny-llama"
    checkpoint.mkdir(parents=True)
    assert default_model_name(str(checkpoint)) == "tiny-llama"
    assert default_model_name(f"{checkpoint}/") == "tiny-llama"
    (tmp_path / "link").symlink_to(checkpoint)
    assert default_model_name(str(tmp_path / "link")) == "link"  # the name given
    hub_id = "Qwen/Qwen2.5-0.5B"  # not a directory here: kept as given
    assert default_model_name(hub_id) == hub_id


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_n", 0),
        ("max_prompts", 1.5),
        ("read_timeout_s", -1),
        ("shutdown_grace_s", "5"),
    ],
)
def test_server_limits_name_a_bad_value(name, value):
    with pytest.raises(ValueError, match=name):
        ServerLimits(**{name: value})


# -- the process: startup, a dead engine, shutdown --------------------------------------
def patched_serve(path, patch: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """``minipaged serve`` in a process of its own after running ``patch`` (Python
    source) in it; stderr is captured.  Returns the process and its base URL, once
    healthy."""
    port = free_port()
    script = f"import sys\n{patch}\nfrom minipaged.cli import main\nsys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            script,
            "serve",
            str(path),
            "--port",
            str(port),
            *FLAGS,
            *flags,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, lambda: process.poll() is None)
    except AssertionError:
        process.kill()
        raise AssertionError(process.communicate()[1]) from None
    return process, base_url


def stop(process: subprocess.Popen, sig=None) -> tuple[int, str]:
    """Signal ``process`` (if ``sig``) and return its exit status and stderr."""
    if sig is not None:
        os.kill(process.pid, sig)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the server did not stop: {process.communicate()[1]}")
    return process.returncode, stderr


BROKEN_STEP = """
from minipaged.engine.llm_engine import LLMEngine
def step(self, fail_alone=False):
    raise RuntimeError("a kernel fell over")
LLMEngine.step = step
"""


def test_a_dead_engine_loop_exits_the_server_nonzero_with_its_traceback(checkpoint):
    """If the loop itself dies, the waiting request gets a 500, the traceback is
    logged and the process exits 1 for its supervisor; its startup block said what
    was served where, under the checkpoint's own name."""
    path = checkpoint
    process, base_url = patched_serve(path, BROKEN_STEP)
    try:
        (card,) = httpx.get(f"{base_url}/v1/models").json()["data"]
        assert card["id"] == path.name
        response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "a"}, timeout=30)
        assert_openai_error(response, 500)
        assert "a kernel fell over" in response.json()["error"]["message"]
    finally:
        status, stderr = stop(process)
    assert status == 1, stderr
    assert "Traceback" in stderr and "RuntimeError: a kernel fell over" in stderr
    port = base_url.rsplit(":", 1)[1]
    for line in (
        f"model           {path} (served as '{path.name}')",
        "device          cpu",
        "KV cache        ",
        "max_model_len   128 tokens",
        "API key         none",
        "allowed hosts   localhost, 127.0.0.1, ::1",
        f"listening on    http://127.0.0.1:{port}",
    ):
        assert line in stderr


SLOW_STEP = """
import time
from minipaged.engine.llm_engine import LLMEngine
step = LLMEngine.step
def slow_step(self, fail_alone=False):
    time.sleep(0.02)  # a slower model: requests are still running at the signal
    return step(self, fail_alone)
LLMEngine.step = slow_step
"""


def test_shutdown_ends_what_runs_past_the_grace_with_an_error(checkpoint):
    """SIGINT with no grace: a stream gets an error event then [DONE], a waiting
    answer a 503 in OpenAI's shape; the process exits cleanly, with no traceback."""
    path = checkpoint
    process, base_url = patched_serve(path, SLOW_STEP, "--shutdown-grace", "0")
    body = {"prompt": "a", "max_tokens": 120, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(httpx.post, f"{base_url}/v1/completions", json=body, timeout=60)
            with httpx.stream(
                "POST",
                f"{base_url}/v1/completions",
                timeout=60,
                json={**body, "stream": True},
            ) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line)
                while metrics(base_url)["minipaged:num_requests_running"] < 2:
                    time.sleep(0.02)
                os.kill(process.pid, signal.SIGINT)
                events = sse_events("\n".join([first, *lines]))
            assert_openai_error(waiting.result(), 503)
    finally:
        status, stderr = stop(process)
    *tokens, error, done = events
    assert "shut down" in error["error"]["message"] and done == "[DONE]"
    assert all("choices" in t for t in tokens) and len(tokens) < 120
    assert status == 0 and "Traceback" not in stderr, stderr


def test_draining_refuses_new_work_and_lets_running_requests_finish(checkpoint):
    """While draining (within the grace period): new /v1 requests and /health get 503;
    a stream already running ends as it would have, with [DONE]."""
    path = checkpoint
    for base_url, _, app in in_process_app(path, limits=ServerLimits(shutdown_grace_s=30)):
        with httpx.stream(
            "POST",
            f"{base_url}/v1/completions",
            timeout=60,
            json={"prompt": "a", "max_tokens": 20, "ignore_eos": True, "stream": True},
        ) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            app.state.draining.start()
            assert_openai_error(completion(base_url), 503, code="server_shutting_down")
            assert httpx.get(f"{base_url}/health").status_code == 503
            events = sse_events("\n".join([first, *lines]))
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"]) for e in events[:-1]) == 20


# -- bursts and chaos ------------------------------------------------------------------
def test_a_burst_of_bad_requests_leaves_the_server_whole(base_url, oracle):
    """120 requests, 24 at a time: malformed JSON, huge bodies, bad sampling values,
    lone surrogates, unknown models, and clients leaving mid-stream, mid-wait and
    mid-body.  Each invalid one gets a 4xx; after, no block is held, and a normal
    request gets LLM.generate's answer."""
    bad = [k for k in chaos.KINDS if k not in chaos.GOOD]
    report = chaos.run(
        base_url, 120, 24, seed=1, kinds=bad, huge_bytes=LIMITS["max_body_bytes"] + 1
    )
    assert report.unexpected == [] and report.blocks_leaked == 0 and report.alive
    assert {o.kind for o in report.outcomes} == set(bad)
    assert all(400 <= o.status < 500 for o in report.outcomes if o.kind not in chaos.LEAVING)
    assert_alive(base_url, oracle)


def test_bench_chaos_reports_a_whole_server(base_url, capsys, tmp_path):
    out = tmp_path / "chaos.json"
    assert (
        run_main(
            [
                "bench",
                "chaos",
                "--base-url",
                base_url,
                "--num-requests",
                "80",
                "--concurrency",
                "16",
                "--huge-bytes",
                str(LIMITS["max_body_bytes"] + 1),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "unexpected      0" in printed and "blocks leaked   0" in printed
    report = json.loads(out.read_text())
    good = sum(n for kind in chaos.GOOD for n in report["statuses"][kind].values())
    assert report["served"] == good > 0 and report["requests"] == 80
    assert 0 < report["p50_ms"] <= report["p99_ms"]


def test_chaos_flags_what_breaks_the_rules():
    """The verdict is not vacuous: a 5xx, a leak or a dead engine each fail the run."""
    fine = [
        chaos.Outcome("completion", 200, 0.1),
        chaos.Outcome("huge_body", 413, 0.01),
    ]
    assert not chaos.failed(chaos.ChaosReport(fine, 1.0, 0, True))
    broken = [
        *fine,
        chaos.Outcome("lone_surrogate", 500, 0.01, "500 for an invalid request"),
    ]
    for report in (
        chaos.ChaosReport(broken, 1.0, 0, True),
        chaos.ChaosReport(fine, 1.0, 3, True),
        chaos.ChaosReport(fine, 1.0, 0, False),
    ):
        assert chaos.failed(report)
    assert "unexpected      1" in chaos.format_report(chaos.ChaosReport(broken, 1.0, 0, True))
    with pytest.raises(ValueError, match="kinds"):
        chaos.run("http://127.0.0.1:1", kinds=["nonsense"])


def test_after_end_all_requests_still_on_their_way_are_turned_back(checkpoint):
    """A request that passed the checks just before a shutdown ended everything gets
    the same error, instead of running with no one left to stop it."""
    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.server.async_engine import AsyncEngine, ServerClosingError

    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), **ENGINE)))

    async def late_request():
        engine.end_all("the server shut down")
        await asyncio.sleep(0.2)  # the engine thread has ended everything there was
        outputs = await engine.generate(
            [("late", [1, 2, 3], SamplingParams(max_tokens=4), None, None)]
        )
        with pytest.raises(ServerClosingError, match="shut down"):
            async for _ in outputs:
                pass

    try:
        asyncio.run(late_request())
    finally:
        engine.shutdown()
    assert not engine.engine.has_unfinished_requests() and not engine.engine.kv.tables

"""Data-parallel replicas behind one server (``minipaged serve --data-parallel-size 2``).

One ``minipaged serve`` process with two engine replicas serves this whole module, in
order: a burst of the ``bench serve`` workload (both engines take work), greedy answers
(``LLM.generate`` on the same checkpoint, one engine, is the oracle), errors and a
client leaving mid-stream through the router, then one engine frozen and killed (only
its requests fail, in OpenAI's shape, and ``/metrics`` says which), then the other (the
server exits 1, leaving no process behind).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")  # the server extra; the GPU machine has none

import httpx  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cli_helpers import run_main  # noqa: E402
from engine_helpers import make_llm  # noqa: E402
from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.bench import serve as bench_serve  # noqa: E402
from server_helpers import ENGINE, FLAGS, MODEL, free_port, wait_healthy  # noqa: E402

GREEDY_PROMPTS = [[1 + i, 7, 3 * i % 50, 11, 2] for i in range(8)]
MAX_TOKENS = 10


class DPServer:
    """``minipaged serve --data-parallel-size 2``, its log (read on a thread, so the
    pipe never fills), its engines' pids by index, and every process under it."""

    def __init__(self, path) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "minipaged", "serve", str(path), "--port", str(port)]
            + ["--served-model-name", MODEL, "--data-parallel-size", "2", *FLAGS],
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True).start()
        wait_healthy(self.base_url, lambda: self.process.poll() is None)
        pids = re.search(r"KV pool \(pids (\d+), (\d+)\)", self.log())
        self.engine_pids = [int(pids[1]), int(pids[2])]
        self.descendants = psutil.Process(self.process.pid).children(recursive=True)

    def log(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="module")
def path(tiny):
    return tiny("llama")[0]


@pytest.fixture(scope="module")
def server(path):
    dp = DPServer(path)
    yield dp
    if dp.process.poll() is None:
        dp.process.send_signal(signal.SIGINT)
        dp.process.wait(timeout=60)
    psutil.wait_procs(dp.descendants, timeout=30)


@pytest.fixture(scope="module")
def oracle(path):
    return make_llm(path, **{k: v for k, v in ENGINE.items() if k != "device"})


def engine_metrics(base_url: str) -> dict[tuple[str, str], float]:
    """``/metrics`` by (sample name, engine index)."""
    text = httpx.get(f"{base_url}/metrics").text
    return {
        (s.name, s.labels.get("engine")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_engines_idle(base_url: str, engines=("0", "1"), timeout_s: float = 30) -> dict:
    """Until each of ``engines`` runs and holds nothing (its published counters lag a
    step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = engine_metrics(base_url)
        idle = all(
            now[(name, e)] == 0
            for e in engines
            for name in (
                "minipaged:num_requests_running",
                "minipaged:num_requests_waiting",
                "minipaged:kv_blocks_used",
            )
        )
        if idle or time.monotonic() > deadline:
            assert idle, now
            return now
        time.sleep(0.05)


def assert_openai_error(body: dict, engine: int) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error"
    assert f"data-parallel engine {engine} " in error["message"], error


async def complete(base_url: str, prompts, max_tokens=MAX_TOKENS, **extra) -> list:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        return await asyncio.gather(
            *[
                http.post(
                    "/v1/completions",
                    json={"prompt": p, "max_tokens": max_tokens, "temperature": 0, **extra},
                )
                for p in prompts
            ]
        )


def greedy(oracle: LLM, prompts, max_tokens=MAX_TOKENS, ignore_eos=False) -> list[str]:
    outputs = oracle.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos),
        use_tqdm=False,
    )
    return [o.outputs[0].text for o in outputs]


# -- serving --------------------------------------------------------------------------
def test_this_module_runs_on_one_worker(request):
    """Under ``make test`` the next tests go on from each other (one engine killed, then
    the other) on one server, so pytest-xdist must give them all to one worker; it does
    so for an id ending in the module's group (tests/conftest.py adds the mark)."""
    if not request.config.getoption("loadgroup", False):
        pytest.skip("not under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@tests/test_data_parallel.py"), (
        "pytest-xdist did not group this module's tests: a pytest its version does not "
        "know (pyproject.toml pins one that works)"
    )


def test_a_burst_of_the_bench_serve_workload_is_answered_by_both_engines(server):
    before = engine_metrics(server.base_url)
    summary, records = bench_serve.run(
        server.base_url, num_requests=12, request_rate=math.inf, progress=False, max_output_len=8
    )
    assert summary["completed"] == 12, [r.error for r in records]
    after = wait_engines_idle(server.base_url)
    added = {
        e: after[("minipaged:prompt_tokens_total", e)]
        - before[("minipaged:prompt_tokens_total", e)]
        for e in ("0", "1")
    }
    assert all(added.values()), added  # both engines took work...
    # ...and only that: the workload, and the bench's untimed test request (one token,
    # the first prompt reversed).
    assert sum(added.values()) == sum(r.prompt_len for r in records) + records[0].prompt_len
    generated = sum(
        after[("minipaged:generation_tokens_total", e)]
        - before[("minipaged:generation_tokens_total", e)]
        for e in ("0", "1")
    )
    assert generated == sum(r.output_tokens for r in records) + 1
    assert [r.output_tokens for r in records] == [r.output_len for r in records]


def test_greedy_answers_equal_one_engines(server, oracle):
    responses = asyncio.run(complete(server.base_url, GREEDY_PROMPTS))
    assert [r.status_code for r in responses] == [200] * len(GREEDY_PROMPTS)
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts == greedy(oracle, GREEDY_PROMPTS)


def test_errors_have_openais_shape_and_a_4xx_through_the_router(server):
    for stream in (False, True):
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": [1, 2, 10**6], "max_tokens": 2, "stream": stream},
        )
        assert response.status_code == 400  # the replica refused it before any event
        error = response.json()["error"]
        assert "prompt_token_ids must be ints" in error["message"]
        assert error["type"] == "invalid_request_error"


def test_a_client_leaving_mid_stream_aborts_its_engine_request(server):
    before = engine_metrics(server.base_url)
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as response:
        for _, _ in zip(range(3), response.iter_lines()):
            pass
    deadline = time.monotonic() + 10
    while True:  # a replica publishes its counters a step late: give them time to arrive
        after = wait_engines_idle(server.base_url)
        generated = sum(
            after[("minipaged:generation_tokens_total", e)]
            - before[("minipaged:generation_tokens_total", e)]
            for e in ("0", "1")
        )
        if generated > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 0 < generated < 100  # it stopped early, on the engine it ran on


def test_a_bad_data_parallel_size_is_a_clear_error(path, capsys):
    assert run_main(["serve", str(path), "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size/-dp: must be an int >= 1, got 0" in capsys.readouterr().err
    assert run_main(["bench", "throughput", "--data-parallel-size", "x"]) == 2
    assert "--data-parallel-size/-dp: must be an int >= 1, got 'x'" in capsys.readouterr().err
    from minipaged.server.app import serve

    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        serve(str(path), data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size > 1 cannot run with enable_lora"):
        serve(str(path), data_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="data_parallel_size=2 is not supported"):
        LLM(str(path), data_parallel_size=2)


def test_the_router_sends_a_prefix_where_it_went_unless_that_replica_is_too_busy():
    """Worked by hand, block size 2: least loaded first (lowest index on a tie); a
    prompt sharing 2 blocks with what replica 1 was sent goes there although replica 0
    is less busy, until replica 1 is more than PREFIX_SLACK requests busier."""
    from types import SimpleNamespace

    from minipaged.server.data_parallel import PREFIX_SLACK, Replica, Router

    replicas = [Replica(i, SimpleNamespace(pid=i), None, None) for i in range(2)]
    router = Router(block_size=2, prefix_aware=True, capacity_blocks=8)
    assert router.block_hashes([1, 2, 3, 4, 5]) == router.block_hashes([1, 2, 3, 4])
    assert router.block_hashes([1, 2, 3, 4])[1] != router.block_hashes([9, 9, 3, 4])[1]
    replicas[0].load = 1
    assert router.pick(replicas, [[1, 2, 3, 4, 5]]) is replicas[1]  # least loaded
    replicas[1].load = 1 + PREFIX_SLACK
    assert router.pick(replicas, [[1, 2, 3, 4, 9]]) is replicas[1]  # its prefix
    assert router.pick(replicas, [[7, 7, 3, 4, 9]]) is replicas[0]  # no shared prefix
    replicas[1].load = 2 + PREFIX_SLACK
    assert router.pick(replicas, [[1, 2, 3, 4, 9]]) is replicas[0]  # too busy now
    plain = Router(block_size=2, prefix_aware=False, capacity_blocks=8)
    assert plain.pick(replicas, [[1, 2, 3, 4, 9]]) is replicas[0]
    replicas[0].alive, replicas[1].load = False, 100
    assert plain.pick(replicas, [[1]]) is replicas[1]  # the dead get nothing


# -- faults ---------------------------------------------------------------------------
def test_a_dead_engine_fails_only_its_own_requests(server, oracle):
    """A stream starts on engine 0 (both idle: the lower index), which is then frozen; a
    long request goes to engine 1, and while it runs, another to engine 0 (a tie, which
    ``minipaged:router_load`` shows).
    Engine 0 killed: its two requests fail in OpenAI's shape (the stream with an error
    event), engine 1's answer is whole, and the server goes on with engine 1."""
    engines = [psutil.Process(pid) for pid in server.engine_pids]
    asyncio.run(_requests_around_a_death(server, oracle, *engines))
    now = engine_metrics(server.base_url)
    assert now[("minipaged:engine_alive", "0")] == 0 and now[("minipaged:engine_alive", "1")] == 1
    assert ("minipaged:num_requests_running", "0") not in now  # a dead engine has no gauges
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    responses = asyncio.run(complete(server.base_url, GREEDY_PROMPTS[:3]))
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts == greedy(oracle, GREEDY_PROMPTS[:3])
    assert re.search(r"ERROR:.*data-parallel engine 0 \(pid \d+\) died", server.log())


async def _requests_around_a_death(
    server, oracle, engine_0: psutil.Process, engine_1: psutil.Process
) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        started = asyncio.Event()
        stream = asyncio.ensure_future(_stream_events(http, [3, 4, 5], started))
        await started.wait()
        engine_0.suspend()
        try:
            long_prompt = [9, 8, 7]
            long = asyncio.ensure_future(
                http.post(
                    "/v1/completions",
                    json={
                        "prompt": long_prompt,
                        "max_tokens": 100,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
            )
            await _until(server, ("minipaged:num_requests_running", "1"), 1, "long ran on 1")
            # engine 1 paused too, so the long request is still there to tie with when
            # the next is routed, however slow the machine (else: an idle engine 1)
            engine_1.suspend()
            on_engine_0 = asyncio.ensure_future(
                http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
            )
            await _until(server, ("minipaged:router_load", "0"), 2, "routed to engine 0")
            assert engine_metrics(server.base_url)[("minipaged:router_load", "1")] == 1
            engine_1.resume()
            answer = await long
            assert (
                answer.json()["choices"][0]["text"]
                == greedy(oracle, [long_prompt], 100, ignore_eos=True)[0]
            )
            assert not stream.done() and not on_engine_0.done()  # engine 0 is frozen
        finally:
            engine_0.kill()
        failed = await on_engine_0
        assert failed.status_code == 500
        assert_openai_error(failed.json(), 0)
        events = await stream
        assert events[-1] == "[DONE]"
        assert_openai_error(json.loads(events[-2]), 0)


async def _until(server, sample: tuple[str, str], value: float, what: str) -> None:
    """Until ``/metrics`` shows ``sample`` at ``value`` or more (30 s at most)."""
    deadline = time.monotonic() + 30
    while engine_metrics(server.base_url)[sample] < value:
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


async def _stream_events(http: httpx.AsyncClient, prompt: list[int], started) -> list[str]:
    """A long stream's events; ``started`` is set at the first."""
    events = []
    async with http.stream(
        "POST",
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 100, "stream": True, "ignore_eos": True},
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()
    return events


def test_with_every_engine_dead_the_server_exits_1_and_leaves_no_process(server):
    os.kill(server.engine_pids[1], signal.SIGKILL)
    try:
        assert server.process.wait(timeout=60) == 1
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server outlived its last engine; its log:\n{server.log()}")
    gone, alive = psutil.wait_procs(server.descendants, timeout=30)
    assert not alive, alive
    assert "every data-parallel engine died" in server.log()

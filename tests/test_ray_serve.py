"""Replicas under Ray Serve (minipaged.integrations.ray_serve): the front door's relay
over one replica's app in this process, then on a local Ray cluster.

One cluster (head only, loopback) for the module: Ray starts slowly on a small machine,
and where it cannot start at all (its agents missing their start-up deadline on an
overloaded machine) the cluster tests skip, printing Ray's error.
The oracle is ``minipaged serve`` (the app in this process, `server_helpers.in_process`)
on the same checkpoint and requests, itself checked against ``LLM.generate`` in
test_server.py: each replica must answer exactly what one server answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from functools import partial

import pytest

pytest.importorskip("fastapi")  # the server extra
ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

import httpx  # noqa: E402
import openai  # noqa: E402
from ray import serve  # noqa: E402
from ray.exceptions import RayActorError  # noqa: E402

from engine_helpers import make_llm  # noqa: E402
from minipaged import SamplingParams  # noqa: E402
from minipaged.bench.serve import make_requests  # noqa: E402
from minipaged.integrations.ray_serve import (  # noqa: E402
    REPLICA_HEADER,
    build_openai_app,
    relay,
    run_asgi,
)
from server_helpers import (  # noqa: E402
    ENGINE,
    MAX_MODEL_LEN,
    MODEL,
    free_port,
    in_process,
    wait_healthy,
)

REPLICA = REPLICA_HEADER.decode()
APP = "minipaged"
START_TIMEOUT_S = 180
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
ORACLE = {k: v for k, v in ENGINE.items() if k != "device"}  # make_llm sets the device


# -- the front door over one replica, in this process ----------------------------------
@pytest.fixture(scope="module")
def replica(tiny):
    """One replica's app (the server's) over its engine, and the offline LLM beside it."""
    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.server.app import build_app
    from minipaged.server.async_engine import AsyncEngine

    path, _ = tiny("llama")
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), **ENGINE)))
    yield build_app(engine, MODEL), engine, make_llm(path, **ORACLE)
    engine.shutdown()


def through_front_door(forward, body: dict) -> httpx.Response:
    """POST ``body`` to /v1/completions through `relay` over ``forward``."""

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(partial(relay, forward))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.post("/v1/completions", json=body)

    return asyncio.run(post())


def events(response: httpx.Response) -> list[dict | str]:
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


@pytest.mark.parametrize("stream", [False, True])
def test_the_front_door_relays_a_replica_answer(replica, stream):
    app, _, llm = replica
    body = {"model": MODEL, "prompt": "Hello, my name is", "stream": stream, **GREEDY}
    response = through_front_door(lambda scope, b: run_asgi(app, scope, b, b"r0"), body)
    assert response.status_code == 200 and response.headers[REPLICA] == "r0"
    params = SamplingParams(**GREEDY)
    (want,) = llm.generate(body["prompt"], params, use_tqdm=False)[0].outputs
    if stream:
        *chunks, done = events(response)
        assert done == "[DONE]" and "".join(c["choices"][0]["text"] for c in chunks) == want.text
    else:
        assert response.json()["choices"][0]["text"] == want.text


def test_a_replica_dead_before_answering_is_a_503_in_openai_shape():
    async def dead(scope, body):
        raise RayActorError()
        yield  # an async generator, as a handle's stream is

    response = through_front_door(dead, {"model": MODEL, "prompt": "a"})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "server_error" and "replica" in error["message"]


def test_a_replica_dying_mid_stream_ends_it_with_an_error_event_and_frees_its_blocks(replica):
    app, engine, _ = replica

    async def dies_after_a_token(scope, body):
        async with aclosing(run_asgi(app, scope, body, b"r0")) as messages:
            async for message in messages:
                yield message
                if message["type"] == "http.response.body" and message["body"]:
                    raise RayActorError()

    body = {"model": MODEL, "prompt": "a", "stream": True, **GREEDY, "max_tokens": 100}
    *chunks, error, done = events(through_front_door(dies_after_a_token, body))
    assert chunks and "replica" in error["error"]["message"] and done == "[DONE]"
    deadline = time.monotonic() + 20  # the abort lands between steps
    while engine.stats["num_free_gpu_blocks"] < engine.stats["num_gpu_blocks"]:
        assert time.monotonic() < deadline, engine.stats
        time.sleep(0.05)
    assert engine.num_requests == 0


# -- on a Ray cluster ------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(tiny):
    """Two replicas of the tiny model behind Ray Serve's proxy on a free loopback port."""
    path, _ = tiny("llama")
    # Ray's waits for a raylet and its agents to start are short on a busy small machine.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "300000")
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}},
        )
    except Exception as error:  # Ray raises a bare Exception when its node times out
        ray.shutdown()  # the processes it did start
        pytest.skip(f"Ray could not start a local cluster here: {error}")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(
            build_openai_app(path, num_replicas=2, served_model_name=MODEL, **ENGINE), name=APP
        )
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def one_server(tiny):
    path, _ = tiny("llama")
    for url, _ in in_process(path):
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def burst(url: str, requests, workers: int = 16) -> list[tuple[str, str]]:
    """Every request of ``requests`` (bench serve's) at once, greedy, through the
    OpenAI client: (replica, text) each."""

    def one(request) -> tuple[str, str]:
        with client(url) as c:
            raw = c.completions.with_raw_response.create(
                model=MODEL,
                prompt=request.prompt_token_ids,
                max_tokens=request.output_len,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        return raw.headers.get(REPLICA, ""), raw.parse().choices[0].text

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, requests))


def workload(num_requests: int, seed: int = 0):
    return make_requests("sharegpt", num_requests, MAX_MODEL_LEN, seed, max_output_len=8)


def test_a_burst_is_spread_over_both_replicas_and_answered_as_one_server_does(base_url, one_server):
    requests = workload(24)
    answers = burst(base_url, requests)
    expected = burst(one_server, requests)
    assert [text for _, text in answers] == [text for _, text in expected]
    assert len({replica for replica, _ in answers}) == 2  # both replicas took work


def test_streams_and_each_replica_metrics_show_every_block_free_after_a_hang_up(base_url):
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": [1, 2, 3],
            "max_tokens": 100,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # a token came
    # The hang-up aborted the request on its replica: every block of every replica free.
    for replica, now in replica_metrics(base_url).items():
        assert now["minipaged:kv_blocks_used"] == 0, (replica, now)
        assert now["minipaged:num_requests_running"] == 0, (replica, now)


def replica_metrics(url: str, replicas: int = 2, timeout_s: float = 60) -> dict[str, dict]:
    """Each replica's ``/metrics`` once idle (the router picks which answers a scrape;
    the header says whose it is)."""
    from prometheus_client.parser import text_string_to_metric_families

    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < replicas or any(m["minipaged:kv_blocks_used"] for m in seen.values()):
        assert time.monotonic() < deadline, seen
        response = httpx.get(f"{url}/metrics")
        seen[response.headers[REPLICA]] = {
            s.name: s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples
        }
        time.sleep(0.05)
    return seen


def replica_pid(replica: str) -> int:
    """The process id of the replica named ``replica`` (its header), asked of its actor."""
    (name,) = [n for n in ray.util.list_named_actors(all_namespaces=True) if replica in n["name"]]
    actor = ray.get_actor(name["name"], namespace=name["namespace"])
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def test_a_killed_replica_fails_only_its_requests_and_ray_restarts_it(base_url):
    prompts = [[1 + i, 2, 3, 4] for i in range(12)]
    replicas: dict[int, str] = {}
    first_token = threading.Event()

    def stream(i: int) -> str | None:
        """The error the client saw, or None if the stream ran to its end."""
        with client(base_url) as c:
            try:
                raw = c.completions.with_raw_response.create(
                    model=MODEL,
                    prompt=prompts[i],
                    max_tokens=100,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            except openai.APIStatusError as error:  # a replica that died before answering
                return str(error)
            replicas[i] = raw.headers[REPLICA]
            try:
                chunks = 0
                for _ in raw.parse():
                    chunks += 1
                    first_token.set()
            except openai.APIError as error:
                return str(error)
            return None if chunks == 100 else f"{chunks} chunks"

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = [pool.submit(stream, i) for i in range(len(prompts))]
        assert first_token.wait(60)
        victim = replicas[min(replicas)]
        os.kill(replica_pid(victim), signal.SIGKILL)
        errors = [r.result() for r in results]
    failed = [i for i, e in enumerate(errors) if e is not None]
    assert failed, "the kill came too late to fail anything"
    # Only the victim's requests fail (or one sent to it as it died, before it answered),
    # each in OpenAI's error shape; the other replica's are served to the end.
    assert all(replicas.get(i) in (victim, None) for i in failed), (replicas, errors)
    assert all("replica" in errors[i] for i in failed), errors
    assert any(replicas.get(i) not in (victim, None) for i in range(len(prompts)))
    # Ray Serve starts a new replica; requests keep succeeding and reach both again.
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        answers = burst(base_url, workload(8, seed=1))
        serving = {replica for replica, _ in answers}
        if len(serving) == 2 and victim not in serving:
            break
        assert time.monotonic() < deadline, serving
        time.sleep(1)


def test_langchain_chat_and_completions_through_ray_serve(base_url, one_server):
    from langchain_openai import ChatOpenAI, OpenAI

    def models(url: str):
        kwargs = dict(
            base_url=f"{url}/v1",
            api_key="unused",
            model=MODEL,
            temperature=0,
            max_tokens=8,
            max_retries=0,
        )
        return ChatOpenAI(**kwargs), OpenAI(**kwargs)

    (chat, llm), (chat_one, llm_one) = models(base_url), models(one_server)
    question = [("user", "Hello there")]
    assert chat.invoke(question).content == chat_one.invoke(question).content
    assert "".join(c.content for c in chat.stream(question)) == chat_one.invoke(question).content
    prompts = ["Once upon a time", "The capital of"]
    assert llm.batch(prompts) == llm_one.batch(prompts)


# -- the command and its settings ------------------------------------------------------
def test_serve_ray_parses_replicas_autoscaling_and_resources():
    from minipaged.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve-ray",
            "smollm2",
            "--num-replicas",
            "2",
            "--address",
            "auto",
            "--ray-actor-options",
            '{"num_cpus": 2}',
            "--autoscaling-config",
            '{"min_replicas": 1, "max_replicas": 4}',
        ]
    )
    assert (args.num_replicas, args.address) == (2, "auto")
    assert args.ray_actor_options == {"num_cpus": 2}
    assert args.autoscaling_config == {"min_replicas": 1, "max_replicas": 4}


@pytest.mark.parametrize(
    "settings",
    [{"num_replicas": 0}, {"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}}],
)
def test_build_openai_app_refuses_bad_replica_settings(settings):
    with pytest.raises(ValueError, match="num_replicas"):
        build_openai_app("unused", **settings)

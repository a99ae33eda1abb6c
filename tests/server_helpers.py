"""Servers for the server tests: the app run by uvicorn in this process, and a real
``minipaged serve`` process started and stopped by its pid.  Both serve the same tiny
checkpoint with the same flags, so every test can run against each, and LLM.generate on
that checkpoint (`make_llm` with `ENGINE`) is the oracle for what they answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minipaged.distributed.parallel_state import free_port

MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
ENGINE = dict(device="cpu", swap_space=0.01, max_model_len=MAX_MODEL_LEN)
FLAGS = ["--device", "cpu", "--swap-space", "0.01", "--max-model-len", str(MAX_MODEL_LEN)]
START_TIMEOUT_S = 120


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    kind: str


def wait_healthy(base_url: str, alive=lambda: True) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the server at {base_url} did not come up")


def in_process(path, api_key: str | None = None):
    """The app, served by uvicorn on a thread of this process; yields its base URL and
    its `AsyncEngine`."""
    for base_url, engine, _ in in_process_app(path, api_key):
        yield base_url, engine


def in_process_app(
    path, api_key: str | None = None, engine_kwargs=None, host: str = "127.0.0.1", **app_kwargs
):
    """As `in_process`, with `build_app`'s other arguments (``limits``,
    ``allowed_hosts``, ``lora_modules``), more engine settings and the address to
    listen on; yields the base URL, the `AsyncEngine` and the app."""
    import uvicorn

    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.server.app import ServerLimits, build_app, uvicorn_config
    from minipaged.server.async_engine import AsyncEngine

    engine = AsyncEngine(
        LLMEngine(EngineConfig(model=str(path), **{**ENGINE, **(engine_kwargs or {})}))
    )
    port = free_port()
    app = build_app(engine, MODEL, api_key, **app_kwargs)
    limits = app_kwargs.get("limits") or ServerLimits()
    server = uvicorn.Server(uvicorn_config(app, host, port, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://{host}:{port}"
    wait_healthy(base_url, thread.is_alive)
    try:
        yield base_url, engine, app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def subprocess_server(path, name: str = MODEL, flags: list[str] = FLAGS):
    """``python -m minipaged serve`` on a free port, as ``name`` with ``flags``; stopped
    by its pid (SIGINT, as a user's Ctrl-C), killed if it will not stop."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minipaged",
            "serve",
            str(path),
            "--port",
            str(port),
            "--served-model-name",
            name,
            *flags,
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, lambda: process.poll() is None)
        yield base_url
    finally:
        os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail("minipaged serve did not stop on SIGINT")


def metrics(base_url: str) -> dict[str, float]:
    """``/metrics``, parsed by prometheus_client's own parser: sample name -> value."""
    text = httpx.get(f"{base_url}/metrics").text
    return {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def wait_idle(base_url: str, timeout_s: float = 20) -> dict[str, float]:
    """Wait until no request runs or waits and every KV block is free (aborts land
    between steps); fail with the last metrics if that never happens."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = metrics(base_url)
        idle = (
            now["minipaged:num_requests_running"]
            == now["minipaged:num_requests_waiting"]
            == now["minipaged:num_requests_swapped"]
            == now["minipaged:kv_blocks_used"]
            == now["minipaged:cpu_kv_blocks_used"]
            == 0
        )
        if idle or time.monotonic() > deadline:
            assert idle, now
            return now
        time.sleep(0.05)


@contextlib.contextmanager
def openai_client(base_url: str):
    """The official client on ``base_url``'s ``/v1`` (no retries: a failure shows at
    once); afterwards, the server idle with every block free (`wait_idle`)."""
    import openai  # noqa: PLC0415 (the server extra; the modules that call this skip without it)

    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client
    wait_idle(base_url)

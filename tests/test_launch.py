"""Tensor parallelism across hosts under torchrun (``distributed_executor_backend=
"external_launcher"``): two "hosts" on one machine, network namespaces A and B joined by
a veth pair (`netns.two_hosts`: root and iproute2, as CI has; elsewhere those tests skip,
printing why), with one ``torchrun`` node in each.

- TP=2, and PP=2, across the hosts: a script calling ``LLM(...)``
  (``launch_driver.py``), run by every rank, gives Hugging Face's greedy tokens on
  rank 0; rank 1 ran on B.
- ``minipaged serve`` across the hosts: rank 0 serves HTTP on A; killing rank 1's
  process on B mid-stream ends the stream with an error naming rank 1 and B's address,
  ``/health`` stops answering 200, serve exits 1, and nothing is left running in either
  namespace (torchrun on both hosts exits too).

The commands are those of docs/distributed.md.  About a minute on 2 cores (two on a
heavily loaded machine), most of it starting torchrun and importing torch on each rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_helpers import random_prompt
from netns import Host, two_hosts

ADDRESS_A, ADDRESS_B = "10.214.0.1", "10.214.0.2"
RDZV_PORT, HTTP_PORT = 29400, 8000  # inside the namespaces: nothing else binds there
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
DRIVER = Path(__file__).with_name("launch_driver.py")
SETTINGS = dict(
    device="cpu",
    tensor_parallel_size=2,
    attention_backend="torch",  # no kernel build racing on two ranks
    block_size=4,
    num_gpu_blocks=64,
    swap_space=0.01,
)
MAX_TOKENS = 8
PROMPTS = [random_prompt(length, seed) for seed, length in enumerate([3, 17, 9])]


def test_external_launcher_needs_the_launchers_environment(tiny, monkeypatch):
    from minipaged import LLM

    path, _ = tiny("llama")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="external_launcher.*RANK, WORLD_SIZE.*none is set"):
        LLM(path, distributed_executor_backend="external_launcher", **SETTINGS)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=2 x pipeline_parallel_size=1 needs 2 ranks.*WORLD_SIZE=4",
    ):
        LLM(path, distributed_executor_backend="external_launcher", **SETTINGS)


@pytest.mark.parametrize("backend", ["ray", "uni", ""])
def test_distributed_executor_backend_is_one_minipaged_has(backend):
    from minipaged.config import EngineConfig

    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineConfig(model="m", distributed_executor_backend=backend)


def test_replicas_of_a_launched_engine_are_refused():
    pytest.importorskip("fastapi")  # the server extra
    from minipaged.server.data_parallel import check_data_parallel_size

    launched = {"distributed_executor_backend": "external_launcher"}
    with pytest.raises(ValueError, match="data_parallel_size > 1 cannot run with distributed_"):
        check_data_parallel_size(2, launched)
    check_data_parallel_size(1, launched)


@pytest.mark.parametrize(
    "command", [["generate", "--model", "M", "hi"], ["serve", "M"], ["bench", "throughput"]]
)
def test_distributed_executor_backend_flag(command):
    from minipaged.arg_utils import engine_kwargs
    from minipaged.cli import build_parser

    flag = ["--distributed-executor-backend", "external_launcher"]
    assert (
        engine_kwargs(build_parser().parse_args([*command, *flag]))["distributed_executor_backend"]
        == "external_launcher"
    )
    assert engine_kwargs(build_parser().parse_args(command))["distributed_executor_backend"] == "mp"


def test_the_rank_whose_heartbeat_stopped_is_named():
    """The driver's verdict after a failed step, without processes: in a store where
    rank 1 beats and rank 2 does not (dead), rank 2 is named with where it ran."""
    import torch.distributed as dist

    from minipaged.distributed.launcher import Heartbeat, LaunchedGroup
    from minipaged.distributed.parallel_state import RankInfo, TensorParallelGroup

    store = dist.HashStore()
    group = LaunchedGroup(TensorParallelGroup(0, 3), store)
    group._finalizer.detach()  # no group to say goodbye to
    group.ranks = [RankInfo(1, "h1", "10.0.0.1", 11), RankInfo(2, "h2", "10.0.0.2", 22)]
    beating = Heartbeat(store, 1)
    try:
        dead = group.fail(RuntimeError("Connection closed by peer"))
    finally:
        beating.stop()
    assert (
        dead
        == "tensor-parallel worker rank 2 on h2 (10.0.0.2, pid 22) died (its heartbeat stopped)"
    )
    with pytest.raises(RuntimeError, match="rank 2 on h2"):
        group.check()


@pytest.fixture
def hosts():
    with two_hosts("mplaunch", ADDRESS_A, ADDRESS_B) as pair:
        yield pair


def torchrun(host: Host, command: list[str], run_id: str) -> subprocess.Popen:
    """One torchrun node of 2 on ``host``, one rank each, meeting at A's rendezvous;
    A hosts its store (torch recognizes its own host by name, which the namespaces
    share, so it is told)."""
    args = host.exec(
        TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={ADDRESS_A}:{RDZV_PORT}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={int(host.address == ADDRESS_A)}",
        f"--local-addr={host.address}",  # the address the other host reaches it at
        "--max-restarts=0",
        *command,
    )
    env = {**os.environ, "GLOO_SOCKET_IFNAME": host.interface, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(node: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = node.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        node.kill()
        out, err = node.communicate()
        pytest.fail(f"torchrun did not finish:\n{err[-4000:]}")
    return node.returncode, out, err


@pytest.mark.netns
@pytest.mark.parametrize(
    "split",
    [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}],
    ids=["tp2", "pp2"],
)
def test_two_ranks_across_two_hosts_equal_hf_greedy(hosts, tiny, split):
    """One rank a host: each holds half of every layer (TP=2), or half the layers
    (PP=2: stage 0 on A, stage 1 on B, the activations crossing the veth pair)."""
    a, b = hosts
    path, oracle = tiny("llama")
    settings = json.dumps({**SETTINGS, **split})
    command = [str(DRIVER), str(path), json.dumps(PROMPTS), str(MAX_TOKENS), settings]
    nodes = [torchrun(host, command, "greedy") for host in (a, b)]
    (status_a, out, err_a), (status_b, _, err_b) = [finish(node) for node in nodes]
    assert status_a == 0, err_a[-4000:]
    assert status_b == 0, err_b[-4000:]  # rank 1 left when rank 0 said goodbye
    report = json.loads(out.splitlines()[-1])  # rank 0 ran on A, the smaller address
    for prompt, (tokens, finish_reason) in zip(PROMPTS, report["completions"], strict=True):
        expected, _ = oracle.greedy(prompt, MAX_TOKENS)
        assert tokens == expected
        assert finish_reason == "length"
    (worker,) = report["workers"]
    assert worker["rank"] == 1 and worker["address"] == ADDRESS_B


# Run in namespace A (the test's own namespace cannot reach it): wait for the server,
# stream one long completion, say so after a few tokens, then read the stream to its end
# and /health until the server is gone; print what was seen as JSON.
CLIENT = """
import json, sys, time, httpx
url = sys.argv[1]
deadline = time.monotonic() + 180
while True:
    try:
        if httpx.get(url + "/health").status_code == 200:
            break
    except httpx.TransportError:
        pass
    assert time.monotonic() < deadline, "the server never became healthy"
    time.sleep(0.5)
body = {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True, "stream": True}
events = []
with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
    for line in stream.iter_lines():
        events.append(line)
        if len(events) == 8:
            print("STREAMING", flush=True)
health = []
while True:
    try:
        health.append(httpx.get(url + "/health", timeout=5).status_code)
    except httpx.TransportError:
        break
    time.sleep(0.05)
errors = [event for event in events if '"error"' in event]
print(json.dumps({"errors": errors, "last": events[-2:], "health": health}), flush=True)
"""


def rank_process(host: Host) -> int:
    """The pid of the minipaged rank torchrun started in ``host`` (not torchrun's)."""
    for pid in host.pids():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"minipaged" in command and not any(part.endswith(b"torchrun") for part in command):
            return pid
    raise AssertionError(f"no minipaged rank in {host.ns}")


@pytest.mark.netns
def test_a_killed_remote_rank_is_named_and_serve_exits_1(hosts, tiny):
    a, b = hosts
    path, _ = tiny("llama")
    settings = {**SETTINGS, "num_gpu_blocks": 256, "max_model_len": 1024}  # a long stream
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    command = ["-m", "minipaged", "serve", str(path), f"--host={ADDRESS_A}", f"--port={HTTP_PORT}"]
    command += ["--distributed-executor-backend=external_launcher"]
    nodes = [torchrun(host, command + flags, "serve") for host in (a, b)]
    client = subprocess.Popen(
        a.exec(sys.executable, "-c", CLIENT, f"http://{ADDRESS_A}:{HTTP_PORT}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if client.stdout.readline().strip() != "STREAMING":
            nodes[0].kill()
            pytest.fail(f"{client.stderr.read()[-2000:]}\n{nodes[0].communicate()[1][-4000:]}")
        victim = rank_process(b)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        seen, _ = client.communicate(timeout=60)
        status_a, _, err_a = finish(nodes[0], 60)
        detected = time.monotonic() - killed
        status_b, _, _ = finish(nodes[1], 60)
    finally:
        for process in (client, *nodes):
            if process.poll() is None:
                process.kill()
    report = json.loads(seen.splitlines()[-1])
    named = f"tensor-parallel worker rank 1 on {os.uname().nodename} ({ADDRESS_B}, pid {victim})"
    assert named in err_a, err_a[-4000:]
    (error,) = report["errors"]  # the stream's error event, then [DONE]
    assert "rank 1" in error and ADDRESS_B in error and "data: [DONE]" in report["last"], report
    assert 200 not in report["health"], report  # 503 until the server was gone
    assert status_a != 0 and status_b != 0  # torchrun on each host says a rank failed
    assert "exitcode  : 1" in err_a  # rank 0, serve, exited 1
    assert detected < 30, f"{detected:.1f} s from the kill to the driver's exit"
    deadline = time.monotonic() + 15
    while (a.pids() or b.pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not a.pids() and not b.pids(), "processes left in the namespaces"

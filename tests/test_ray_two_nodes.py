"""Replicas on two Ray nodes: a head in one network namespace and a worker node in
another, joined by a veth pair, with one replica of the tiny model placed on each.

The namespaces come from `netns.two_hosts` (root and iproute2, as CI has; elsewhere the
test skips, printing why).  Every address is one of the namespaces' own (10.213.0.1 and
10.213.0.2, which exist only inside them), so nothing leaves the machine; ports are the
namespaces' own too.  The Ray nodes run as ``ip netns exec ... ray start --block``
children with temp dirs of their own; teardown kills every process left in each
namespace and deletes the namespaces, whatever happened.  The commands are those in
docs/distributed.md ("Two nodes").  About 2 minutes on 2 cores, most of it Ray
starting.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")  # the server extra
pytest.importorskip("ray.serve")

from netns import two_hosts  # noqa: E402
from server_helpers import ENGINE, MODEL  # noqa: E402

pytestmark = pytest.mark.netns

HEAD_IP, WORKER_IP = "10.213.0.1", "10.213.0.2"
GCS_PORT, HTTP_PORT = 6379, 8000  # inside the namespaces: nothing else binds there
START_TIMEOUT_S = 180
RAY = str(Path(sys.executable).with_name("ray"))
DRIVER = Path(__file__).with_name("ray_netns_driver.py")


@pytest.fixture
def namespaces():
    """Namespaces A and B joined by a veth pair, HEAD_IP in A, WORKER_IP in B."""
    with two_hosts("mpray", HEAD_IP, WORKER_IP) as (a, b):
        yield a.ns, b.ns


def ray_node(ns: str, args: list[str], temp_dir: Path, env: dict) -> subprocess.Popen:
    """``ray start --block`` in namespace ``ns``, once its runtime has started."""
    log = temp_dir.with_suffix(".log")
    command = ["ip", "netns", "exec", ns, RAY, "start", "--block", f"--temp-dir={temp_dir}"]
    with open(log, "w") as out:
        node = subprocess.Popen(
            command + args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text():
        if node.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"ray start in {ns} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return node


@pytest.fixture
def short_tmp():
    """A temp dir with a short path: Ray's sockets under it must fit AF_UNIX's 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="mpray-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_replica_runs_on_a_second_ray_node_in_another_namespace(namespaces, tiny, short_tmp):
    a, b = namespaces
    path, _ = tiny("llama")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Token authentication, as Ray's default for a new cluster, with a token of the
        # test's own that every node and the driver are given.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        # Ray's waits for a raylet and its agents to start are short on a busy small machine.
        "RAY_raylet_start_wait_time_s": "120",
        "RAY_agent_register_timeout_ms": "300000",
    }
    common = ["--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"]
    ray_node(
        a,
        ["--head", f"--node-ip-address={HEAD_IP}", f"--port={GCS_PORT}",
         "--include-dashboard=false", *common],
        short_tmp / "a",
        env,
    )  # fmt: skip
    ray_node(
        b,
        [f"--address={HEAD_IP}:{GCS_PORT}", f"--node-ip-address={WORKER_IP}",
         '--resources={"hostB": 1}', *common],
        short_tmp / "b",
        env,
    )  # fmt: skip
    # One CPU a node and one a replica: the second replica can only go to node B.
    settings = dict(
        num_replicas=2, ray_actor_options={"num_cpus": 1}, served_model_name=MODEL, **ENGINE
    )
    driver = subprocess.run(
        ["ip", "netns", "exec", a, sys.executable, str(DRIVER), f"{HEAD_IP}:{GCS_PORT}",
         HEAD_IP, str(HTTP_PORT), str(path), json.dumps(settings)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr[-5000:]
    report = json.loads(driver.stdout.splitlines()[-1])
    answers = report["answers"]
    assert all(x["status"] == 200 and x["text"] for x in answers), answers
    nodes = {n["id"]: n for n in report["nodes"]}
    assert {n["ip"] for n in nodes.values()} == {HEAD_IP, WORKER_IP}, nodes
    replica_nodes = report["replica_nodes"]
    assert len(replica_nodes) == 2, (replica_nodes, answers)  # both replicas served
    on = {nodes[node]["ip"] for node in replica_nodes.values()}
    assert on == {HEAD_IP, WORKER_IP}, (replica_nodes, nodes)
    (worker,) = [n for n in nodes.values() if n["ip"] == WORKER_IP]
    assert worker["resources"].get("hostB") == 1

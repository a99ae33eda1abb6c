"""`benchmarks/run_gpu.sh` and `make gpu-test`, checked on a CPU as a GPU machine's stock
Python would run them (only torch, triton, transformers and pytest: `stock_machine`):
the gpu-marked tests collect there, every one of the suite's, and the whole script's
SMOKE run starts every stage and writes each one's results."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from stock_machine import MISSING, ROOT, stock_env

SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"


def run_gpu(args, env, timeout=1800):
    """The script's completed process; past ``timeout`` seconds its whole process group
    (the benches it started) is killed and the test fails with what it printed."""
    with subprocess.Popen(
        ["bash", str(SCRIPT), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"run_gpu.sh {' '.join(args)} ran past {timeout} s:\n{stdout[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def collected_ids(stdout: str) -> set[str]:
    return {line for line in stdout.splitlines() if "::" in line}


def test_the_stock_machine_lacks_the_optional_packages_only(tmp_path):
    probe = "; ".join(
        [
            "import importlib.util, torch, transformers, pytest",
            f"print([m for m in {list(MISSING)!r} if importlib.util.find_spec(m)])",
        ]
    )
    result = subprocess.run(
        ["python3", "-c", probe], env=stock_env(tmp_path), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    blocked = subprocess.run(
        ["python3", "-c", "import nbmake"], env=stock_env(tmp_path), capture_output=True, text=True
    )
    assert "No module named 'nbmake'" in blocked.stderr


def test_every_gpu_test_collects_on_a_stock_machine(smoke):
    """The SMOKE run's tests stage (a collection on the stock machine) lists the
    gpu-marked tests of the whole suite."""
    result, _ = smoke
    assert re.search(r"^=== tests rc=0 in \d+ s$", result.stdout, re.M)
    tests_stage = result.stdout.split("=== tests (")[1].split("=== tests rc=")[0]
    assert "error" not in tests_stage.lower()
    stock = collected_ids(tests_stage)
    # The oracle: the gpu-marked tests of the whole suite, collected with every package.
    full = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert full.returncode == 0, full.stdout[-3000:]
    assert stock == collected_ids(full.stdout) and stock


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The whole script at tiny scale (SMOKE=1), on the stock machine, into one folder."""
    tmp = tmp_path_factory.mktemp("run-gpu")
    results = tmp / "results"
    env = {**stock_env(tmp), "SMOKE": "1", "RESULTS_DIR": str(results)}
    return run_gpu(["all"], env), results


def test_smoke_runs_every_stage_and_writes_each_ones_results(smoke):
    result, results = smoke
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for stage in ("tests", "attention", "throughput", "block-size", "preemption", "latency"):
        assert re.search(rf"^=== {stage} rc=0 in \d+ s$", result.stdout, re.M), stage
    for name in ("attention", "throughput", "block-size", "preemption", "latency-sharegpt"):
        doc = json.loads((results / f"{name}.json").read_text())
        assert doc["results"] and doc["command"].startswith(f"minipaged bench {name[:7]}")
        assert (results / f"{name}.png").exists()


def test_smoke_baselines_out_of_time_are_marked_partial(smoke):
    _, results = smoke
    rows = json.loads((results / "throughput.json").read_text())["results"]
    profiled = [r["step_profile"] for r in rows if r["system"] == "minipaged-torch"]
    # Three short requests are done before the profiled steps: only the figures' shape.
    assert profiled and profiled[0]["num_steps"] == 2 and "num_running" in profiled[0]
    hf = [r for r in rows if r["system"].startswith("hf-")]
    assert {r["system"] for r in hf} == {"hf-generate", "hf-generate-batch"}
    assert all(r["partial"] and r["num_requests"] < 3 for r in hf)


def test_an_unknown_stage_is_refused(tmp_path):
    result = run_gpu(["nope"], stock_env(tmp_path))
    assert result.returncode == 2
    assert "unknown stage nope" in result.stderr

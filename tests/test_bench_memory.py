"""``minipaged bench memory`` (paper Fig. 2 and 13): the results file holds the
results contract, its numbers are the simulation's own (run here directly on the same
requests), and the reproduction keeps the paper's shape.  The simulation's accounting
itself is checked by hand in test_contiguous.py."""

import json

import pytest
from cli_helpers import run_main

from minipaged.bench.memory import bench_memory
from minipaged.memory.simulate import SYSTEMS, simulate_memory
from minipaged.workloads import synthetic_requests

KEYS = {"token_share", "reserved_share", "internal_share", "external_share", "max_batch"}


def test_results_file_holds_the_contract_and_the_simulation(tmp_path):
    out = tmp_path / "memory.json"
    assert run_main(["bench", "memory", "--workload", "alpaca", "--num-requests", "200",
                     "--kv-slots", "4000", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "results"} <= set(document)
    assert document["workload"] == "alpaca" and set(document["systems"]) == set(SYSTEMS)
    requests = synthetic_requests("alpaca", 200, seed=0)
    for system, got in document["systems"].items():
        assert set(got) == KEYS
        assert sum(v for k, v in got.items() if k != "max_batch") <= 1 + 1e-9
        want = simulate_memory(requests, system, 4000)
        assert got == pytest.approx({k: getattr(want, k) for k in KEYS})
    assert [row["system"] for row in document["results"]] == list(SYSTEMS)
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_paper_shape_on_sharegpt():
    """Fig. 2: paged keeps nearly all of the pool as token states, contiguous systems at
    most about half; Fig. 13: paged batches more requests than even Orca Oracle."""
    reports = {r.system: r for r in bench_memory("sharegpt", 300)}
    assert reports["paged"].token_share > 0.9
    assert all(reports[s].token_share < 0.6 for s in SYSTEMS if s != "paged")
    assert reports["paged"].max_batch > 1.5 * reports["contiguous-oracle"].max_batch
    assert reports["contiguous-oracle"].max_batch > reports["contiguous-max"].max_batch


@pytest.mark.parametrize("argv, name", [
    (["--num-requests", "0"], "num_requests"), (["--kv-slots", "100"], "num_slots"),
    (["--workload", "lmsys"], "workload")])
def test_bad_arguments_are_refused_by_name(argv, name, capsys):
    assert run_main(["bench", "memory", *argv, "--json", "/dev/null/x.json"]) == 2
    assert name in capsys.readouterr().err

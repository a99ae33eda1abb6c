"""``minipaged bench memory`` (paper Fig. 2 and 13): the results file holds the
results contract, its numbers are the simulation's own (run here directly on the same
requests), and the reproduction keeps the paper's shape.  The simulation's accounting
itself is checked by hand in test_contiguous.py."""

import json
from pathlib import Path

import pytest

from cli_helpers import run_main
from minipaged.bench import results
from minipaged.bench.memory import bench_memory, latent_rows, slots_for
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS, SYSTEMS, simulate_memory
from minipaged.core.memory.workloads import MEMORY_NUM_REQUESTS, synthetic_requests

KEYS = {"token_share", "reserved_share", "internal_share", "external_share", "max_batch"}


def test_results_file_holds_the_contract_and_the_simulation(tmp_path):
    out = tmp_path / "memory.json"
    assert (
        run_main(
            [
                "bench",
                "memory",
                "--workload",
                "alpaca",
                "--num-requests",
                "200",
                "--kv-slots",
                "4000",
                "--json",
                str(out),
            ]
        )
        == 0
    )
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
    # The pool's bytes as DeepSeek-V2-Lite's caches, from the config.json values.
    assert latent_per_token(document["latent_kv"]) == {
        "DeepSeek-V2-Lite, latent (MLA)": 27 * (512 + 64) * 2,
        "DeepSeek-V2-Lite, 8 KV heads (GQA)": 27 * 8 * (192 + 128) * 2,
    }


OPT13B_FP16_TOKEN = 40 * 40 * 128 * 2 * 2  # layers x heads x head_dim x (K, V) x fp16


def latent_per_token(rows):
    """Bytes per token of the latent cache and of the same model with GQA, each row's
    tokens checked against the pool of 4,000 OPT-13B fp16 tokens."""
    for row in rows:
        assert row["kv_slots"] == 4000 * OPT13B_FP16_TOKEN // row["bytes_per_token"]
    names = ("DeepSeek-V2-Lite, latent (MLA)", "DeepSeek-V2-Lite, 8 KV heads (GQA)")
    return {r["cache"]: r["bytes_per_token"] for r in rows if r["cache"] in names}


def test_a_byte_per_element_holds_twice_the_tokens(tmp_path):
    out = tmp_path / "memory.json"
    argv = ["bench", "memory", "--workload", "alpaca", "--num-requests", "200"]
    assert (
        run_main([*argv, "--kv-slots", "4000", "--kv-cache-dtype", "fp8", "--json", str(out)]) == 0
    )
    document = json.loads(out.read_text())
    assert document["kv_slots"] == 8000 and document["kv_cache_dtype"] == "fp8"
    want = simulate_memory(synthetic_requests("alpaca", 200, seed=0), "paged", 8000)
    assert document["systems"]["paged"]["max_batch"] == want.max_batch
    # int8's scales: 4 bytes per token and head of 128 (128 bytes of fp8).
    assert slots_for(4000, "int8") == int(8000 / (1 + 4 / 128))
    # fp8 stores DeepSeek-V2-Lite's caches a byte per element too; int8 it refuses.
    assert latent_per_token(document["latent_kv"]) == {
        "DeepSeek-V2-Lite, latent (MLA)": 27 * (512 + 64),
        "DeepSeek-V2-Lite, 8 KV heads (GQA)": 27 * 8 * (192 + 128),
    }
    assert latent_rows(4000, "int8") is None


def test_the_paper_shape_on_sharegpt():
    """Fig. 2: paged keeps nearly all of the pool as token states, contiguous systems at
    most about half; Fig. 13: paged batches more requests than even Orca Oracle."""
    reports = {r.system: r for r in bench_memory("sharegpt", 300)}
    assert reports["paged"].token_share > 0.9
    assert all(reports[s].token_share < 0.6 for s in SYSTEMS if s != "paged")
    assert reports["paged"].max_batch > 1.5 * reports["contiguous-oracle"].max_batch
    assert reports["contiguous-oracle"].max_batch > reports["contiguous-max"].max_batch


@pytest.mark.parametrize(
    "argv, name",
    [
        (["--num-requests", "0"], "num_requests"),
        (["--kv-slots", "100"], "num_slots"),
        (["--workload", "lmsys"], "workload"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, name, capsys):
    assert run_main(["bench", "memory", *argv, "--json", "/dev/null/x.json"]) == 2
    assert name in capsys.readouterr().err


# -- where the results go -----------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["bench", "memory", "--workload", "alpaca", "--num-requests", "20"]


def committed_files() -> dict[Path, tuple[int, int]]:
    return {
        p: (p.stat().st_size, p.stat().st_mtime_ns)
        for p in (ROOT / "benchmarks" / "results").rglob("*")
        if p.is_file()
    }


def test_a_run_writes_into_the_working_directory_not_the_committed_results(
    tmp_path, monkeypatch, capsys
):
    before = committed_files()
    monkeypatch.chdir(tmp_path)
    assert run_main(SMALL) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory-alpaca.json", "memory-alpaca.png"]
    assert "wrote memory-alpaca.json and memory-alpaca.png" in capsys.readouterr().out
    assert run_main([*SMALL, "--out", "elsewhere"]) == 0
    assert (tmp_path / "elsewhere" / "memory-alpaca.json").is_file()
    assert (tmp_path / "elsewhere" / "memory-alpaca.png").is_file()
    assert committed_files() == before


def test_update_committed_writes_over_the_committed_results(tmp_path, monkeypatch):
    assert results.COMMITTED_DIR == ROOT / "benchmarks" / "results"
    assert (
        results.committed_path("memory-alpaca", "cpu")
        == ROOT / "benchmarks" / "results" / "cpu" / "memory-alpaca.json"
    )
    # A copy stands in for the checkout's committed results.
    (tmp_path / "committed").mkdir()
    monkeypatch.setattr(results, "COMMITTED_DIR", tmp_path / "committed")
    monkeypatch.chdir(tmp_path)
    assert run_main([*SMALL, "--update-committed"]) == 0
    written = json.loads((tmp_path / "committed" / "cpu" / "memory-alpaca.json").read_text())
    assert written["num_requests"] == 20
    assert (tmp_path / "committed" / "cpu" / "memory-alpaca.png").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["committed"]


def test_update_committed_needs_a_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "COMMITTED_DIR", tmp_path / "no-checkout")
    monkeypatch.chdir(tmp_path)
    assert run_main([*SMALL, "--update-committed"]) == 2
    assert "--update-committed: no committed results at" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flags", [["--json", "x.json", "--out", "d"], ["--out", "d", "--update-committed"]]
)
def test_one_place_for_the_results(flags, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_main([*SMALL, *flags]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("workload", ["alpaca", "sharegpt"])
def test_committed_results_are_the_course_workload(workload):
    """Lessons 00 and 11, `make demo` and docs/reproducing.md print these shares from the
    course's requests; the committed file must be the run on the same ones."""
    data = json.loads(results.committed_path(f"memory-{workload}", "cpu").read_text())
    assert (data["num_requests"], data["seed"]) == (MEMORY_NUM_REQUESTS, 0)
    assert (data["kv_slots"], data["block_size"], data["max_len"]) == (OPT13B_A100_SLOTS, 16, 2048)

"""``minipaged bench spec`` on the tiny checkpoint: its rows, its refusals, its file.

The benchmark itself raises if any ``k`` changes the greedy tokens; here the counts are
checked by hand: every ``k`` of a setting generates the same number of tokens, ``k = 0``
is the baseline (speed-up exactly 1, no acceptance), and a speculating run takes no
more steps than the baseline (each verifying step adds at least one token)."""

import json

import pytest

from cli_helpers import run_main
from minipaged.bench.spec import bench_spec


@pytest.fixture(scope="module")
def rows(tiny):
    path, _ = tiny("llama")
    return bench_spec(
        str(path), batch_sizes=(1, 3), ks=(0, 3), max_tokens=12, rounds=1, progress=False
    )


def test_rows_compare_each_k_with_the_baseline(rows):
    settings = {(r["workload"], r["batch"]) for r in rows}
    assert settings == {(w, b) for w in ("repeat", "sharegpt") for b in (1, 3)}
    for workload, batch in settings:
        base, spec = (
            next(r for r in rows if (r["workload"], r["batch"], r["k"]) == (workload, batch, k))
            for k in (0, 3)
        )
        assert base["speedup"] == 1 and base["acceptance_rate"] is None
        assert spec["output_tokens"] == base["output_tokens"] <= 12 * batch
        assert spec["steps"] <= base["steps"]
        assert 0 <= spec["acceptance_rate"] <= 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"ks": (2, 4)}, "ks"),
        ({"workloads": ("poetry",)}, "workloads"),
        ({"batch_sizes": (0,)}, "batch_sizes"),
        ({"rounds": 0}, "rounds"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        bench_spec(**kwargs)


def test_results_file(tiny, tmp_path):
    path, _ = tiny("llama")
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--model", str(path), "--workloads", "repeat", "--batch-sizes", "2"]
    argv += ["--ks", "0", "2", "--max-tokens", "6", "--rounds", "1", "--json", str(out)]
    assert run_main(argv) == 0
    document = json.loads(out.read_text())
    assert {"device", "torch", "date", "command", "results"} <= set(document)
    assert [(r["batch"], r["k"]) for r in document["results"]] == [(2, 0), (2, 2)]
    assert out.with_suffix(".png").stat().st_size > 0

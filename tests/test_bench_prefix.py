"""``minipaged bench prefix`` (paper §6.4): the prefix cache's hits counted by hand.
Every request is one shared prefix of P tokens followed by its own suffix.  Only full
blocks are cached, so with blocks of B tokens the first request finds nothing and each
later one finds the prefix's floor(P / B) full blocks: (N - 1) * floor(P / B) * B tokens
of KV it need not compute.  Without caching every prompt token is computed."""

import json

import pytest

from cli_helpers import run_main
from minipaged.bench.prefix import PREFIXES, bench_overhead, bench_prefix
from minipaged.core.memory.workloads import synthetic_requests

N = 5


@pytest.fixture(scope="module")
def runs():
    return bench_prefix(N, block_size=16)


@pytest.mark.parametrize("prefix", list(PREFIXES))
def test_hits_are_the_prefix_full_blocks_of_every_request_but_the_first(runs, prefix):
    off, on = (
        next(r for r in runs if r.prefix == prefix and r.caching == c) for c in (False, True)
    )
    full = PREFIXES[prefix] // 16 * 16  # 80 -> 80, 341 -> 336
    assert on.prompt_tokens == off.prompt_tokens
    assert on.prompt_tokens - on.computed_prompt_tokens == (N - 1) * full
    assert on.hit_rate == pytest.approx((N - 1) * full / on.prompt_tokens)
    assert (off.hit_rate, off.computed_prompt_tokens) == (0, off.prompt_tokens)
    assert on.output_tokens == off.output_tokens  # the same requests, to their lengths


def test_results_file(tmp_path):
    out = tmp_path / "prefix.json"
    assert (
        run_main(
            ["bench", "prefix", "--num-requests", "3", "--prefixes", "1-shot"]
            + ["--overhead-repeats", "2", "--json", str(out)]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "results"} <= set(document)
    assert [(r["prefix"], r["caching"]) for r in document["results"]] == [
        ("1-shot", False),
        ("1-shot", True),
    ]
    assert document["results"][0]["speedup"] == 1
    summary = document["overhead_summary"]
    assert (summary["repeats"], summary["hit_rate"]) == (2, 0)
    ratios = [r["ratio"] for r in document["overhead"]]
    assert summary["ratio_min"] == min(ratios) and summary["ratio_max"] == max(ratios)
    assert out.with_suffix(".png").stat().st_size > 0


def test_with_nothing_shared_caching_finds_nothing_and_costs_only_time():
    """The overhead workload: prompts with no prefix in common, so the cache (kept
    across repeats) finds no block, and each engine makes every request's tokens."""
    runs = bench_overhead(N, repeats=2, block_size=16)
    assert [(r.repeat, r.hit_rate) for r in runs] == [(0, 0), (1, 0)]
    for run in runs:
        specs = synthetic_requests("alpaca", N, seed=run.repeat, max_len=512)
        assert run.output_tokens == sum(s.output_len for s in specs)
        assert run.ratio == run.elapsed_off_s / run.elapsed_on_s > 0
        assert run.cpu_ratio == run.cpu_off_s / run.cpu_on_s > 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"num_requests": 2, "prefixes": ["9-shot"]}, "prefixes"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        bench_prefix(**kwargs)
    with pytest.raises(ValueError, match="repeats"):
        bench_overhead(2, repeats=0)

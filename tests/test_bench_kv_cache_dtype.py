"""``minipaged bench kv-cache-dtype`` on the tiny checkpoint: under one KV budget fp8 and
int8 get about twice auto's (bf16) blocks, enough to run every request at once; the
dequantization timing and the quality comparison produce one row per dtype, auto's
agreeing with itself; the table and the figure plot those numbers."""

from __future__ import annotations

import pytest

from minipaged.bench import kv_cache_dtype as bench
from minipaged.models.tiny import cached_checkpoint

DTYPES = ["auto", "fp8", "int8"]


@pytest.fixture(scope="module")
def capacity():
    return bench.bench_capacity(
        cached_checkpoint("bench-sharing"),
        DTYPES,
        num_requests=4,
        kv_budget_mib=0.15,
        rounds=1,
        seed=0,
    )


def test_a_byte_per_element_runs_more_requests_in_the_same_budget(capacity):
    auto, fp8, int8 = capacity
    assert abs(fp8.num_gpu_blocks - 2 * auto.num_gpu_blocks) < 2  # each budget // its bytes
    assert 0.95 * fp8.num_gpu_blocks < int8.num_gpu_blocks < fp8.num_gpu_blocks
    assert auto.num_preemptions > 0 == fp8.num_preemptions
    assert fp8.peak_running == 4  # all at once
    assert all(r.num_requests == 4 and r.elapsed_s > 0 for r in capacity)


def test_table_and_figure_show_the_runs(capacity):
    path = cached_checkpoint("bench-sharing")
    cost = bench.time_dequantization(path, DTYPES, batch=2, context_len=32, repeats=2)
    quality = bench.measure_quality(path, DTYPES, num_prompts=2, max_tokens=3)
    assert list(cost) == DTYPES and all(s > 0 for s in cost.values())
    assert quality[0] == {
        "kv_cache_dtype": "auto",
        "identical": 1.0,
        "tokens_before_first_difference": 1.0,
        "mean_abs_delta_logprob": 0.0,
    }
    text = bench.format_tables(capacity, cost, quality)
    assert "peak running" in text and "mean |Δ logprob|" in text
    fig = bench.plot(capacity, cost, quality)
    rps, ms, agreement = fig.axes
    assert [p.get_height() for p in rps.patches] == pytest.approx(
        [r.requests_per_s for r in capacity]
    )
    assert [p.get_height() for p in ms.patches] == pytest.approx([1e3 * s for s in cost.values()])
    assert [p.get_height() for p in agreement.patches] == pytest.approx(
        [100 * q["tokens_before_first_difference"] for q in quality]
    )

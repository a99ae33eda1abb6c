"""``minipaged bench kv-cache-dtype`` on the tiny checkpoint: under one KV budget fp8 gets
twice auto's (bf16) blocks, enough to run every request at once, and int8 a block of its
bytes plus its scales; the dequantization timing produces one row per dtype; the table
and the figure plot those numbers.  The quality part: `test_bench_kv_quality.py`."""

from __future__ import annotations

import pytest

from minipaged.bench import kv_cache_dtype as bench
from minipaged.models.loader import read_config
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
    # int8 adds a float32 scale per token and head to each head_dim bytes.
    dim = read_config(cached_checkpoint("bench-sharing")).head_dim
    assert int8.block_bytes * dim == fp8.block_bytes * (dim + 4)
    assert auto.num_preemptions > 0 == fp8.num_preemptions
    assert fp8.peak_running == 4  # all at once
    assert all(r.num_requests == 4 and r.elapsed_s > 0 for r in capacity)


def test_table_and_figure_show_the_runs(capacity):
    path = cached_checkpoint("bench-sharing")
    cost = bench.time_dequantization(path, DTYPES, batch=2, context_len=32, repeats=2)
    assert list(cost) == DTYPES and all(s > 0 for s in cost.values())
    text = bench.format_tables(capacity, cost)
    assert "peak running" in text and "vs auto" in text
    fig = bench.plot(capacity, cost)
    rps, ms = fig.axes
    assert [p.get_height() for p in rps.patches] == pytest.approx(
        [r.requests_per_s for r in capacity]
    )
    assert [p.get_height() for p in ms.patches] == pytest.approx([1e3 * s for s in cost.values()])

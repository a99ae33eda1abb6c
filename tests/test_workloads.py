"""Synthetic workloads: seeded, bounded, and shaped like the paper's datasets (Fig. 11)."""

import statistics

import pytest

from minipaged.workloads import WORKLOADS, synthetic_requests


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_means_match_the_paper(workload):
    requests = synthetic_requests(workload, 4000, seed=1)
    target = WORKLOADS[workload]
    assert statistics.mean(r.prompt_len for r in requests) == pytest.approx(target.mean_input, rel=0.06)
    assert statistics.mean(r.output_len for r in requests) == pytest.approx(target.mean_output, rel=0.06)


def test_lengths_are_bounded_and_right_skewed():
    requests = synthetic_requests("sharegpt", 2000, seed=0, max_len=1024)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in requests)
    assert all(r.total_len <= 1024 for r in requests)
    outputs = [r.output_len for r in requests]
    assert statistics.median(outputs) < statistics.mean(outputs)  # a long tail


def test_seeded():
    assert synthetic_requests("alpaca", 50, seed=7) == synthetic_requests("alpaca", 50, seed=7)
    assert synthetic_requests("alpaca", 50, seed=7) != synthetic_requests("alpaca", 50, seed=8)


@pytest.mark.parametrize("kwargs, name", [
    (dict(workload="lmsys", num_requests=3), "workload"),
    (dict(workload="alpaca", num_requests=-1), "num_requests"),
    (dict(workload="alpaca", num_requests=3, max_len=1), "max_len"),
])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        synthetic_requests(**kwargs)

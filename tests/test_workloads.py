"""Synthetic workloads: seeded, bounded, and shaped like the paper's datasets (Fig. 11)."""

import itertools
import math
import statistics

import pytest

from minipaged.core.memory.workloads import WORKLOADS, arrival_times, synthetic_requests


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_means_match_the_paper(workload):
    requests = synthetic_requests(workload, 4000, seed=1)
    target = WORKLOADS[workload]
    assert statistics.mean(r.prompt_len for r in requests) == pytest.approx(
        target.mean_input, rel=0.06
    )
    assert statistics.mean(r.output_len for r in requests) == pytest.approx(
        target.mean_output, rel=0.06
    )


def test_lengths_are_bounded_and_right_skewed():
    requests = synthetic_requests("sharegpt", 2000, seed=0, max_len=1024)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in requests)
    assert all(r.total_len <= 1024 for r in requests)
    outputs = [r.output_len for r in requests]
    assert statistics.median(outputs) < statistics.mean(outputs)  # a long tail


def test_seeded():
    assert synthetic_requests("alpaca", 50, seed=7) == synthetic_requests("alpaca", 50, seed=7)
    assert synthetic_requests("alpaca", 50, seed=7) != synthetic_requests("alpaca", 50, seed=8)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(workload="lmsys", num_requests=3), "workload"),
        (dict(workload="alpaca", num_requests=-1), "num_requests"),
        (dict(workload="alpaca", num_requests=3, max_len=1), "max_len"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        synthetic_requests(**kwargs)


# -- arrivals (bench serve, bench latency) ----------------------------------------------
def test_arrivals_are_seeded_start_at_zero_and_scale_with_the_rate():
    first = arrival_times(50, 4.0, seed=3)
    assert first == arrival_times(50, 4.0, seed=3)
    assert first != arrival_times(50, 4.0, seed=4)
    assert first[0] == 0.0 and first == sorted(first) and len(first) == 50
    # The same sequence at every rate, compressed: twice the rate, half the times.
    assert arrival_times(50, 8.0, seed=3) == pytest.approx([t / 2 for t in first])


@pytest.mark.parametrize("seed", range(3))
def test_arrival_gaps_are_exponential_with_mean_one_over_the_rate(seed):
    # Fixed seeds: deterministic.  20,000 gaps put the sample mean within 0.7% (one
    # standard error) of 1/rate; the bounds are over 4 standard errors wide.
    times = arrival_times(20_001, 4.0, seed)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # An exponential's standard deviation equals its mean (a Poisson process, not a
    # jittered uniform one).
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1, rel=0.05)


def test_an_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize(
    "num_requests, rate, name",
    [
        (0, 1.0, "num_requests"),
        (2.0, 1.0, "num_requests"),
        (3, 0, "request_rate"),
        (3, -1.0, "request_rate"),
        (3, math.nan, "request_rate"),
    ],
)
def test_arrivals_refuse_bad_arguments_by_name(num_requests, rate, name):
    with pytest.raises(ValueError, match=name):
        arrival_times(num_requests, rate)

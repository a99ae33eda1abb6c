"""Synthetic request workloads with the length statistics of the paper's datasets (§6.1, Fig. 11).

No dataset can be downloaded here, so the two workloads the paper evaluates on are
imitated by seeded log-normal distributions (both datasets are right-skewed: many
short requests, a long tail).  A log-normal with mean ``m`` and shape ``sigma`` has
``mu = ln(m) - sigma**2 / 2``.  Lengths are rounded, at least 1, and a request never
exceeds ``max_len`` tokens in total (the output is cut first, as a server would).

=========  ==========  ===========  =====
workload   mean input  mean output  sigma
=========  ==========  ===========  =====
sharegpt   161.31      337.99       0.8
alpaca     19.31       58.45        0.6
=========  ==========  ===========  =====

The means are the paper's; the shapes are our choice, made to look like Fig. 11 while
keeping the cut at ``max_len`` from pulling the means down (about 1% for ShareGPT).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    """The lengths of one request: what a memory simulation or benchmark needs."""

    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class LengthDistribution:
    mean_input: float
    mean_output: float
    sigma: float


WORKLOADS = {
    "sharegpt": LengthDistribution(mean_input=161.31, mean_output=337.99, sigma=0.8),
    "alpaca": LengthDistribution(mean_input=19.31, mean_output=58.45, sigma=0.6),
}

# The course's shared workloads.  Lessons 00, 03 and 11, ``make demo``, the ``bench memory``
# and ``bench sharing`` defaults and docs/reproducing.md all draw these requests (seed 0), so
# a number quoted in one of them is the number the others print.
MEMORY_NUM_REQUESTS = 1000  # Fig. 2 and Fig. 13: where the KV pool goes
SHARING_NUM_REQUESTS = {"alpaca": 40, "sharegpt": 20}  # Fig. 15: n samples or beams each


def _lognormal_int(rng: random.Random, mean: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)))


def synthetic_requests(
    workload: str, num_requests: int, seed: int = 0, max_len: int = 2048
) -> list[RequestSpec]:
    """``num_requests`` seeded requests shaped like ``workload`` ("sharegpt" or "alpaca")."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests!r}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len!r}")
    dist, rng = WORKLOADS[workload], random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = min(_lognormal_int(rng, dist.mean_input, dist.sigma), max_len - 1)
        output = min(_lognormal_int(rng, dist.mean_output, dist.sigma), max_len - prompt)
        requests.append(RequestSpec(prompt, output))
    return requests


def arrival_times(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """When each request arrives, in seconds from the first: a Poisson process of
    ``request_rate`` per second (the paper's online traces, §6.1), i.e. exponential gaps
    of mean ``1 / request_rate``; all at once for ``inf``.  The gaps are drawn at rate 1
    and divided by the rate, so every rate replays the same sequence, compressed."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not request_rate > 0:  # also refuses NaN
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate!r}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}")
    gaps = (rng.expovariate(1.0) / request_rate for _ in range(num_requests - 1))
    return list(itertools.accumulate(gaps, initial=0.0))

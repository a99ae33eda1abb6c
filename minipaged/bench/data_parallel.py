"""Offline throughput over data-parallel replicas: ``bench throughput --data-parallel-size N``.

The same requests as the rest of ``bench throughput``, sent all at once to the
server's router (`minipaged.server.data_parallel.DataParallelEngine`) over one replica,
then over N, alternately for ``rounds`` rounds, so that a change in the machine's load
hits both alike; the scaling is each round's throughput ratio.  Both sides pay the same
pipes and pickling, so the ratio is what the extra replicas buy.  Each replica runs
torch on one thread (``OMP_NUM_THREADS=1``): N replicas use N cores, one replica one.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import contextmanager

from tqdm.auto import tqdm

from minipaged.bench.common import check_lengths, system_row
from minipaged.config import EngineConfig
from minipaged.core.memory.workloads import RequestSpec
from minipaged.sampling_params import SamplingParams
from minipaged.server.data_parallel import DataParallelEngine

ROUNDS = 3  # alternating rounds of one replica and of N


@contextmanager
def one_thread_per_replica():
    """Replicas started inside run torch on one thread (they read the variable when
    they import torch)."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


async def run_all(
    engine: DataParallelEngine, prompts: Sequence[list[int]], params: list[SamplingParams], tag
) -> tuple[list[int], float]:
    """Every request at once through the router; tokens generated each, and seconds."""
    bar = tqdm(total=len(prompts), desc=tag, leave=False)

    async def one(i: int) -> int:
        stream = await engine.generate([(f"{tag}-{i}", list(prompts[i]), params[i], None, None)])
        async for output in stream:
            last = output
        bar.update()
        return len(last.outputs[0].token_ids)

    start = time.perf_counter()
    generated = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    elapsed = time.perf_counter() - start
    bar.close()
    return list(generated), elapsed


def bench_data_parallel(
    path,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    data_parallel_size: int,
    rounds: int = ROUNDS,
) -> tuple[list[dict], dict]:
    """Rows for one replica and ``data_parallel_size`` replicas (median elapsed over
    ``rounds`` alternating rounds), and the scaling: each round's throughput ratio and
    their median."""
    config = EngineConfig(model=str(path), **engine_kwargs)
    params = [
        SamplingParams(temperature=1.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    warm = [SamplingParams(max_tokens=4, ignore_eos=True)] * len(prompts)
    sizes = (1, data_parallel_size)
    with one_thread_per_replica():
        engines = {n: DataParallelEngine(config, n) for n in sizes}
    try:
        elapsed = asyncio.run(_rounds(engines, prompts, params, warm, requests, rounds))
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = []
    for n in sizes:
        row = system_row(
            f"minipaged-dp{n}",
            requests,
            [r.output_len for r in requests],
            statistics.median(elapsed[n]),
            data_parallel_size=n,
            elapsed_s_per_round=elapsed[n],
        )
        rows.append(row)
    ratios = [one / many for one, many in zip(elapsed[1], elapsed[data_parallel_size])]
    return rows, {"ratio_per_round": ratios, "median": statistics.median(ratios)}


async def _rounds(engines, prompts, params, warm, requests, rounds) -> dict[int, list[float]]:
    for n, engine in engines.items():  # compiled kernels, a full batch seen once
        await run_all(engine, prompts, warm, f"warm-up dp{n}")
    elapsed: dict[int, list[float]] = {n: [] for n in engines}
    for r in range(rounds):
        for n, engine in engines.items():
            generated, seconds = await run_all(engine, prompts, params, f"round {r} dp{n}")
            check_lengths(f"minipaged-dp{n}", generated, requests)
            elapsed[n].append(seconds)
    return elapsed


def plot_scaling(rows: list[dict], scaling: dict, note: str):
    """Output tokens/s of one replica and of N (each round a dot, the bar its median),
    titled with the median ratio.  A matplotlib ``Figure``, no pyplot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    labels = [f"{r['data_parallel_size']} replica(s)" for r in rows]
    bars = ax.bar(labels, [r["output_tokens_per_s"] for r in rows], color="tab:blue")
    ax.bar_label(bars, fmt="%.0f", fontsize="small")
    for label, row in zip(labels, rows):
        per_round = [row["output_tokens"] / s for s in row["elapsed_s_per_round"]]
        ax.plot([label] * len(per_round), per_round, "k.", label=None)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"data parallelism: x{scaling['median']:.2f} the throughput of one replica")
    ax.text(0.5, -0.18, note, transform=ax.transAxes, ha="center", fontsize="small", wrap=True)
    return fig

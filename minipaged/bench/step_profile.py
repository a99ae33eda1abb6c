"""Where a real engine step's time goes: ``minipaged bench throughput --profile-steps N``.

The overhead probe (`overhead.py`) times the engine's own Python with the model stubbed
out.  On an H200 it measured 2.6 ms of bookkeeping in a step that took 7.8 ms end to end
(`benchmarks/results/nvidia-h200/`): the rest is a question for a profiler.  This runs
one: `torch.profiler` over ``N`` steps of the bench's own workload, on the engine that
just ran it, after ``N`` steps timed bare (the profiler slows the host down).

Per step it reports the wall time (the bare steps'), apart for the steps that only
decoded (on a GPU, the ones that replay a CUDA graph) and the mixed ones that also
computed prompt tokens (run eagerly), the tokens through the model, and,
on a GPU, how long the device was busy (its kernels' summed time: what is left of the
step the device waited for the host), how many kernels ran and how many launches the
host made for them, CUDA graph replays among them (a replay launches a whole decode
step's kernels at once); and the operators that took the most host and device time.
A GPU kept busy shows device time near the wall time; launches near the kernel count,
with no graph replays, say the steps ran eagerly, one launch per kernel.  On a GPU it
also steps ``N`` more times with torch's sync debug mode on and counts where the host
waited for the device (`sync_sites`): each wait leaves the GPU idle until the host
launches again.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minipaged.bench.common import sync

# The host's launch calls as the profiler names them (the runtime's and the driver's).
KERNEL_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}
TOP = 8  # operators listed, by host time and by device time
MIN_WARMUP_STEPS = 8


def profile_steps(
    engine, prompts: Sequence[list[int]], output_lens: Sequence[int], num_steps: int
) -> dict:
    """Admit ``prompts`` (each to generate its ``output_lens`` tokens) into ``engine``,
    step it ``num_steps`` times (at least ``MIN_WARMUP_STEPS``: the batch fills and
    every kernel is compiled), time ``num_steps`` steps bare, profile as many again, and
    abort what is left; the summary of `summarize`."""
    from minipaged.sampling_params import SamplingParams

    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    ids = [f"profile-{i}" for i in range(len(prompts))]
    for request_id, prompt, n in zip(ids, prompts, output_lens):
        engine.add_request(request_id, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))
    on_gpu = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    try:
        _steps(engine, max(MIN_WARMUP_STEPS, num_steps))
        walls = _timed_steps(engine, num_steps)
        before, running = _tokens(engine), len(engine.scheduler.running)
        with profile(activities=activities) as prof:
            profiled_s = _steps(engine, num_steps)
        tokens = _tokens(engine) - before
        syncs = sync_sites(engine, num_steps) if on_gpu else None
    finally:
        for request_id in ids:
            if request_id in engine.requests:
                engine.abort_request(request_id)
    # How many requests the profiled steps began with: none, when the workload was too
    # short to outlast the warm-up and the timed steps.
    wall_s = sum(seconds for seconds, _ in walls)
    summary = {"num_running": running, **by_kind(walls), "sync_sites": syncs}
    return summary | summarize(prof.events(), num_steps, wall_s, profiled_s, tokens, on_gpu)


def _steps(engine, n: int) -> float:
    """Seconds ``n`` engine steps took, the device synchronised before and after."""
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    sync(engine.device)
    return time.perf_counter() - start


def _timed_steps(engine, n: int) -> list[tuple[float, bool]]:
    """``n`` steps, each as (seconds, whether it computed prompt tokens).  No sync
    between them: each step ends waiting for its sampled tokens anyway."""
    sync(engine.device)
    walls = []
    for _ in range(n):
        prompt_tokens = engine.counters()["num_computed_prompt_tokens"]
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        walls.append((seconds, engine.counters()["num_computed_prompt_tokens"] > prompt_tokens))
    return walls


def by_kind(walls: list[tuple[float, bool]]) -> dict:
    """The steps that only decoded and the mixed ones: how many, and their mean wall
    time in milliseconds (None where there were none)."""
    out = {}
    for kind, mixed in (("decode", False), ("mixed", True)):
        times = [seconds for seconds, was_mixed in walls if was_mixed == mixed]
        out[f"{kind}_steps"] = len(times)
        out[f"{kind}_ms_per_step"] = statistics.fmean(times) * 1e3 if times else None
    return out


def sync_sites(engine, n: int) -> list[dict]:
    """Where ``n`` steps made the host wait for the GPU: torch's sync debug mode warns
    at each synchronizing call, from the Python line that made it; the ``TOP`` lines
    with their calls per step."""
    sync(engine.device)  # (outside the watch: the harness's own waits are not the steps')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(n):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return top_sites(caught, n)


def top_sites(caught, num_steps: int) -> list[dict]:
    """The ``TOP`` source lines among the sync warnings ``caught``, with their calls
    per step; a path inside the package is shown from it."""
    counts = Counter(
        f"{_short(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    return [{"site": site, "calls_per_step": n / num_steps} for site, n in counts.most_common(TOP)]


def _short(filename: str) -> str:
    parts = Path(filename).parts
    return str(Path(*parts[parts.index("minipaged") :])) if "minipaged" in parts else filename


def _tokens(engine) -> int:
    """Tokens through the model so far: prompt tokens computed and tokens generated."""
    counters = engine.counters()
    return counters["num_computed_prompt_tokens"] + counters["num_generated_tokens"]


def summarize(
    events, num_steps: int, wall_s: float, profiled_s: float, tokens: int, on_gpu: bool
) -> dict:
    """Per-step figures from the profiler's ``events`` (`profile_steps`): ``wall_s`` the
    bare steps' time, ``profiled_s`` the profiled ones', of which the host spent
    ``host_ops_ms_per_step`` inside operators; the rest of it is Python."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    device_us = sum(e.time_range.elapsed_us() for e in kernels)
    host_ops_us = sum(e.time_range.elapsed_us() for e in host if e.cpu_parent is None)
    return {
        "num_steps": num_steps,
        "wall_ms_per_step": wall_s / num_steps * 1e3,
        "profiled_ms_per_step": profiled_s / num_steps * 1e3,
        "host_ops_ms_per_step": host_ops_us / num_steps / 1e3,
        "tokens_per_step": tokens / num_steps,
        "device_busy_ms_per_step": device_us / num_steps / 1e3 if on_gpu else None,
        "kernels_per_step": len(kernels) / num_steps if on_gpu else None,
        "kernel_launches_per_step": _count(host, KERNEL_LAUNCHES) / num_steps,
        "graph_launches_per_step": _count(host, GRAPH_LAUNCHES) / num_steps,
        "top_host_ops": _top(host, num_steps),
        "top_device_kernels": _top(kernels, num_steps) if on_gpu else [],
    }


def _count(events, names: set[str]) -> int:
    return sum(e.name in names for e in events)


def _top(events, num_steps: int) -> list[dict]:
    """The ``TOP`` names with the most self time (a parent's time less its children's),
    in milliseconds and calls per step."""
    totals: dict[str, list[float]] = {}
    for event in events:
        child_us = sum(c.time_range.elapsed_us() for c in event.cpu_children)
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.elapsed_us() - child_us
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [
        {"name": name, "ms_per_step": us / num_steps / 1e3, "calls_per_step": n / num_steps}
        for name, (us, n) in ranked
    ]


def format_profile(system: str, summary: dict) -> str:
    """A few lines for the terminal: the per-step figures, then the top operators."""
    device = (
        f", device busy {summary['device_busy_ms_per_step']:.2f} ms, "
        f"{summary['kernels_per_step']:.0f} kernels from "
        f"{summary['kernel_launches_per_step']:.0f} launches and "
        f"{summary['graph_launches_per_step']:.1f} graph replays"
        if summary["device_busy_ms_per_step"] is not None
        else ""
    )
    kinds = ", ".join(
        f"{summary[f'{kind}_steps']} {kind} {summary[f'{kind}_ms_per_step']:.2f} ms"
        for kind in ("decode", "mixed")
        if summary[f"{kind}_steps"]
    )
    lines = [
        f"{system}, {summary['num_steps']} real steps from {summary['num_running']} running "
        f"requests: {summary['wall_ms_per_step']:.2f} ms and "
        f"{summary['tokens_per_step']:.0f} tokens a step ({kinds}){device}",
        f"  profiled: {summary['profiled_ms_per_step']:.2f} ms a step, "
        f"{summary['host_ops_ms_per_step']:.2f} ms of it in operators on the host",
        "  most host time: "
        + ", ".join(f"{o['name']} {o['ms_per_step']:.2f} ms" for o in summary["top_host_ops"]),
    ]
    if summary["top_device_kernels"]:
        lines.append(
            "  most device time: "
            + ", ".join(
                f"{o['name'][:40]} {o['ms_per_step']:.2f} ms" for o in summary["top_device_kernels"]
            )
        )
    if summary["sync_sites"]:
        lines.append(
            "  host waited for the device at: "
            + ", ".join(f"{o['site']} x{o['calls_per_step']:.1f}" for o in summary["sync_sites"])
        )
    return "\n".join(lines)

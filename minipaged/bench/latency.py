"""``minipaged bench latency``: normalized latency against request rate, paged vs
Orca's contiguous reservations (paper §6.2, Fig. 12, at our scale).

The experiment.  Synthetic ShareGPT- or Alpaca-like requests (`workloads`) arrive as a
Poisson process at ``rate`` requests per second and are served by the engine in each
memory mode (``EngineConfig.memory_mode``): ``paged`` (vLLM) and Orca's three
contiguous reservation policies, ``contiguous-max``, ``-pow2`` and ``-oracle`` (§6.1).
A request's *normalized latency* is its end-to-end latency (arrival to last token)
divided by its output length, in seconds per token; Fig. 12 plots the mean over all
requests against the rate.  At low rates every system keeps up and the curves sit near
the time of one decode step.  As the rate grows, a system whose batch is capped by
memory falls behind, its queue grows for as long as requests keep arriving and its
latency shoots up: the rate at its knee is the throughput it sustains.  Paged memory
holds more requests at once (Fig. 13, here ``mean_batch``), so its knee comes later.

The driver (`serve`).  Offline, in one loop: add every request whose arrival time has
passed, run one engine step, stamp the requests that finished with the time.  The clock
is the wall clock, except that when the engine has nothing to do it jumps to the next
arrival instead of sleeping: nothing happens meanwhile, so no latency changes, and a
low rate costs no idle time.  Every request generates exactly its drawn output length
(``ignore_eos``, sampled at temperature 1), from random prompt token ids
(`throughput.make_prompts`).  The arrival gaps are seeded and the same for every rate
(drawn once, divided by the rate), so every point serves the same request sequence,
only faster.

Lengths.  The workload's lengths are drawn for a 2048-token context (the paper's OPT
models) and multiplied by ``length_scale * min(1, max_model_len / 2048)``, so a
smaller ``max_model_len`` keeps the distribution's shape and its ratio to the longest
sequence, which is what Max reserves.  The ``cpu`` preset serves the tiny checkpoint on
a KV pool small enough that memory, not compute, caps the batch; the ``gpu`` preset a
Llama-3.2-1B-shaped model on the paper's pool (OPT-13B on an A100-40GB: about 15.7K
token slots, §6.1) at full ShareGPT lengths.

The paper (OPT-13B, ShareGPT): vLLM sustains 1.7-2.7x the request rate of Orca Oracle
and 2.7-8x that of Orca Max at the same normalized latency.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from minipaged.arg_utils import add_engine_flags, add_model_flag, engine_kwargs
from minipaged.bench import blocksize, common
from minipaged.bench.args import (
    SYNTHETIC_MODEL_HELP,
    add_output_flags,
    bench_model,
    model_record,
    write,
)
from minipaged.bench.common import Column, free_memory, one_cpu_thread
from minipaged.bench.presets import (
    GPU_MODEL,
    PAPER_CONTEXT,
    default_preset,
    make_prompts,
    preset_device,
    with_overrides,
)
from minipaged.bench.results import device_name
from minipaged.config import MEMORY_MODES
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS
from minipaged.core.memory.workloads import WORKLOADS, RequestSpec, arrival_times

NAME = "latency"
HELP = "normalized latency against request rate: paged vs contiguous (Fig. 12)"
DESCRIPTION = (
    "Serve synthetic requests arriving as a Poisson process at each rate "
    "with the engine in each memory mode (paged, and Orca's contiguous Max, "
    "Pow2 and Oracle reservations); report the mean normalized latency "
    "(end-to-end latency / output tokens), throughput and mean batch."
)
COLORS = {
    "paged": "tab:red",
    "contiguous-oracle": "tab:blue",
    "contiguous-pow2": "tab:green",
    "contiguous-max": "tab:gray",
}


@dataclass(frozen=True)
class Preset:
    """One benchmark setting: the workload, the rates and the engine's pool."""

    device: str
    workload: str
    num_requests: int
    rates: tuple[float, ...]  # requests per second
    max_model_len: int  # what Max reserves; lengths are scaled to it
    block_size: int
    num_gpu_blocks: int
    length_scale: float = 1.0
    model: dict = field(default_factory=dict)  # make_tiny_model overrides


PRESETS = {
    # The tiny checkpoint at a 256-token context (ShareGPT's lengths / 8: about 62
    # tokens a request) on 1024 KV slots: Max holds 4 requests at once.  About 45 s on
    # one core.
    "cpu": Preset(
        "cpu",
        "sharegpt",
        num_requests=120,
        rates=(30, 60, 90, 120, 150),
        max_model_len=256,
        block_size=4,
        num_gpu_blocks=256,
    ),
    # A Llama-3.2-1B-shaped model in bfloat16 (the throughput benchmark's, sharing its
    # cached checkpoint) on the paper's setting at half the lengths: a 1024-token
    # context and half the paper's pool (OPT-13B on an A100-40GB: 15.7K slots), so the
    # batches are the paper's and every run takes half as long.  The rates are guesses
    # for a step of about 10 ms (Max's knee near 4 per second, paged's near 16): pass
    # --rates where the knees fall elsewhere.  Minutes: Max alone takes about
    # num_requests / 4 s at every rate past its knee.
    "gpu": Preset(
        "cuda",
        "sharegpt",
        num_requests=100,
        rates=(2, 4, 8, 12, 16),
        max_model_len=PAPER_CONTEXT // 2,
        block_size=16,
        num_gpu_blocks=OPT13B_A100_SLOTS // 2 // 16,
        model=GPU_MODEL,
    ),
}
SETTING = (
    "workload",
    "num_requests",
    "rates",
    "max_model_len",
    "block_size",
    "num_gpu_blocks",
    "length_scale",
)


def resolve_setting(preset: str, **overrides) -> dict:
    """``preset``'s `SETTING`, each value replaced by its override unless that is None
    (a command line's flags left out); `check_setting` checks the result."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {list(PRESETS)}, got {preset!r}")
    unknown = sorted(set(overrides) - set(SETTING))
    if unknown:
        raise ValueError(f"overrides must be among {SETTING}, got {unknown}")
    return with_overrides(PRESETS[preset], SETTING, overrides)


# -- the workload ---------------------------------------------------------------------
def check_setting(
    modes: Sequence[str], rates: Sequence[float], num_requests: int, length_scale: float
) -> None:
    """Raise ``ValueError`` naming the first bad value, before anything runs."""
    check_modes_and_rates(modes, rates)
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale!r}")


def check_modes_and_rates(modes: Sequence[str], rates: Sequence[float]) -> None:
    bad = [m for m in modes if m not in MEMORY_MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MEMORY_MODES}, got {list(modes)}")
    if not rates or any(
        isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf
        for r in rates
    ):
        raise ValueError(
            f"rates must be finite numbers > 0 (requests per second), got {list(rates)}"
        )


def make_requests(
    workload: str, num_requests: int, max_model_len: int, length_scale: float = 1.0, seed: int = 0
) -> list[RequestSpec]:
    """``workload``'s lengths scaled to ``max_model_len`` (see the module docstring);
    every request fits it."""
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale!r}")
    scale = length_scale * min(1.0, max_model_len / PAPER_CONTEXT)
    return blocksize.make_requests(workload, num_requests, scale, max_model_len, seed)


@dataclass
class Workload:
    workload: str
    requests: list[RequestSpec]
    prompts: list[list[int]]
    max_model_len: int


def make_workload(
    path,
    workload: str,
    num_requests: int,
    max_model_len: int,
    length_scale: float = 1.0,
    seed: int = 0,
) -> Workload:
    """The requests and their random prompt token ids for the checkpoint at ``path``."""
    from transformers import AutoTokenizer

    from minipaged.models.loader import read_config
    from minipaged.models.resolve import resolve_max_model_len

    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    config = read_config(Path(path))
    max_model_len = resolve_max_model_len(max_model_len, config)
    requests = make_requests(workload, num_requests, max_model_len, length_scale, seed)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts = make_prompts(requests, tokenizer, config.vocab_size, seed)
    return Workload(workload, requests, prompts, max_model_len)


# -- the metric -----------------------------------------------------------------------
def normalized_latency(
    arrivals: Sequence[float], finishes: Sequence[float], output_lens: Sequence[int]
) -> float:
    """The mean over requests of (finish - arrival) / output length, in seconds per
    output token (Fig. 12's y axis)."""
    if not len(arrivals) == len(finishes) == len(output_lens) > 0:
        raise ValueError(
            f"arrivals, finishes and output_lens must be non-empty and of one "
            f"length, got {len(arrivals)}, {len(finishes)}, {len(output_lens)}"
        )
    if any(n < 1 for n in output_lens):
        raise ValueError(f"output_lens must be >= 1, got {min(output_lens)}")
    if any(f < a for a, f in zip(arrivals, finishes)):
        raise ValueError("finishes must not come before their arrivals")
    return sum((f - a) / n for a, f, n in zip(arrivals, finishes, output_lens)) / len(arrivals)


# -- the driver -----------------------------------------------------------------------
@dataclass
class Served:
    """What `serve` saw: each request's finish time (seconds on the arrivals' clock)
    and output tokens, and the engine steps it took."""

    finishes: list[float]
    output_tokens: list[int]
    num_steps: int


def serve(
    engine,
    prompts: Sequence[list[int]],
    params: Sequence,
    arrivals: Sequence[float],
    clock: Callable[[], float] = time.perf_counter,
    tag: str = "",
) -> Served:
    """Serve requests ``i`` = 0, 1, ... (``prompts[i]``, ``params[i]``, arriving at
    ``arrivals[i]`` seconds, non-decreasing) on ``engine`` (an `LLMEngine`), one step at a
    time, until all have finished; request ids are ``f"{tag}{i}"``.  When the engine is
    idle the clock jumps to the next arrival (module docstring)."""
    pending = list(range(len(prompts)))[::-1]  # popped from the end: the next arrival
    finishes, tokens = [math.nan] * len(prompts), [0] * len(prompts)
    start, skipped, num_steps = clock(), 0.0, 0
    while pending or engine.has_unfinished_requests():
        now = clock() - start + skipped
        if not engine.has_unfinished_requests() and arrivals[pending[-1]] > now:
            skipped += arrivals[pending[-1]] - now
            now = arrivals[pending[-1]]
        while pending and arrivals[pending[-1]] <= now:
            i = pending.pop()
            engine.add_request(f"{tag}{i}", prompts[i], params[i])
        outputs = engine.step()
        num_steps += 1
        end = clock() - start + skipped
        for output in (o for o in outputs if o.finished):
            i = int(output.request_id.removeprefix(tag))
            finishes[i], tokens[i] = end, len(output.outputs[0].token_ids)
    return Served(finishes, tokens, num_steps)


def run_mode(
    path,
    mode: str,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    rates: Sequence[float],
    engine_kwargs: dict,
    seed: int = 0,
    bar: tqdm | None = None,
) -> list[dict]:
    """One engine in memory mode ``mode``, warmed up, then the workload at each rate:
    one row per rate."""
    from minipaged.llm import LLM
    from minipaged.sampling_params import SamplingParams

    llm = LLM(str(path), **{**engine_kwargs, "memory_mode": mode})
    engine = llm.engine
    # Warm-up: a lone request, then a batch, so the first timed steps pay no first-call costs.
    for count in (1, min(len(prompts), 8)):
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:count]],
            SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
    params = [
        SamplingParams(temperature=1.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    rows = []
    for k, rate in enumerate(rates):
        arrivals = arrival_times(len(requests), rate, seed)
        before = engine.stats()["num_preemptions"]
        served = serve(engine, prompts, params, arrivals, tag=f"{k}-")
        _check_run(llm, mode, served, requests)
        rows.append(
            _row(mode, rate, requests, arrivals, served, engine.stats()["num_preemptions"] - before)
        )
        if bar is not None:
            bar.update()
    return rows


def _check_run(llm, mode: str, served: Served, requests: Sequence[RequestSpec]) -> None:
    # ignore_eos: any other length is a bug, and its latency per token would be a lie.
    wrong = [i for i, (n, r) in enumerate(zip(served.output_tokens, requests)) if n != r.output_len]
    if wrong:
        i = wrong[0]
        raise RuntimeError(
            f"{mode}: request {i} generated {served.output_tokens[i]} tokens, "
            f"wanted {requests[i].output_len} ({len(wrong)} requests wrong)"
        )
    blocksize.check_all_free(llm)


def _row(
    mode: str,
    rate: float,
    requests: Sequence[RequestSpec],
    arrivals: Sequence[float],
    served: Served,
    num_preemptions: int,
) -> dict:
    output_lens = [r.output_len for r in requests]
    # From the first arrival (at 0) to the last finish: below a system's knee its rates
    # are the offered ones, past it what the system sustains.
    duration = max(served.finishes)
    return {
        "mode": mode,
        "rate": rate,
        "num_requests": len(requests),
        "normalized_latency_s_per_token": normalized_latency(
            arrivals, served.finishes, output_lens
        ),
        "mean_latency_s": sum(f - a for a, f in zip(arrivals, served.finishes)) / len(requests),
        "requests_per_s": len(requests) / duration,
        "output_tokens_per_s": sum(output_lens) / duration,
        # Every running sequence that reaches its end makes one token a step.
        "mean_batch": sum(output_lens) / served.num_steps,
        "num_steps": served.num_steps,
        "num_preemptions": num_preemptions,
        "duration_s": duration,
    }


def bench_latency(
    path,
    modes: Sequence[str],
    rates: Sequence[float],
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Each memory mode in ``modes`` at each of ``rates``: one row per (mode, rate), in
    that order.  ``engine_kwargs`` are `LLM`'s, less ``memory_mode``."""
    check_modes_and_rates(modes, rates)
    if not requests or len(prompts) != len(requests):
        raise ValueError(
            f"requests and prompts must be non-empty and of one length, "
            f"got {len(requests)} and {len(prompts)}"
        )
    from minipaged.models.resolve import resolve_device

    device = resolve_device(engine_kwargs.get("device", "auto"))
    rows = []
    with (
        one_cpu_thread(device),
        tqdm(
            total=len(modes) * len(rates), desc="bench latency", unit="run", disable=not progress
        ) as bar,
    ):
        for mode in modes:
            bar.set_postfix_str(mode)
            rows += run_mode(path, mode, requests, prompts, rates, engine_kwargs, seed, bar)
            free_memory(device)  # the last mode's engine, before the next loads
    return rows


# -- output ---------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    return common.format_table(
        rows,
        [
            Column("mode", "mode"),
            Column("rate/s", "rate", "{:g}"),
            Column("s/token", "normalized_latency_s_per_token", "{:.4f}"),
            Column("latency s", "mean_latency_s", "{:.3f}"),
            Column("mean batch", "mean_batch", "{:.1f}"),
            Column("req/s", "requests_per_s", "{:.1f}"),
            Column("out tok/s", "output_tokens_per_s", "{:.0f}"),
            Column("preempt", "num_preemptions"),
        ],
    )


def plot_latency(rows: list[dict], title: str = ""):
    """Fig. 12 beside Fig. 13: normalized latency against request rate, one curve per
    memory mode, and the mean batch.  The latency axis is logarithmic: the knees show
    (the paper cuts its axis at about 10x the lowest point instead), and no curve leaves
    the axes where latency explodes.  A matplotlib ``Figure``, no pyplot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    latency, batch = fig.subplots(1, 2, width_ratios=[3, 2])
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        rates = [r["rate"] for r in mine]
        style = dict(marker="o", label=mode, color=COLORS.get(mode))
        latency.plot(rates, [r["normalized_latency_s_per_token"] for r in mine], **style)
        batch.plot(rates, [r["mean_batch"] for r in mine], **style)
    latency.set_yscale("log")
    latency.set_xlabel("request rate (req/s)")
    latency.set_ylabel("normalized latency (s/token, log scale)")
    latency.set_title("latency under load (cf. Fig. 12)")
    latency.legend(fontsize="small")
    batch.set_xlabel("request rate (req/s)")
    batch.set_ylabel("mean requests batched")
    batch.set_title("batch size (cf. Fig. 13)")
    for ax in (latency, batch):
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, SYNTHETIC_MODEL_HELP)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default_preset(),
        help="cpu: the tiny checkpoint on a small KV pool, about 45 s; gpu: "
        "a Llama-3.2-1B-shaped random model on half the paper's pool at "
        "half the lengths (default: gpu if CUDA is available)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MEMORY_MODES,
        metavar="MODE",
        default=list(MEMORY_MODES),
        help=f"any of {', '.join(MEMORY_MODES)} (default: all)",
    )
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        metavar="R",
        help="request rates, per second (default: the preset's)",
    )
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="request lengths like this dataset's (default: the preset's)",
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        metavar="X",
        help="multiply the lengths (already scaled to --max-model-len) by X "
        "(default: the preset's)",
    )
    for flag, help_ in [
        ("--num-requests", "requests served at each rate"),
        ("--block-size", "token slots per KV block"),
        ("--num-gpu-blocks", "the KV pool's size in blocks"),
        ("--max-model-len", "the longest sequence: what Max reserves"),
    ]:
        parser.add_argument(flag, type=int, metavar="N", help=f"{help_} (default: the preset's)")
    add_output_flags(parser, "latency-<workload>")
    # The memory mode is what is compared; the pool's shape is the preset's.
    add_engine_flags(
        parser, exclude=("memory_mode", "block_size", "num_gpu_blocks", "max_model_len")
    )


def main(args) -> None:
    # A flag left out takes the preset's value.
    setting = resolve_setting(
        args.preset,
        workload=args.workload,
        num_requests=args.num_requests,
        rates=args.rates,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        length_scale=args.length_scale,
    )
    check_setting(args.modes, setting["rates"], setting["num_requests"], setting["length_scale"])
    device = preset_device(args.preset, PRESETS, args.device)
    model = bench_model(args, PRESETS)
    work = make_workload(
        model,
        setting["workload"],
        setting["num_requests"],
        setting["max_model_len"],
        setting["length_scale"],
        args.seed,
    )
    engine = {
        **engine_kwargs(args),
        "device": device.type,
        "block_size": setting["block_size"],
        "num_gpu_blocks": setting["num_gpu_blocks"],
        "max_model_len": work.max_model_len,
    }
    rows = bench_latency(
        model, args.modes, setting["rates"], work.requests, work.prompts, engine, seed=args.seed
    )
    print(format_table(rows))
    slots = setting["num_gpu_blocks"] * setting["block_size"]
    title = (
        f"{len(work.requests)} {work.workload}-like requests, {slots} KV slots, "
        f"max_model_len {work.max_model_len}, {device_name(device)}"
    )
    write(
        args,
        f"latency-{work.workload}",
        device,
        rows,
        plot_latency(rows, title),
        **model_record(args, model, device),
        engine=engine,
        modes=args.modes,
        workload={
            **setting,
            "seed": args.seed,
            "max_model_len": work.max_model_len,
            "prompt_lens": [r.prompt_len for r in work.requests],
            "output_lens": [r.output_len for r in work.requests],
        },
    )

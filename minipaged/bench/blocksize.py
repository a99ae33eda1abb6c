"""``minipaged bench block-size``: what the block size trades (paper §7.2, Fig. 18b).

A block is the unit the KV cache is handed out in (§4.2).  Small blocks waste little:
only a sequence's last block is partly empty, so its internal fragmentation is under
one block.  But an attention kernel finds and reads every block separately, and a GPU
reads a big block in fewer, wider loads, so too small a block underuses its memory
bandwidth (§5.1).  Large blocks waste more: a request of 10 tokens in a block of 256
holds 246 empty slots, which leaves room for fewer requests, so smaller batches.  The
paper finds 16 to 128 best on ShareGPT, 16 and 32 on Alpaca (whose requests are short),
and picks 16.

Every block size serves the same synthetic requests on the same KV pool of
``kv_slots`` token slots (``kv_slots // block_size`` blocks), measured two ways:

- **counts** (`count_block_sizes`): the paged system of `memory.simulate` serves the
  requests and reports the pool's shares (token states, internal fragmentation, free)
  and the mean number of requests resident, the batch.  No model, no clock;
- **time** (`run_engine`): ``LLM.generate`` serves them (``ignore_eos``, sampled at
  temperature 1, after a warm-up); output tokens per second are normalized to the best
  block size of the same workload in the same run.

The paper's Fig. 18b is the mean latency at a fixed request rate; ours is offline
throughput, which the same two forces move.  Which force shows depends on the kernel:
the ``gpu`` preset runs Triton, which walks the blocks of each sequence; on a CPU the
torch reference backend gathers the K/V of every position through the block table one
token at a time whatever the block size, so there only fragmentation (smaller batches
at large blocks) moves the numbers much: the longer block tables of small blocks cost
the engine's bookkeeping little, and the CPU curve is flat up to where the batch shrinks.

Lengths: drawn for a 2048-token context (the paper's OPT models), multiplied by the
preset's scale for the workload (the tiny CPU checkpoint has 1024 positions, so the CPU
preset shrinks ShareGPT's; Alpaca's already fit) and cut to the model's context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from tqdm.auto import tqdm

from minipaged.arg_utils import add_engine_flags, add_model_flag, engine_kwargs
from minipaged.bench import common
from minipaged.bench.args import (
    SYNTHETIC_MODEL_HELP,
    add_output_flags,
    bench_model,
    model_record,
    write,
)
from minipaged.bench.common import Column, free_memory, one_cpu_thread, timed
from minipaged.bench.presets import (
    GPU_MODEL,
    PAPER_CONTEXT,
    default_preset,
    make_prompts,
    preset_device,
    with_overrides,
)
from minipaged.bench.results import device_name
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS, MemoryReport, simulate_memory
from minipaged.core.memory.workloads import WORKLOADS, RequestSpec, synthetic_requests

NAME = "block-size"
HELP = "block size: internal fragmentation vs throughput (Fig. 18b)"
DESCRIPTION = (
    "Serve the same ShareGPT- and Alpaca-like requests on one KV pool in "
    "blocks of 1 to 256 tokens: the pool's internal fragmentation and mean "
    "batch (simulated, counts) and the engine's throughput (ignore_eos), "
    "normalized to the best block size of the workload."
)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROW_KEYS = (
    "workload",
    "block_size",
    "num_requests",
    "kv_slots",
    "num_gpu_blocks",
    "token_share",
    "internal_share",
    "free_share",
    "mean_batch",
    "sim_num_preemptions",
    "output_tokens",
    "elapsed_s",
    "output_tokens_per_s",
    "normalized_throughput",
    "num_steps",
    "num_preemptions",
)
# The sweep sets these per block size; a caller's value would be silently replaced.
SWEPT = ("block_size", "num_gpu_blocks", "swap_space")


@dataclass(frozen=True)
class Preset:
    """One benchmark setting: per workload, how many requests and what their drawn
    lengths are multiplied by; and the KV pool.  Each workload must keep the pool full
    (a request waiting) at every block size: `memory.simulate` averages over such
    steps, or over all steps where there are none, and a sweep that mixed the two
    would compare unlike averages."""

    device: str
    num_requests: dict[str, int]
    kv_slots: int
    length_scales: dict[str, float]
    model: dict = field(default_factory=dict)  # make_tiny_model overrides


PRESETS = {
    # The tiny checkpoint: ShareGPT / 4 (its 1024 positions halve it, then seconds halve
    # it again), Alpaca as drawn, on a pool both fill: about 30 s on one core.
    "cpu": Preset(
        "cpu",
        num_requests={"sharegpt": 96, "alpaca": 96},
        kv_slots=2048,
        length_scales={"sharegpt": 0.25, "alpaca": 1.0},
    ),
    # Full lengths on the paper's pool (OPT-13B's KV on an A100-40GB) and a Llama-3.2-1B
    # shaped model run by Triton; Alpaca needs twice the requests to fill that pool (at
    # the smallest blocks the simulation then batches ~300, the engine max_num_seqs).
    "gpu": Preset(
        "cuda",
        num_requests={"sharegpt": 200, "alpaca": 400},
        kv_slots=OPT13B_A100_SLOTS,
        length_scales={"sharegpt": 1.0, "alpaca": 1.0},
        model=GPU_MODEL,
    ),
}


def check_block_sizes(block_sizes: Sequence[int]) -> list[int]:
    """Distinct ints >= 1, ascending; ``ValueError`` naming the first bad one."""
    if not block_sizes:
        raise ValueError("block_sizes must not be empty")
    for size in block_sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"block_sizes must be ints >= 1, got {size!r}")
    return sorted(set(block_sizes))


def check_workloads(workloads: Sequence[str]) -> None:
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise ValueError(
            f"workloads must be a non-empty subset of {sorted(WORKLOADS)}, got {list(workloads)!r}"
        )


def check_engine_kwargs(engine_kwargs: dict, swept: Sequence[str] = SWEPT) -> None:
    if taken := [k for k in swept if k in engine_kwargs]:
        raise ValueError(f"engine_kwargs must not set {taken}: the benchmark sets them itself")


# -- the workload ---------------------------------------------------------------------
def make_requests(
    workload: str, num_requests: int, scale: float, max_model_len: int, seed: int = 0
) -> list[RequestSpec]:
    """``workload``-like lengths drawn for the paper's 2048-token context, times
    ``scale`` (rounded, at least 1), cut to fit ``max_model_len`` (output first)."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    requests = []
    for r in synthetic_requests(workload, num_requests, seed=seed, max_len=PAPER_CONTEXT):
        prompt = min(max(1, round(r.prompt_len * scale)), max_model_len - 1)
        output = min(max(1, round(r.output_len * scale)), max_model_len - prompt)
        requests.append(RequestSpec(prompt, output))
    return requests


# -- counts ---------------------------------------------------------------------------
def count_block_sizes(
    requests: list[RequestSpec], kv_slots: int, block_sizes: Sequence[int]
) -> dict[int, MemoryReport]:
    """The paged system's memory report per block size, on one pool of ``kv_slots``
    slots.  Raises ``ValueError`` if a request could never fit it."""
    try:
        return {size: simulate_memory(requests, "paged", kv_slots, size) for size in block_sizes}
    except ValueError as error:  # it names the simulation's argument, not ours
        raise ValueError(f"kv_slots={kv_slots} is too small: {error}") from error


# -- time -----------------------------------------------------------------------------
@dataclass
class EngineRun:
    """One timed ``LLM.generate``; the counters are differences over the timed run."""

    elapsed_s: float
    output_tokens: int
    num_steps: int
    num_preemptions: int
    num_swapped_out_blocks: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def run_engine(
    llm, requests: Sequence[RequestSpec], prompts: Sequence[list[int]], progress: bool = False
) -> EngineRun:
    """Serve all ``requests`` at once with ``llm`` after a warm-up, and time it."""
    from minipaged.sampling_params import SamplingParams

    engine = llm.engine
    # A lone request, then a full batch: every kernel the timed run launches (one and
    # many sequences, prefill and decode) is compiled before the clock starts.
    for count in (1, min(len(prompts), engine.config.max_num_seqs)):
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:count]],
            SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
    before = llm.stats()
    params = [
        SamplingParams(temperature=1.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    outputs, elapsed = timed(
        lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress),
        engine.device,
    )
    after = llm.stats()
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    if generated != [r.output_len for r in requests]:  # ignore_eos: anything else is a bug
        raise RuntimeError(
            f"the engine generated {sum(generated)} tokens, wanted "
            f"{sum(r.output_len for r in requests)}"
        )
    check_all_free(llm)
    return EngineRun(
        elapsed,
        sum(generated),
        after["num_steps"] - before["num_steps"],
        after["num_preemptions"] - before["num_preemptions"],
        after["num_swapped_out_blocks"] - before["num_swapped_out_blocks"],
    )


def check_all_free(llm) -> None:
    """A finished workload leaves every block of both pools free; one that
    does not has leaked memory, and whatever it measured is suspect."""
    stats = llm.stats()
    for pool in ("gpu", "cpu"):
        free, total = stats[f"num_free_{pool}_blocks"], stats[f"num_{pool}_blocks"]
        if free != total:
            raise RuntimeError(f"{total - free} of {total} {pool} blocks are still held")


# -- the whole benchmark --------------------------------------------------------------
def bench_block_size(
    path,
    workloads: Sequence[str],
    block_sizes: Sequence[int],
    num_requests: dict[str, int],
    kv_slots: int,
    length_scales: dict[str, float],
    engine_kwargs: dict,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """One row per (workload, block size): the simulation's counts and the engine's
    throughput on the same requests and pool.  Everything is checked (every request
    fits every pool, in the simulation) before the first engine starts."""
    from minipaged.llm import LLM
    from minipaged.models.loader import read_config
    from minipaged.models.resolve import resolve_device, resolve_max_model_len

    block_sizes = check_block_sizes(block_sizes)
    check_engine_kwargs(engine_kwargs)
    check_workloads(workloads)
    config = read_config(Path(path))
    max_model_len = resolve_max_model_len(engine_kwargs.get("max_model_len"), config)
    requests = {
        w: make_requests(w, num_requests[w], length_scales[w], max_model_len, seed)
        for w in workloads
    }
    counts = {w: count_block_sizes(requests[w], kv_slots, block_sizes) for w in workloads}
    device = resolve_device(engine_kwargs.get("device", "auto"))
    runs = {}
    with one_cpu_thread(device):
        for w, size in tqdm(
            [(w, s) for w in workloads for s in block_sizes],
            desc="block sizes",
            disable=not progress,
        ):
            llm = LLM(
                str(path),
                **engine_kwargs,
                block_size=size,
                num_gpu_blocks=kv_slots // size,
                swap_space=0,
            )
            prompts = make_prompts(requests[w], llm.get_tokenizer(), llm.engine.vocab_size, seed)
            runs[w, size] = run_engine(llm, requests[w], prompts)
            del llm
            free_memory(device)
    return rows(requests, kv_slots, counts, runs)


def rows(
    requests: dict[str, list[RequestSpec]],
    kv_slots: int,
    counts: dict[str, dict[int, MemoryReport]],
    runs: dict[tuple[str, int], EngineRun],
) -> list[dict]:
    """`ROW_KEYS` per (workload, block size); throughput normalized per workload."""
    out = []
    for w, reports in counts.items():
        best = max(runs[w, size].output_tokens_per_s for size in reports)
        for size, report in reports.items():
            run = runs[w, size]
            out.append(
                {
                    "workload": w,
                    "block_size": size,
                    "num_requests": len(requests[w]),
                    "kv_slots": kv_slots,
                    "num_gpu_blocks": kv_slots // size,
                    "token_share": report.token_share,
                    "internal_share": report.internal_share,
                    "free_share": report.free_share,
                    "mean_batch": report.max_batch,
                    "sim_num_preemptions": report.num_preemptions,
                    "output_tokens": run.output_tokens,
                    "elapsed_s": run.elapsed_s,
                    "output_tokens_per_s": run.output_tokens_per_s,
                    "normalized_throughput": run.output_tokens_per_s / best,
                    "num_steps": run.num_steps,
                    "num_preemptions": run.num_preemptions,
                }
            )
    return out


# -- output ---------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    return common.format_table(
        rows,
        [
            Column("workload", "workload"),
            Column("block", "block_size"),
            Column("tokens", "token_share", "{:.1%}"),
            Column("internal", "internal_share", "{:.1%}"),
            Column("batch", "mean_batch", "{:.1f}"),
            Column("steps", "num_steps"),
            Column("preempt", "num_preemptions"),
            Column("tok/s", "output_tokens_per_s", "{:.0f}"),
            Column("vs best", "normalized_throughput", "{:.2f}"),
        ],
    )


def plot_block_size(rows: list[dict], device: str = "") -> Figure:
    """Against the block size, per workload: the pool's internal fragmentation and the
    mean batch (simulated), and the engine's normalized throughput (cf. Fig. 18b)."""
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    axes = fig.subplots(1, 3)
    panels = [
        ("internal_share", 100, "internal fragmentation (% of the pool)"),
        ("mean_batch", 1, "mean requests resident (simulated)"),
        ("normalized_throughput", 1, "throughput / best block size"),
    ]
    for ax, (key, factor, label) in zip(axes, panels):
        for workload in dict.fromkeys(r["workload"] for r in rows):
            ours = [r for r in rows if r["workload"] == workload]
            ax.plot(
                [r["block_size"] for r in ours],
                [factor * r[key] for r in ours],
                marker="o",
                label=workload,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted({r["block_size"] for r in rows}),
            labels=[str(s) for s in sorted({r["block_size"] for r in rows})],
        )
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
    axes[0].legend()
    counts = ", ".join(
        f"{r['num_requests']} {r['workload']}"
        for r in rows
        if r["block_size"] == rows[0]["block_size"]
    )
    fig.suptitle(
        f"block size{f' on {device}' if device else ''}: {counts}-like requests, "
        f"{rows[0]['kv_slots']} KV slots (cf. Fig. 18b)"
    )
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, SYNTHETIC_MODEL_HELP)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default_preset(),
        help="cpu: the tiny checkpoint, short requests, about 30 s; gpu: a "
        "Llama-3.2-1B-shaped random model, full-length requests on the "
        "paper's KV pool (default: gpu if CUDA is available)",
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=["sharegpt", "alpaca"],
        metavar="WORKLOAD",
        help="request lengths like these datasets' (default: sharegpt alpaca)",
    )
    parser.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        metavar="N",
        default=list(BLOCK_SIZES),
        help="(default: 1 2 4 ... 256)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help="requests of every workload (default: the preset's)",
    )
    parser.add_argument(
        "--kv-slots",
        type=int,
        metavar="N",
        help="tokens the KV pool holds at every block size (default: the preset's)",
    )
    add_output_flags(parser, NAME)
    # The block size, the pool and the swap space are what the sweep sets itself.
    add_engine_flags(parser, exclude=SWEPT)


def main(args) -> None:
    preset = PRESETS[args.preset]
    device = preset_device(args.preset, PRESETS, args.device)
    num_requests = {
        w: preset.num_requests[w] if args.num_requests is None else args.num_requests
        for w in args.workloads
    }
    kv_slots = with_overrides(preset, ("kv_slots",), vars(args))["kv_slots"]
    model = bench_model(args, PRESETS)
    engine = {**engine_kwargs(args), "device": device.type}
    rows = bench_block_size(
        model,
        args.workloads,
        args.block_sizes,
        num_requests,
        kv_slots,
        preset.length_scales,
        engine,
        args.seed,
    )
    print(format_table(rows))
    write(
        args,
        NAME,
        device,
        rows,
        plot_block_size(rows, device_name(device)),
        **model_record(args, model, device),
        engine=engine,
        workloads={
            w: {"num_requests": num_requests[w], "length_scale": preset.length_scales[w]}
            for w in args.workloads
        },
        kv_slots=kv_slots,
        block_sizes=sorted(set(args.block_sizes)),
        seed=args.seed,
    )

"""``minipaged bench sharing``: KV blocks saved by sharing them (paper §4.4, §6.3 Fig. 15).

Parallel sampling (``n`` completions of one prompt) and beam search (``beam_width``
beams) run many sequences that begin alike.  Paged memory lets them share those blocks
copy-on-write (lesson 03).  This benchmark serves synthetic requests with the real
engine and, after every step, counts the GPU blocks in use (a shared block counted once)
against the blocks the same sequences would hold if each kept its own copy (every
sequence's block table in full).  The saving is one minus their ratio, summed over all
steps: the share of KV memory that sharing freed, as Fig. 15 reports it.

Counts, not times: the tiny checkpoint on a CPU gives the same counts as a real model
would, given the same lengths (with ``ignore_eos``, every completion and beam runs to its
drawn length).  The KV pool is the paper's OPT-13B on an A100-40GB (about 15.7K token
slots); prompts and outputs are cut to fit the tiny model's 1024 positions.

The paper: 6.1-9.8% saved by parallel sampling and 37.6-55.2% by beam search on Alpaca;
16.2-30.5% and 44.3-66.3% on ShareGPT (n and beam width 2, 4, 6).
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure
from tqdm.auto import tqdm

from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column
from minipaged.bench.presets import make_prompts
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS
from minipaged.core.memory.workloads import (
    SHARING_NUM_REQUESTS,
    WORKLOADS,
    RequestSpec,
    synthetic_requests,
)
from minipaged.llm import LLM
from minipaged.models.tiny import BASE_CONFIG, cached_checkpoint
from minipaged.sampling_params import BeamSearchParams, SamplingParams

NAME = "sharing"
HELP = "KV memory saved by sharing blocks: parallel sampling, beam search (Fig. 15)"
DESCRIPTION = (
    "Serve synthetic requests with the engine on the tiny checkpoint and the "
    "paper's KV pool, with n completions or beams each; count blocks in use "
    "against the blocks the same sequences would hold without sharing."
)
MODES = ("parallel", "beam")
WIDTHS = (2, 4, 6)
MAX_LEN = BASE_CONFIG["max_position_embeddings"]  # the tiny checkpoint's positions


@dataclass
class SharingRun:
    mode: str  # "parallel" (n completions) or "beam" (beam_width beams)
    width: int
    used_blocks: int  # summed over steps: blocks in use, shared ones once
    unshared_blocks: int  # summed over steps: blocks if no sequence shared any
    num_steps: int

    @property
    def saving(self) -> float:
        return 1 - self.used_blocks / self.unshared_blocks


def params_for(mode: str, width: int, max_tokens: int, seed: int):
    """What one request asks for: ``width`` completions or beams of ``max_tokens``."""
    if mode == "parallel":
        return SamplingParams(n=width, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    if mode == "beam":
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def measure_sharing(
    llm: LLM, prompts: list[list[int]], output_lens: list[int], mode: str, width: int
) -> SharingRun:
    """Serve the requests to completion, counting blocks with and without sharing after
    every step.  Leaves the engine empty."""
    engine = llm.engine
    for i, (prompt, output_len) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"{mode}{width}-{i}", prompt, params_for(mode, width, output_len, i))
    run = SharingRun(mode, width, 0, 0, 0)
    while engine.has_unfinished_requests():
        engine.step()
        tables = [t for t in engine.kv.tables.values() if t.allocator is engine.kv.gpu]
        run.used_blocks += len({b for t in tables for b in t.blocks})
        run.unshared_blocks += sum(len(t.blocks) for t in tables)
        run.num_steps += 1
    return run


def sharing_workload(
    workload: str, num_requests: int | None = None, seed: int = 0
) -> list[RequestSpec]:
    """The requests ``bench sharing`` serves: the course's workload unless
    ``num_requests`` is given, cut to the tiny checkpoint's positions.  Lesson 03 counts
    blocks for the same requests by hand."""
    if num_requests is None:
        num_requests = SHARING_NUM_REQUESTS[workload]
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    return synthetic_requests(workload, num_requests, seed=seed, max_len=MAX_LEN)


def bench_sharing(
    workload: str,
    num_requests: int | None = None,
    modes=MODES,
    widths=WIDTHS,
    kv_slots: int = OPT13B_A100_SLOTS,
    block_size: int = 16,
    seed: int = 0,
) -> list[SharingRun]:
    """Every (mode, width) on the same requests, one engine, a fresh pool each time."""
    requests = sharing_workload(workload, num_requests, seed)
    path = cached_checkpoint("bench-sharing")
    llm = LLM(
        path,
        device="cpu",
        block_size=block_size,
        num_gpu_blocks=kv_slots // block_size,
        swap_space=0,
        seed=seed,
        enable_prefix_caching=False,  # what forks share (§6.3), not what the cache keeps
    )
    assert llm.engine.max_model_len == MAX_LEN
    prompts = make_prompts(requests, llm.get_tokenizer(), llm.engine.vocab_size, seed)
    runs = []
    for mode, width in tqdm([(m, w) for m in modes for w in widths], desc="sharing runs"):
        runs.append(measure_sharing(llm, prompts, [r.output_len for r in requests], mode, width))
    return runs


def rows(runs: list[SharingRun], workload: str) -> list[dict]:
    return [
        {
            "workload": workload,
            "mode": r.mode,
            "width": r.width,
            "saving": r.saving,
            "used_blocks": r.used_blocks,
            "unshared_blocks": r.unshared_blocks,
            "num_steps": r.num_steps,
        }
        for r in runs
    ]


def format_table(runs: list[SharingRun]) -> str:
    return common.format_table(
        rows(runs, workload=None),
        [
            Column("mode", "mode"),
            Column("width", "width"),
            Column("saved", "saving", "{:.1%}"),
            Column("steps", "num_steps"),
        ],
    )


def plot_sharing(runs: list[SharingRun], title: str) -> Figure:
    """Fig. 15's bars: memory saved against n (parallel) and beam width (beam)."""
    fig = Figure(figsize=(8, 3.5), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, mode, label in zip(axes, MODES, ("parallel sampling: n", "beam search: width")):
        ours = [r for r in runs if r.mode == mode]
        bars = ax.bar(
            [str(r.width) for r in ours],
            [100 * r.saving for r in ours],
            color="#55a868" if mode == "parallel" else "#4c72b0",
        )
        ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
        ax.set_xlabel(label)
    axes[0].set_ylabel("KV memory saved by sharing (%)")
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="alpaca",
        help="request lengths like this dataset's (default: %(default)s)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help="(default: the course's workload, "
        + ", ".join(f"{n} {w}" for w, n in SHARING_NUM_REQUESTS.items())
        + ")",
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[2, 4, 6],
        metavar="N",
        help="n for parallel sampling, beam width for beam search (default: 2 4 6)",
    )
    parser.add_argument(
        "--kv-slots",
        type=int,
        default=OPT13B_A100_SLOTS,
        metavar="N",
        help="tokens the KV pool holds (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_output_flags(parser, "sharing-<workload>")


def main(args) -> None:
    if args.num_requests is None:
        args.num_requests = SHARING_NUM_REQUESTS[args.workload]
    runs = bench_sharing(
        args.workload, args.num_requests, widths=args.widths, kv_slots=args.kv_slots, seed=args.seed
    )
    print(f"{args.num_requests} {args.workload}-like requests on {args.kv_slots} KV slots")
    print(format_table(runs))
    title = f"{args.num_requests} {args.workload}-like requests, {args.kv_slots} KV slots"
    # Counts, not times: the same on any machine, so always under cpu/.
    write(
        args,
        f"sharing-{args.workload}",
        "cpu",
        rows(runs, args.workload),
        plot_sharing(runs, title),
        workload=args.workload,
        kv_slots=args.kv_slots,
        num_requests=args.num_requests,
        seed=args.seed,
    )

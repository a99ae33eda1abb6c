"""``minipaged bench prefix``: a prompt prefix every request shares, cached once (paper
§4.4, §6.4).

The paper's §6.4 prepends the same few-shot examples to every request of a translation
workload: a 1-shot prefix of 80 tokens, or a 5-shot one of 341.  With prefix caching
the prefix's full KV blocks are computed once and found again by every later request
(lesson 04), so a request's prefill runs only its own suffix.

Here every request is that prefix (random token ids, the same for all) followed by a
suffix and an output of Alpaca-like lengths (short, like a sentence to translate).  The
same requests run with caching off and on, in the same process, and we report the
cache's hit rate (the share of prompt tokens whose KV was found), the prefill tokens
actually computed, and throughput, whose ratio on/off is the speed-up (a ratio within
one run, so it means something on any machine; the counts are the same everywhere).
Prefix caching is on by default (as in vLLM V1), so it must cost nothing where it finds
nothing: `bench_overhead` runs workloads that share no prefix with caching off and on,
alternating, and reports the throughput ratio's median and spread over the repeats
(the cache hashes each block once, when it fills, and a lookup stops at the first miss).
On a CPU torch runs on one thread (`bench.common.one_cpu_thread`): a tiny model's tensors gain
nothing from more, and threads competing for busy cores make timings erratic.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from matplotlib.figure import Figure

from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, one_cpu_thread
from minipaged.bench.presets import make_prompts
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS
from minipaged.core.memory.workloads import synthetic_requests
from minipaged.llm import LLM
from minipaged.models.tiny import cached_checkpoint
from minipaged.sampling_params import SamplingParams

NAME = "prefix"
HELP = "a shared few-shot prefix with prefix caching off and on (§6.4)"
DESCRIPTION = (
    "Every request is one shared prefix (the paper's 1-shot 80 tokens or "
    "5-shot 341 tokens) plus its own Alpaca-like suffix; run them with prefix "
    "caching off and on; report the hit rate, prefill tokens computed and "
    "throughput.  Then what caching costs where nothing is shared: repeats of "
    "prompts with no prefix in common, off and on, and the throughput ratio."
)
PREFIXES = {"1-shot": 80, "5-shot": 341}  # the paper's prefix lengths, in tokens


@dataclass
class PrefixRun:
    prefix: str
    caching: bool
    hit_rate: float  # of prompt tokens looked up, the share found in the cache
    prompt_tokens: int
    computed_prompt_tokens: int  # prefill tokens that actually ran
    output_tokens: int
    elapsed_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def make_requests(
    prefix_len: int, num_requests: int, tokenizer, vocab_size: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Prompts (one shared prefix + each request's suffix) and output lengths."""
    specs = synthetic_requests("alpaca", num_requests, seed=seed, max_len=512)
    suffixes = make_prompts(specs, tokenizer, vocab_size, seed)
    prefix = random.Random(f"prefix-{seed}").choices(
        sorted({t for s in suffixes for t in s}), k=prefix_len
    )
    return [prefix + s for s in suffixes], [s.output_len for s in specs]


def make_llm(path, caching: bool, kv_slots: int, block_size: int, seed: int) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        block_size=block_size,
        swap_space=0,
        seed=seed,
        num_gpu_blocks=kv_slots // block_size,
        enable_prefix_caching=caching,
    )


def timed_generate(llm: LLM, prompts: list[list[int]], output_lens: list[int]):
    """Run ``prompts`` to their ``output_lens`` at once: (prompt tokens, those found in
    the prefix cache, output tokens, seconds, CPU seconds of this process)."""
    engine = llm.engine
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in output_lens]
    before = engine.counters()
    hits_before = getattr(engine.kv.gpu, "num_hit_tokens", 0)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    hits = getattr(engine.kv.gpu, "num_hit_tokens", 0) - hits_before
    prompt_tokens = engine.counters()["num_prompt_tokens"] - before["num_prompt_tokens"]
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return prompt_tokens, hits, output_tokens, elapsed, cpu


def run_prefix(
    path,
    prefix: str,
    caching: bool,
    num_requests: int,
    kv_slots: int = OPT13B_A100_SLOTS,
    block_size: int = 16,
    seed: int = 0,
) -> PrefixRun:
    """All requests at once through ``LLM.generate``, after an untimed warm-up on the
    same prompts reversed: the same shapes, but no prefix in common with the timed
    requests (a warm cache would flatter them)."""
    llm = make_llm(path, caching, kv_slots, block_size, seed)
    prompts, output_lens = make_requests(
        PREFIXES[prefix], num_requests, llm.get_tokenizer(), llm.engine.vocab_size, seed
    )
    timed_generate(llm, [p[::-1] for p in prompts], output_lens)
    prompt_tokens, hits, output_tokens, elapsed, _ = timed_generate(llm, prompts, output_lens)
    return PrefixRun(
        prefix,
        caching,
        hits / prompt_tokens,
        prompt_tokens,
        prompt_tokens - hits,
        output_tokens,
        elapsed,
    )


# -- what caching costs when nothing is shared ----------------------------------------
@dataclass
class OverheadRun:
    """One repeat of a workload that shares no prefix, run with caching off and on."""

    repeat: int
    hit_rate: float  # with caching on: ~0, nothing is shared
    output_tokens: int
    elapsed_off_s: float
    elapsed_on_s: float
    cpu_off_s: float  # this process's CPU time: what other work on the machine disturbs least
    cpu_on_s: float

    @property
    def ratio(self) -> float:
        """Throughput with caching on over off (the same tokens: time off over on)."""
        return self.elapsed_off_s / self.elapsed_on_s

    @property
    def cpu_ratio(self) -> float:
        """The same in CPU time (torch runs on one thread here, so CPU time is the work)."""
        return self.cpu_off_s / self.cpu_on_s


def bench_overhead(
    num_requests: int,
    repeats: int,
    kv_slots: int = OPT13B_A100_SLOTS,
    block_size: int = 16,
    seed: int = 0,
) -> list[OverheadRun]:
    """What prefix caching costs where it finds nothing (vLLM V1's "zero-overhead"
    prefix caching): ``repeats`` workloads of ``num_requests`` Alpaca-like prompts
    with no prefix in common, each through an engine with caching off and one with it
    on, alternating which goes first; the on engine keeps its cache across repeats,
    so later repeats also pay for evicting what earlier ones cached."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    path = cached_checkpoint("bench-sharing")
    with one_cpu_thread("cpu"):
        llms = {c: make_llm(path, c, kv_slots, block_size, seed) for c in (False, True)}
        tokenizer, vocab_size = llms[False].get_tokenizer(), llms[False].engine.vocab_size
        warm_up = make_requests(0, num_requests, tokenizer, vocab_size, seed + repeats)
        for llm in llms.values():
            timed_generate(llm, *warm_up)
        runs = []
        for repeat in range(repeats):
            prompts, output_lens = make_requests(
                0, num_requests, tokenizer, vocab_size, seed + repeat
            )
            timed = {}
            for caching in (False, True) if repeat % 2 == 0 else (True, False):
                timed[caching] = timed_generate(llms[caching], prompts, output_lens)
            prompt_tokens, hits, output_tokens, on_s, cpu_on_s = timed[True]
            _, _, _, off_s, cpu_off_s = timed[False]
            runs.append(
                OverheadRun(
                    repeat, hits / prompt_tokens, output_tokens, off_s, on_s, cpu_off_s, cpu_on_s
                )
            )
        return runs


def overhead_summary(runs: list[OverheadRun]) -> dict:
    """The ratios' medians over the repeats, and their spread (lowest, highest), in
    wall-clock and in CPU time."""
    summary = {"hit_rate": max(r.hit_rate for r in runs), "repeats": len(runs)}
    for name in ("ratio", "cpu_ratio"):
        ratios = [getattr(r, name) for r in runs]
        summary |= {
            f"{name}_median": statistics.median(ratios),
            f"{name}_min": min(ratios),
            f"{name}_max": max(ratios),
        }
    return summary


def bench_prefix(
    num_requests: int,
    prefixes=tuple(PREFIXES),
    kv_slots: int = OPT13B_A100_SLOTS,
    block_size: int = 16,
    seed: int = 0,
) -> list[PrefixRun]:
    """Each prefix with caching off, then on, on the tiny checkpoint."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    bad = [p for p in prefixes if p not in PREFIXES]
    if bad or not prefixes:
        raise ValueError(f"prefixes must be some of {list(PREFIXES)}, got {list(prefixes)}")
    path = cached_checkpoint("bench-sharing")
    with one_cpu_thread("cpu"):
        return [
            run_prefix(path, prefix, caching, num_requests, kv_slots, block_size, seed)
            for prefix in prefixes
            for caching in (False, True)
        ]


def rows(runs: list[PrefixRun]) -> list[dict]:
    return [
        {
            "prefix": r.prefix,
            "prefix_len": PREFIXES[r.prefix],
            "caching": r.caching,
            "hit_rate": r.hit_rate,
            "prompt_tokens": r.prompt_tokens,
            "computed_prompt_tokens": r.computed_prompt_tokens,
            "output_tokens": r.output_tokens,
            "elapsed_s": r.elapsed_s,
            "output_tokens_per_s": r.output_tokens_per_s,
            "speedup": r.output_tokens_per_s / _off(runs, r.prefix).output_tokens_per_s,
        }
        for r in runs
    ]


def _off(runs: list[PrefixRun], prefix: str) -> PrefixRun:
    return next(r for r in runs if r.prefix == prefix and not r.caching)


def format_table(runs: list[PrefixRun]) -> str:
    return common.format_table(
        rows(runs),
        [
            Column("prefix", "prefix"),
            Column("caching", lambda r: "on" if r["caching"] else "off"),
            Column("hit rate", "hit_rate", "{:.1%}"),
            Column("prefill tokens", "computed_prompt_tokens"),
            Column("tokens/s", "output_tokens_per_s", "{:.0f}"),
            Column("speed-up", "speedup", "{:.2f}x"),
        ],
    )


def plot_prefix(runs: list[PrefixRun], title: str, overhead: list[OverheadRun] = ()) -> Figure:
    """Prefill tokens computed and throughput, caching off vs on, per prefix; with
    ``overhead``, a third panel: each repeat's on/off ratio with nothing shared."""
    fig = Figure(figsize=(13 if overhead else 9, 3.5), layout="constrained")
    axes = fig.subplots(1, 3 if overhead else 2)
    computed, speed = axes[0], axes[1]
    prefixes = list(dict.fromkeys(r.prefix for r in runs))
    for offset, caching, colour in ((-0.2, False, "#c44e52"), (0.2, True, "#55a868")):
        ours = [next(r for r in runs if r.prefix == p and r.caching == caching) for p in prefixes]
        label = "caching on" if caching else "caching off"
        xs = [i + offset for i in range(len(prefixes))]
        computed.bar(xs, [r.computed_prompt_tokens for r in ours], 0.4, color=colour, label=label)
        bars = speed.bar(xs, [r.output_tokens_per_s for r in ours], 0.4, color=colour, label=label)
        if caching:
            speed.bar_label(bars, [f"{r.hit_rate:.0%} hit" for r in ours], fontsize=8)
    for ax, ylabel in ((computed, "prefill tokens computed"), (speed, "output tokens / s")):
        ax.set_xticks(range(len(prefixes)), prefixes)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    if overhead:
        plot_overhead(axes[2], overhead)
    fig.suptitle(title)
    return fig


def plot_overhead(ax, overhead: list[OverheadRun]) -> None:
    summary = overhead_summary(overhead)
    repeats = [r.repeat for r in overhead]
    for name, colour, label in (("ratio", "#4c72b0", "wall"), ("cpu_ratio", "#dd8452", "CPU")):
        ax.scatter(repeats, [getattr(r, name) for r in overhead], color=colour, label=label)
        ax.axhline(summary[f"{name}_median"], color=colour, label=f"{label} median")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(0.98, color="#c44e52", linestyle="--", label="2% cost")
    ax.set_xlabel("repeat (nothing shared)")
    ax.set_xticks(repeats)
    ax.set_ylabel("throughput, caching on / off")
    ax.legend(fontsize=8)


def format_overhead(overhead: list[OverheadRun]) -> str:
    summary = overhead_summary(overhead)
    table = common.format_table(
        [
            {
                "repeat": r.repeat,
                "off": r.output_tokens / r.elapsed_off_s,
                "on": r.output_tokens / r.elapsed_on_s,
                "ratio": r.ratio,
                "cpu_ratio": r.cpu_ratio,
                "hit_rate": r.hit_rate,
            }
            for r in overhead
        ],
        [
            Column("repeat", "repeat"),
            Column("tokens/s off", "off", "{:.0f}"),
            Column("tokens/s on", "on", "{:.0f}"),
            Column("on / off", "ratio", "{:.3f}x"),
            Column("in CPU time", "cpu_ratio", "{:.3f}x"),
            Column("hit rate", "hit_rate", "{:.1%}"),
        ],
    )
    return f"{table}\nnothing shared, caching on / off over {summary['repeats']} repeats: " + (
        ", ".join(
            f"{label} {summary[f'{name}_median']:.3f}x median ({summary[f'{name}_min']:.3f}x "
            f"to {summary[f'{name}_max']:.3f}x)"
            for name, label in (("ratio", "wall-clock"), ("cpu_ratio", "CPU time"))
        )
    )


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--num-requests", type=int, default=100, metavar="N", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--prefixes",
        nargs="+",
        default=["1-shot", "5-shot"],
        metavar="PREFIX",
        help="1-shot and/or 5-shot (default: both)",
    )
    parser.add_argument(
        "--kv-slots",
        type=int,
        default=OPT13B_A100_SLOTS,
        metavar="N",
        help="tokens the KV pool holds (default: %(default)s)",
    )
    parser.add_argument(
        "--overhead-repeats",
        type=int,
        default=5,
        metavar="N",
        help="repeats of a workload sharing no prefix, caching off and on, for what "
        "caching costs where it finds nothing; 0: none (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_output_flags(parser, NAME)


def main(args) -> None:
    runs = bench_prefix(args.num_requests, args.prefixes, args.kv_slots, seed=args.seed)
    print(format_table(runs))
    overhead = []
    if args.overhead_repeats:
        overhead = bench_overhead(
            args.num_requests, args.overhead_repeats, args.kv_slots, seed=args.seed
        )
        print(format_overhead(overhead))
    title = f"{args.num_requests} requests sharing a few-shot prefix, tiny model on a CPU"
    write(
        args,
        NAME,
        "cpu",
        rows(runs),
        plot_prefix(runs, title, overhead),
        num_requests=args.num_requests,
        kv_slots=args.kv_slots,
        seed=args.seed,
        overhead=[{**vars(r), "ratio": r.ratio, "cpu_ratio": r.cpu_ratio} for r in overhead],
        overhead_summary=overhead_summary(overhead) if overhead else None,
    )

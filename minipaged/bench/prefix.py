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
On a CPU torch runs on one thread (`bench.common.one_cpu_thread`): a tiny model's tensors gain
nothing from more, and threads competing for busy cores make timings erratic.
"""

from __future__ import annotations

import random
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
    "throughput."
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
    llm = LLM(
        str(path),
        device="cpu",
        block_size=block_size,
        swap_space=0,
        seed=seed,
        num_gpu_blocks=kv_slots // block_size,
        enable_prefix_caching=caching,
    )
    engine = llm.engine
    prompts, output_lens = make_requests(
        PREFIXES[prefix], num_requests, llm.get_tokenizer(), engine.vocab_size, seed
    )
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts], params, use_tqdm=False)
    before = engine.counters()
    hits_before = getattr(engine.kv.gpu, "num_hit_tokens", 0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    hits = getattr(engine.kv.gpu, "num_hit_tokens", 0) - hits_before
    prompt_tokens = engine.counters()["num_prompt_tokens"] - before["num_prompt_tokens"]
    return PrefixRun(
        prefix,
        caching,
        hits / prompt_tokens,
        prompt_tokens,
        prompt_tokens - hits,
        sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed,
    )


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


def plot_prefix(runs: list[PrefixRun], title: str) -> Figure:
    """Prefill tokens computed and throughput, caching off vs on, per prefix."""
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    computed, speed = fig.subplots(1, 2)
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
    fig.suptitle(title)
    return fig


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
    parser.add_argument("--seed", type=int, default=0)
    add_output_flags(parser, NAME)


def main(args) -> None:
    runs = bench_prefix(args.num_requests, args.prefixes, args.kv_slots, seed=args.seed)
    print(format_table(runs))
    title = f"{args.num_requests} requests sharing a few-shot prefix, tiny model on a CPU"
    write(
        args,
        NAME,
        "cpu",
        rows(runs),
        plot_prefix(runs, title),
        num_requests=args.num_requests,
        kv_slots=args.kv_slots,
        seed=args.seed,
    )

"""``minipaged bench kv-cache-dtype``: what a quantized KV cache buys and costs.

A byte per cached element instead of bf16's two (``kv_cache_dtype`` fp8 or int8,
`minipaged.ops.kv_quant`) fits twice the blocks in the same memory.  Two parts
(``--parts``), each against ``auto`` (the model's dtype) in the same run.  **serving**
(``kv-cache-dtype.json``):

- **capacity and throughput** where memory binds: the same requests under one small KV
  budget (``--kv-budget-mib``) per dtype: blocks, the most requests running at once,
  preemptions, requests per second.  The dtypes take turns, ``--rounds`` times, and
  each keeps its best round (the machine may be shared: a slow round is others' load).
  The model is the tiny checkpoint in bf16 (``--capacity-model``): what binds is the
  pool's bytes, which scale with the model alike, and it runs in seconds on a CPU;
- **the dequantization's cost** where memory does not bind: the C++ CPU kernel's decode
  over one batch of SmolLM2-shaped sequences, whose cache is read as bf16, or widened
  from fp8 / int8 and scaled, timed alternately; times ``num_hidden_layers``, a step's.

**quality** (``kv-cache-dtype-quality.json``) on real weights (``--model``, SmolLM2):
prompt logprobs, greedy agreement and the lm-eval test's multiple-choice accuracy
against ``auto``'s (`minipaged.bench.kv_quality`).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from minipaged.bench import common, kv_quality
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, one_cpu_thread
from minipaged.config import KV_CACHE_DTYPES
from minipaged.llm import LLM
from minipaged.models.tiny import cached_checkpoint
from minipaged.sampling_params import SamplingParams

NAME = "kv-cache-dtype"
HELP = "a quantized KV cache (fp8, int8) against auto: capacity, throughput, cost, quality"
DESCRIPTION = (
    "Run the same requests under one small KV budget with each kv_cache_dtype "
    "(blocks, peak running requests, preemptions, requests/s), time the C++ kernel's "
    "dequantization where memory does not bind, and compare greedy completions and "
    "their logprobs with auto's."
)
DTYPES = ("auto", "fp8", "int8")
PARTS = ("serving", "quality")


@dataclass
class CapacityRun:
    kv_cache_dtype: str
    num_gpu_blocks: int
    block_bytes: int
    peak_running: int
    num_preemptions: int
    num_requests: int
    elapsed_s: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s


def workload(num_requests: int, vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Random prompts of 64-192 tokens with 64-128 tokens to generate each."""
    rng = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, vocab_size, (int(n),), generator=rng).tolist()
        for n in torch.randint(64, 193, (num_requests,), generator=rng)
    ]
    return prompts, torch.randint(64, 129, (num_requests,), generator=rng).tolist()


def run_capacity(model, kv_cache_dtype, prompts, output_lens, kv_budget_mib) -> CapacityRun:
    """Serve every request to its length under a KV pool of ``kv_budget_mib``, in bf16."""
    llm = LLM(
        model,
        device="cpu",
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        cpu_kv_space=kv_budget_mib / 1024,
    )
    engine = llm.engine
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, ignore_eos=True, seed=i))
    peak, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    return CapacityRun(
        kv_cache_dtype,
        stats["num_gpu_blocks"],
        stats["kv_cache_block_bytes"],
        peak,
        stats["num_preemptions"],
        len(prompts),
        elapsed,
    )


def bench_capacity(model, dtypes, num_requests, kv_budget_mib, rounds, seed) -> list[CapacityRun]:
    """Each dtype's best of ``rounds`` runs, the dtypes taking turns."""
    from minipaged.models.loader import read_config

    prompts, output_lens = workload(num_requests, read_config(model).vocab_size, seed)
    best: dict[str, CapacityRun] = {}
    order = [d for _ in range(rounds) for d in dtypes]
    for dtype in tqdm(order, desc="capacity runs"):
        run = run_capacity(model, dtype, prompts, output_lens, kv_budget_mib)
        if dtype not in best or run.elapsed_s < best[dtype].elapsed_s:
            best[dtype] = run
    return [best[d] for d in dtypes]


def time_dequantization(model, dtypes, batch=32, context_len=512, repeats=20) -> dict[str, float]:
    """Seconds per decode step's attention (one kernel call per layer) with each
    dtype's cache, median of ``repeats`` alternating calls, on one thread."""
    from minipaged.models.attention import head_dim
    from minipaged.models.loader import read_config
    from minipaged.ops import get_backend, kv_quant

    config = read_config(model)
    kernel = get_backend("cpu", torch.device("cpu"))
    block_size, heads, kv_heads = 16, config.num_attention_heads, config.num_key_value_heads
    dim = head_dim(config)
    blocks = batch * context_len // block_size
    g = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, dim, generator=g).bfloat16()
    tables = torch.randperm(blocks, generator=g).view(batch, -1).int()
    lens = torch.full((batch,), context_len, dtype=torch.int32)
    x = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    calls = {}
    for name in dtypes:
        dtype = kv_quant.cache_dtype(name, torch.bfloat16)
        if kv_quant.is_quantized(dtype):
            ks, vs = kv_quant.new_scales(dtype, x.shape, "cpu")
            cache = torch.empty(x.shape, dtype=dtype)
            slots = torch.arange(blocks * block_size)
            rows = x.flatten(0, 1)
            kv_quant.write_kv(rows, rows, cache, torch.empty_like(cache), slots, ks, vs)
            scales = (ks, vs)
        else:
            cache, scales = x.to(dtype), ()
        calls[name] = (query, cache, cache, tables, lens, dim**-0.5, *scales)
    times: dict[str, list[float]] = {name: [] for name in dtypes}
    with one_cpu_thread(torch.device("cpu")):
        for name in itertools.chain.from_iterable(itertools.repeat(dtypes, repeats + 1)):
            start = time.perf_counter()
            kernel.paged_attention_decode(*calls[name])
            times[name].append(time.perf_counter() - start)
    layers = config.num_hidden_layers
    return {name: layers * statistics.median(t[1:]) for name, t in times.items()}


def format_tables(capacity, cost) -> str:
    base = {r.kv_cache_dtype: r for r in capacity}["auto"]
    rows = [
        {**asdict(r), "rps": r.requests_per_s, "ratio": r.requests_per_s / base.requests_per_s}
        for r in capacity
    ]
    text = common.format_table(
        rows,
        [
            Column("kv_cache_dtype", "kv_cache_dtype"),
            Column("blocks", "num_gpu_blocks"),
            Column("bytes/block", "block_bytes"),
            Column("peak running", "peak_running"),
            Column("preemptions", "num_preemptions"),
            Column("requests/s", "rps", "{:.3f}"),
            Column("vs auto", "ratio", "{:.2f}x"),
        ],
    )
    text += "\n\nattention per decode step (C++ kernel, memory not binding):\n"
    text += common.format_table(
        [{"dtype": d, "ms": 1e3 * s, "ratio": s / cost["auto"]} for d, s in cost.items()],
        [
            Column("kv_cache_dtype", "dtype"),
            Column("ms", "ms", "{:.2f}"),
            Column("vs auto", "ratio", "{:.2f}x"),
        ],
    )
    return text


def plot(capacity, cost) -> Figure:
    """Requests/s and peak running under the budget; the attention's time per step."""
    fig = Figure(figsize=(7.5, 3.4), layout="constrained")
    ax_rps, ax_cost = fig.subplots(1, 2)
    names = [r.kv_cache_dtype for r in capacity]
    bars = ax_rps.bar(names, [r.requests_per_s for r in capacity], color="#4c72b0")
    ax_rps.bar_label(bars, [f"peak {r.peak_running} running" for r in capacity], fontsize=8)
    ax_rps.set_ylabel("requests / s")
    ax_rps.set_title("same KV budget: memory binds")
    bars = ax_cost.bar(list(cost), [1e3 * s for s in cost.values()], color="#dd8452")
    ax_cost.bar_label(bars, [f"{s / cost['auto']:.2f}x" for s in cost.values()], fontsize=8)
    ax_cost.set_ylabel("ms per decode step")
    ax_cost.set_title("C++ kernel: dequantization cost")
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="real weights for quality (default: %(default)s)"
    )
    parser.add_argument(
        "--capacity-model",
        help="the capacity run's model (default: the tiny checkpoint of `bench sharing`)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=KV_CACHE_DTYPES,
        default=list(DTYPES),
        help="the dtypes to compare; auto always runs (default: auto fp8 int8)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="serving (capacity, throughput, dequantization cost) and/or quality (default: both)",
    )
    parser.add_argument(
        "--mc-questions",
        type=Path,
        default=kv_quality.MC_QUESTIONS,
        metavar="PATH",
        help="the multiple-choice questions, JSONL (default: the lm-eval test's)",
    )
    for flag, default, help_ in [
        ("--num-requests", 32, "requests of the capacity run"),
        ("--rounds", 2, "capacity runs per dtype, taking turns; each keeps its best"),
        ("--quality-prompts", 64, "prompts whose greedy completions are compared"),
        ("--quality-tokens", 16, "tokens of each greedy completion"),
        ("--seed", 0, "of the capacity run's workload"),
    ]:
        parser.add_argument(
            flag, type=int, default=default, metavar="N", help=f"{help_} (default: %(default)s)"
        )
    parser.add_argument(
        "--kv-budget-mib",
        type=float,
        default=0.5,
        metavar="X",
        help="the KV pool of the capacity run, MiB (default: %(default)s)",
    )
    add_output_flags(parser, NAME)


def main(args) -> None:
    from minipaged.models.hub import resolve_model

    model = resolve_model(args.model)
    dtypes = list(dict.fromkeys(["auto", *args.kv_cache_dtype]))
    if "serving" in args.parts:
        serving(args, model, dtypes)
    if "quality" in args.parts:
        quality(args, model, dtypes)


def serving(args, model, dtypes) -> None:
    small = resolve_capacity_model(args)
    capacity = bench_capacity(
        small, dtypes, args.num_requests, args.kv_budget_mib, args.rounds, args.seed
    )
    cost = time_dequantization(model, dtypes)
    print(format_tables(capacity, cost))
    write(
        args,
        NAME,
        "cpu",
        [asdict(r) | {"requests_per_s": r.requests_per_s} for r in capacity],
        plot(capacity, cost),
        model=args.model,
        capacity_model=args.capacity_model or "the tiny checkpoint (bench-sharing), bf16",
        kv_budget_mib=args.kv_budget_mib,
        dequantization_s_per_step=cost,
        num_requests=args.num_requests,
        rounds=args.rounds,
        seed=args.seed,
        load_average=list(os.getloadavg()),
    )


def resolve_capacity_model(args):
    from minipaged.models.hub import resolve_model

    if args.capacity_model:
        return resolve_model(args.capacity_model)
    return cached_checkpoint("bench-sharing")


def quality(args, model, dtypes) -> None:
    questions = kv_quality.mc_questions(args.mc_questions)
    rows = kv_quality.measure_quality(
        model, dtypes, args.quality_prompts, args.quality_tokens, questions
    )
    print(kv_quality.format_table(rows))
    write(
        args,
        f"{NAME}-quality",
        "cpu",
        rows,
        kv_quality.plot(rows),
        model=args.model,
        quality_prompts=args.quality_prompts,
        quality_tokens=args.quality_tokens,
        mc_questions=str(args.mc_questions),
        load_average=list(os.getloadavg()),
    )

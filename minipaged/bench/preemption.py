"""``minipaged bench preemption``: swapping vs recomputing a preempted request (paper
§4.5, §7.3, Fig. 19).

When the GPU pool runs out, the scheduler evicts a whole request (§4.5).  Its KV can
be **swapped** to the CPU pool and back (two copies of its blocks over the bus) or
dropped and **recomputed** (one prefill of all its tokens when it returns).  The paper
times both for block sizes 1 to 256: swapping is slow at small blocks, because its
copies are many and small, and recomputing does not depend on the block size at all,
since it reads no blocks.  So neither wins everywhere: recomputing is better at small
blocks, swapping at large ones.

Two experiments per block size:

- **microbenchmark** (Fig. 19a, `measure_micro`): one request of ``num_tokens`` tokens is
  swapped out and back in through the cache engine (``swap-out``, ``swap-in``), and
  recomputed as one prefill (``recompute``: ``LLM.generate`` of a prompt that long with
  ``max_tokens=1``).  Each is the median of ``repeats`` timings after ``warmup``; rows
  give milliseconds and microseconds per token.  Swaps are copied two ways:
  ``batched``, our `CacheEngine`, one gather and one scatter per layer for keys and for
  values whatever the number of blocks; and ``per-block``, one copy per block per layer
  for keys and for values, as vLLM's ``swap_blocks`` did when the paper was written
  (one ``cudaMemcpyAsync`` each; here a Python-level ``copy_``, which costs more per
  call).  The per-block copy is what makes small blocks slow; batching removes most of
  it (at the largest blocks the per-block copies win again: the batched path gathers
  into a temporary first, one copy more).
- **end to end** (Fig. 19b): ``LLM.generate`` serves ShareGPT-like requests on a KV pool
  too small for them, once with ``preemption_mode="recompute"`` and once with
  ``"swap"`` (a CPU pool as large as the GPU pool); throughput is normalized to the best
  run of all.

On a CPU both "pools" are host memory, so a swap is a memcpy with no bus to cross, and
the tiny model's 512 bytes of KV per token make swapping cheap next to running the
model: the CPU numbers show the per-block copies' cost, not the paper's balance of
PCIe bandwidth against GPU compute.  The ``gpu`` preset measures that balance.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
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
from minipaged.bench.blocksize import (
    BLOCK_SIZES,
    check_all_free,
    check_block_sizes,
    check_engine_kwargs,
    make_requests,
    run_engine,
)
from minipaged.bench.common import Column, free_memory, one_cpu_thread, timed
from minipaged.bench.presets import (
    GPU_MODEL,
    default_preset,
    make_prompts,
    preset_device,
    with_overrides,
)
from minipaged.bench.results import device_name
from minipaged.config import PREEMPTION_MODES
from minipaged.core.memory.block_table import blocks_for
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS
from minipaged.core.memory.workloads import RequestSpec
from minipaged.core.sched.output import SchedulerOutput
from minipaged.worker.cache_engine import GIB, KVCaches, block_bytes

NAME = "preemption"
HELP = "preempted requests: swap vs recompute per block size (Fig. 19)"
DESCRIPTION = (
    "Time swapping one request's KV out to the CPU pool and back in "
    "(batched, as the cache engine does, and one copy per block, as vLLM "
    "did) against recomputing it with one prefill, for block sizes 1 to "
    "256; then serve ShareGPT-like requests on a too-small KV pool with "
    "each preemption mode."
)
SWAP_METHODS = ("batched", "per-block")
MICRO_KEYS = (
    "experiment",
    "block_size",
    "op",
    "method",
    "num_tokens",
    "num_blocks",
    "num_copies",
    "bytes",
    "time_ms",
    "us_per_token",
    "bandwidth_gbs",
)
END_TO_END_KEYS = (
    "experiment",
    "block_size",
    "preemption_mode",
    "num_requests",
    "kv_slots",
    "elapsed_s",
    "output_tokens",
    "output_tokens_per_s",
    "normalized_throughput",
    "num_steps",
    "num_preemptions",
    "num_swapped_out_blocks",
)
# The sweep sets these per run; recompute timings need a prompt the prefix cache cannot serve.
SWEPT = ("block_size", "num_gpu_blocks", "swap_space", "preemption_mode", "enable_prefix_caching")
PROBE = "preemption-probe"  # the swapped sequence's id in the KV cache manager


@dataclass(frozen=True)
class Preset:
    """One benchmark setting: the microbenchmark's request length and timing repeats,
    and the end-to-end workload and its (too small) KV pool."""

    device: str
    num_tokens: int
    repeats: int
    warmup: int
    num_requests: int
    kv_slots: int
    length_scale: float  # of ShareGPT's lengths, drawn for a 2048-token context
    model: dict = field(default_factory=dict)  # make_tiny_model overrides


PRESETS = {
    # The tiny checkpoint: half its context per request; end to end, ShareGPT / 4 on a
    # pool of a sixth of the workload's tokens, which preempts about once per request;
    # about 30 s on one core.
    "cpu": Preset(
        "cpu",
        num_tokens=512,
        repeats=10,
        warmup=2,
        num_requests=48,
        kv_slots=1024,
        length_scale=0.25,
    ),
    # The paper's pool (OPT-13B's KV on an A100-40GB) and a Llama-3.2-1B shaped model; a
    # recomputed request of 2048 tokens is one prefill of the default token budget.
    "gpu": Preset(
        "cuda",
        num_tokens=2048,
        repeats=10,
        warmup=3,
        num_requests=100,
        kv_slots=OPT13B_A100_SLOTS,
        length_scale=1.0,
        model=GPU_MODEL,
    ),
}


def check_setting(
    num_tokens: int,
    repeats: int,
    warmup: int,
    num_requests: int,
    kv_slots: int,
    block_sizes: Sequence[int],
) -> None:
    """Raise ``ValueError`` naming the first bad value, before anything runs."""
    for name, value, low in (
        ("num_tokens", num_tokens, 1),
        ("repeats", repeats, 1),
        ("warmup", warmup, 0),
        ("num_requests", num_requests, 1),
        ("kv_slots", kv_slots, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    # The probe and the token it generates when recomputed.
    check_fits(f"num_tokens={num_tokens} and one more", num_tokens + 1, kv_slots, block_sizes)


def check_fits(what: str, num_tokens: int, kv_slots: int, block_sizes: Sequence[int]) -> None:
    """``ValueError`` unless ``num_tokens`` fit a pool of ``kv_slots`` slots in blocks of
    every size (the last block rounds up, so big blocks may not)."""
    for size in check_block_sizes(block_sizes):
        if blocks_for(num_tokens, size) > kv_slots // size:
            raise ValueError(
                f"kv_slots={kv_slots} cannot hold {what} ({num_tokens} tokens) in blocks of {size}"
            )


# -- the copies -----------------------------------------------------------------------
def copy_per_block(src: KVCaches, dst: KVCaches, pairs: list[tuple[int, int]]) -> None:
    """``dst[d] = src[s]`` for every ``(s, d)`` pair, one copy per block, per layer, keys
    and values: vLLM's ``swap_blocks`` of the paper's time (§7.3).  Asynchronous where it
    can be (pinned host memory), as ``cudaMemcpyAsync`` is; the caller synchronises."""
    for src_layer, dst_layer in zip(src, dst):
        for src_cache, dst_cache in zip(src_layer, dst_layer):
            for s, d in pairs:
                dst_cache[d].copy_(src_cache[s], non_blocking=True)


def swap(engine, seq_id: str, direction: str, method: str) -> float:
    """Swap ``seq_id`` out to the CPU pool or back in, as the scheduler orders it
    (`KVCacheManager.swap_out` / ``swap_in``: the block mapping), copied by ``method``;
    returns the copy's seconds."""
    if direction not in ("out", "in"):
        raise ValueError(f"direction must be 'out' or 'in', got {direction!r}")
    if method not in SWAP_METHODS:
        raise ValueError(f"method must be one of {SWAP_METHODS}, got {method!r}")
    cache = engine.cache_engine
    if direction == "out":
        pairs = engine.kv.swap_out([seq_id])
        src, dst, step = cache.gpu_cache, cache.cpu_cache, SchedulerOutput(swap_out=pairs)
    else:
        pairs = engine.kv.swap_in([seq_id])
        src, dst, step = cache.cpu_cache, cache.gpu_cache, SchedulerOutput(swap_in=pairs)
    if method == "batched":
        return timed(lambda: cache.execute(step), engine.device)[1]
    return timed(lambda: copy_per_block(src, dst, pairs), engine.device)[1]


def time_swaps(
    engine, num_tokens: int, method: str, repeats: int, warmup: int
) -> tuple[float, float]:
    """Median seconds to swap a ``num_tokens`` request out and to swap it back in; the
    request's blocks are free again afterwards."""
    engine.kv.allocate(PROBE, [0] * num_tokens)
    out, back = [], []
    try:
        for i in range(warmup + repeats):
            times = swap(engine, PROBE, "out", method), swap(engine, PROBE, "in", method)
            if i >= warmup:
                out.append(times[0])
                back.append(times[1])
    finally:
        engine.kv.free(PROBE)
    return statistics.median(out), statistics.median(back)


def time_recompute(llm, prompt: list[int], repeats: int, warmup: int) -> float:
    """Median seconds to recompute ``prompt``'s KV: ``LLM.generate`` of it with
    ``max_tokens=1``, one prefill (chunked if longer than a step's token budget) and
    one sampled token."""
    from minipaged.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = [
        timed(
            lambda: llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False),
            llm.engine.device,
        )[1]
        for _ in range(warmup + repeats)
    ]
    return statistics.median(times[warmup:])


# -- the experiments ------------------------------------------------------------------
def measure_micro(llm, num_tokens: int, repeats: int, warmup: int, seed: int = 0) -> list[dict]:
    """`MICRO_KEYS` rows at ``llm``'s block size: swap out and in by each method, and
    recompute.  Leaves every block free."""
    engine = llm.engine
    size = engine.config.block_size
    num_blocks = blocks_for(num_tokens, size)
    layers = engine.model.config.num_hidden_layers
    nbytes = num_blocks * block_bytes(
        engine.model.config, size, engine.cache_engine.gpu_cache[0][0].dtype
    )
    rows = []
    for method in SWAP_METHODS:
        # Keys and values of every layer: one gather-scatter each, or one per block.
        copies = 2 * layers * (1 if method == "batched" else num_blocks)
        for op, seconds in zip(
            ("swap-out", "swap-in"), time_swaps(engine, num_tokens, method, repeats, warmup)
        ):
            rows.append(
                _micro_row(size, op, method, num_tokens, num_blocks, copies, nbytes, seconds)
            )
    prompt = make_prompts(
        [RequestSpec(num_tokens, 1)], llm.get_tokenizer(), engine.vocab_size, seed
    )[0]
    rows.append(
        _micro_row(
            size,
            "recompute",
            "prefill",
            num_tokens,
            num_blocks,
            None,
            None,
            time_recompute(llm, prompt, repeats, warmup),
        )
    )
    check_all_free(llm)
    return rows


def _micro_row(size, op, method, num_tokens, num_blocks, copies, nbytes, seconds) -> dict:
    return {
        "experiment": "microbenchmark",
        "block_size": size,
        "op": op,
        "method": method,
        "num_tokens": num_tokens,
        "num_blocks": num_blocks,
        "num_copies": copies,
        "bytes": nbytes,
        "time_ms": seconds * 1e3,
        "us_per_token": seconds * 1e6 / num_tokens,
        "bandwidth_gbs": nbytes / seconds / 1e9 if nbytes else None,
    }


def _swap_space(config, block_size: int, dtype: torch.dtype, num_blocks: int) -> float:
    """GiB for a CPU pool of ``num_blocks`` blocks; one block more than asked, so that
    the engine's rounding down of GiB to blocks cannot leave one short."""
    return (num_blocks + 1) * block_bytes(config, block_size, dtype) / GIB


def bench_preemption(
    path,
    block_sizes: Sequence[int],
    num_tokens: int,
    repeats: int,
    warmup: int,
    num_requests: int,
    kv_slots: int,
    length_scale: float,
    engine_kwargs: dict | None = None,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Per block size: the microbenchmark (on the swap-mode engine, before its run) and
    both end-to-end runs.  End-to-end rows are normalized to the best of them all."""
    from minipaged.llm import LLM
    from minipaged.models.loader import read_config, resolve_dtype
    from minipaged.models.resolve import resolve_device, resolve_max_model_len

    engine_kwargs = dict(engine_kwargs or {})
    check_engine_kwargs(engine_kwargs, SWEPT)
    check_setting(num_tokens, repeats, warmup, num_requests, kv_slots, block_sizes)
    config = read_config(Path(path))
    max_model_len = resolve_max_model_len(engine_kwargs.get("max_model_len"), config)
    if num_tokens + 1 > max_model_len:
        raise ValueError(
            f"num_tokens={num_tokens} (and the token it generates) exceeds "
            f"max_model_len={max_model_len}"
        )
    requests = make_requests("sharegpt", num_requests, length_scale, max_model_len, seed)
    check_fits("the longest request", max(r.total_len for r in requests), kv_slots, block_sizes)
    dtype = resolve_dtype(engine_kwargs.get("dtype", "auto"), config)
    device = resolve_device(engine_kwargs.get("device", "auto"))
    micro, end_to_end = [], []
    runs = [(size, mode) for size in check_block_sizes(block_sizes) for mode in PREEMPTION_MODES]
    with one_cpu_thread(device):
        for size, mode in tqdm(runs, desc="block sizes x modes", disable=not progress):
            num_blocks = kv_slots // size
            llm = LLM(
                str(path),
                **engine_kwargs,
                block_size=size,
                num_gpu_blocks=num_blocks,
                swap_space=_swap_space(config, size, dtype, num_blocks),
                preemption_mode=mode,
                enable_prefix_caching=False,
            )
            if mode == "swap":
                micro += measure_micro(llm, num_tokens, repeats, warmup, seed)
            prompts = make_prompts(requests, llm.get_tokenizer(), llm.engine.vocab_size, seed)
            end_to_end.append(
                _end_to_end_row(size, mode, kv_slots, requests, run_engine(llm, requests, prompts))
            )
            del llm
            free_memory(device)
    best = max(r["output_tokens_per_s"] for r in end_to_end)
    for r in end_to_end:
        r["normalized_throughput"] = r["output_tokens_per_s"] / best
    return micro + end_to_end


def _end_to_end_row(size, mode, kv_slots, requests, run) -> dict:
    return {
        "experiment": "end-to-end",
        "block_size": size,
        "preemption_mode": mode,
        "num_requests": len(requests),
        "kv_slots": kv_slots,
        "elapsed_s": run.elapsed_s,
        "output_tokens": run.output_tokens,
        "output_tokens_per_s": run.output_tokens_per_s,
        "normalized_throughput": None,
        "num_steps": run.num_steps,
        "num_preemptions": run.num_preemptions,
        "num_swapped_out_blocks": run.num_swapped_out_blocks,
    }


# -- output ---------------------------------------------------------------------------
def _micro(rows: list[dict], op: str, method: str) -> list[dict]:
    return [
        r
        for r in rows
        if r["experiment"] == "microbenchmark" and r["op"] == op and r["method"] == method
    ]


def format_table(rows: list[dict]) -> str:
    """Microseconds per token by block size (swap out + in, each method; recompute),
    then the end-to-end runs."""
    micro = {
        (r["op"], r["method"], r["block_size"]): r["us_per_token"]
        for r in rows
        if r["experiment"] == "microbenchmark"
    }
    num_tokens = next(r["num_tokens"] for r in rows if r["experiment"] == "microbenchmark")
    by_size = []
    for size in sorted({r["block_size"] for r in rows}):
        row = {"block_size": size}
        for method, suffix in (("batched", ""), ("per-block", "/blk")):
            out, back = micro["swap-out", method, size], micro["swap-in", method, size]
            row |= {f"out{suffix}": out, f"in{suffix}": back, f"out+in{suffix}": out + back}
        by_size.append(row | {"recompute": micro["recompute", "prefill", size]})
    swaps = [f"{op}{suffix}" for suffix in ("", "/blk") for op in ("out", "in", "out+in")]
    end_to_end = [r for r in rows if r["experiment"] == "end-to-end"]
    return "\n".join(
        [
            f"microbenchmark: one request of {num_tokens} tokens, us per token",
            "",
            common.format_table(
                by_size,
                [
                    Column("block", "block_size"),
                    *(Column(k, k, "{:.2f}") for k in swaps),
                    Column("recompute", "recompute", "{:.2f}"),
                ],
            ),
            "",
            "end to end: ShareGPT-like requests on a pool too small for them",
            "",
            common.format_table(
                end_to_end,
                [
                    Column("block", "block_size"),
                    Column("mode", "preemption_mode"),
                    Column("tok/s", "output_tokens_per_s", "{:.0f}"),
                    Column("vs best", "normalized_throughput", "{:.2f}"),
                    Column("preempt", "num_preemptions"),
                    Column("swapped blk", "num_swapped_out_blocks"),
                    Column("steps", "num_steps"),
                ],
            ),
        ]
    )


def plot_preemption(rows: list[dict], device: str = "") -> Figure:
    """Fig. 19: (a) microseconds per token to swap out, in, both (by each copy method)
    and to recompute, against the block size; (b) end-to-end throughput with each
    preemption mode, normalized."""
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    micro_ax, e2e_ax = fig.subplots(1, 2)
    for method, style in zip(SWAP_METHODS, ("-", "--")):
        out, back = _micro(rows, "swap-out", method), _micro(rows, "swap-in", method)
        sizes = [r["block_size"] for r in out]
        for label, values, colour, marker in (
            ("swap out", [r["us_per_token"] for r in out], "tab:blue", "v"),
            ("swap in", [r["us_per_token"] for r in back], "tab:orange", "^"),
            (
                "swap in + out",
                [a["us_per_token"] + b["us_per_token"] for a, b in zip(out, back)],
                "tab:green",
                "o",
            ),
        ):
            micro_ax.plot(
                sizes, values, style, marker=marker, color=colour, label=f"{label} ({method})"
            )
    recompute = _micro(rows, "recompute", "prefill")
    micro_ax.plot(
        [r["block_size"] for r in recompute],
        [r["us_per_token"] for r in recompute],
        marker="s",
        color="black",
        label="recompute",
    )
    micro_ax.set_yscale("log")
    micro_ax.set_ylabel("microseconds per token")
    micro_ax.set_title(f"(a) one request of {recompute[0]['num_tokens']} tokens")
    micro_ax.legend(
        fontsize="small", ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False
    )
    for mode, colour in zip(PREEMPTION_MODES, ("black", "tab:green")):
        ours = [r for r in rows if r["experiment"] == "end-to-end" and r["preemption_mode"] == mode]
        e2e_ax.plot(
            [r["block_size"] for r in ours],
            [r["normalized_throughput"] for r in ours],
            marker="o",
            color=colour,
            label=mode,
        )
    e2e_ax.set_ylabel("throughput / best run")
    e2e_ax.set_title("(b) end to end, ShareGPT-like requests")
    e2e_ax.legend()
    for ax in (micro_ax, e2e_ax):
        sizes = sorted({r["block_size"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, labels=[str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
    fig.suptitle(f"swap vs recompute{f' on {device}' if device else ''} (cf. Fig. 19)")
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, SYNTHETIC_MODEL_HELP)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default_preset(),
        help="cpu: the tiny checkpoint, about 30 s; gpu: a Llama-3.2-1B-"
        "shaped random model on the paper's KV pool (default: gpu if "
        "CUDA is available)",
    )
    parser.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        metavar="N",
        default=list(BLOCK_SIZES),
        help="(default: 1 2 4 ... 256)",
    )
    for flag, help_ in [
        ("--num-tokens", "tokens of the request swapped and recomputed"),
        ("--repeats", "timings per operation, of which the median is reported"),
        ("--warmup", "untimed runs of each operation first"),
        ("--num-requests", "requests of the end-to-end workload"),
        ("--kv-slots", "tokens the end-to-end KV pool holds (the CPU pool holds as many)"),
    ]:
        parser.add_argument(flag, type=int, metavar="N", help=f"{help_} (default: the preset's)")
    parser.add_argument(
        "--length-scale",
        type=float,
        metavar="X",
        help="multiply the ShareGPT lengths by X (default: the preset's)",
    )
    add_output_flags(parser, NAME)
    add_engine_flags(parser, exclude=SWEPT)


def main(args) -> None:
    preset = PRESETS[args.preset]
    device = preset_device(args.preset, PRESETS, args.device)
    setting = with_overrides(
        preset,
        ("num_tokens", "repeats", "warmup", "num_requests", "kv_slots", "length_scale"),
        vars(args),
    )
    model = bench_model(args, PRESETS)
    engine = {**engine_kwargs(args), "device": device.type}
    rows = bench_preemption(
        model, args.block_sizes, **setting, engine_kwargs=engine, seed=args.seed
    )
    print(format_table(rows))
    write(
        args,
        NAME,
        device,
        rows,
        plot_preemption(rows, device_name(device)),
        **model_record(args, model, device),
        engine=engine,
        block_sizes=sorted(set(args.block_sizes)),
        seed=args.seed,
        **setting,
    )

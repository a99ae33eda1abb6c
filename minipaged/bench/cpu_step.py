"""``minipaged bench cpu_step``: one decode step on a CPU, against the machine's
matmul rate measured in the same run.

A decode step of ``B`` running sequences is the model's projections on ``B`` rows (every
weight read once), attention over each sequence's cached context, and the small ops
around them (norms, rotary, activation, residuals).  For each dtype and batch size this
times, alternately, ``rounds`` times each:

- the whole step (the forward over the paged cache with the engine's attention backend,
  then the logits of every row) with
  the projections through ``F.linear`` (``unpacked``) and through oneDNN's weights
  packed at load (``packed``, `minipaged.models.cpu_linear`, the default on a CPU);
- the projections alone on the same shapes, each way: the step's matmul time, the rest
  of the step being attention and the small ops;
- a square matmul (``ceiling_n``³) in the dtype: the rate the machine multiplies at,
  against which the step's projection FLOPs give the time a step could take if it were
  matmuls at that rate.

torch runs on every core this process may use (``os.sched_getaffinity``).  Only ratios
measured in one run compare: other processes on the machine move the absolute times.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column
from minipaged.models.attention import AttentionMetadata, allocate_kv_caches
from minipaged.models.cpu_linear import PACKED_LAYERS, can_pack, cpu_flags, native_bf16
from minipaged.models.loader import load_model
from minipaged.models.resolve import resolve_backend

NAME = "cpu_step"
HELP = "a decode step on a CPU: packed vs F.linear projections, against the matmul rate"
DESCRIPTION = (
    "Time one decode step of a model at several batch sizes, its projections through "
    "F.linear and through weights packed for oneDNN, alternately; report where the "
    "step's time goes against a square matmul's GFLOP/s measured in the same run."
)
BATCHES = (1, 8, 32, 96)
VARIANTS = ("unpacked", "packed")
BLOCK_SIZE = 16


def default_threads() -> int:
    """The cores this process may run on (its affinity mask), where the OS says."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn``, after one untimed."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(dtype: torch.dtype, n: int, reps: int = 3) -> float:
    """GFLOP/s of an ``n``³ matmul in ``dtype``: the rate this machine multiplies at."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_seconds(lambda: a @ b, reps) / 1e9


def decode_step(model, batch: int, context_len: int) -> Callable[[], torch.Tensor]:
    """A decode step of ``batch`` sequences with ``context_len`` tokens each (the new
    one included), over a paged cache: the forward, then every row's logits."""
    dtype = model.model.embed_tokens.weight.dtype
    blocks = -(-context_len // BLOCK_SIZE)
    caches = allocate_kv_caches(model, batch * blocks, BLOCK_SIZE, dtype, "cpu")
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    attn = AttentionMetadata.build(
        tables,
        [context_len - 1] * batch,
        [1] * batch,
        BLOCK_SIZE,
        slot_mapping=[t[0] * BLOCK_SIZE + context_len - 1 for t in tables],
    )
    ids = torch.randint(model.config.vocab_size, (batch,))
    positions = torch.full((batch,), context_len - 1)

    @torch.inference_mode()
    def step():
        return model.compute_logits(model(ids, positions, caches, attn))

    return step


def projections(model, batch: int) -> Callable[[], None]:
    """The step's projections alone: each of the model's projection layers (the LM
    head included) on ``batch`` rows, as its forward multiplies."""
    dtype = model.model.embed_tokens.weight.dtype
    layers = [m for m in model.modules() if isinstance(m, PACKED_LAYERS)]
    inputs = [torch.randn(batch, m.weight.shape[1]).to(dtype) for m in layers]

    @torch.inference_mode()
    def run():
        for layer, x in zip(layers, inputs):
            layer(x)

    return run


def projection_flops(model, batch: int) -> int:
    """Multiply-adds times two of the step's projections on ``batch`` rows."""
    return sum(
        2 * batch * m.weight.numel() for m in model.modules() if isinstance(m, PACKED_LAYERS)
    )


def bench_cpu_step(
    model_path,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    batches: tuple[int, ...] = BATCHES,
    context_len: int = 128,
    rounds: int = 3,
    reps: int = 5,
    ceiling_n: int = 1024,
) -> dict:
    """Rows of (dtype, batch, variant): the step's and its projections' median ms, and
    the ceiling's GFLOP/s of each dtype; dtypes oneDNN cannot pack here are skipped."""
    for name, value in (("context_len", context_len), ("rounds", rounds), ("reps", reps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    rows, ceilings = [], {}
    backend = resolve_backend("auto", torch.device("cpu"))  # the engine's on a CPU
    for dtype_name in dtypes:
        models = {
            variant: load_model(
                model_path, dtype_name, attention_backend=backend, pack_weights=variant == "packed"
            )
            for variant in VARIANTS
        }
        dtype = models["packed"].model.embed_tokens.weight.dtype
        if not can_pack(models["packed"].lm_head.weight):
            continue
        ceilings[dtype_name] = matmul_gflops(dtype, ceiling_n)
        for batch in tqdm(batches, desc=f"{dtype_name} decode steps", leave=False):
            timers = {
                variant: (decode_step(m, batch, context_len), projections(m, batch))
                for variant, m in models.items()
            }
            times = {variant: ([], []) for variant in VARIANTS}
            for _ in range(rounds):  # alternately, so that a busy spell hits both
                for variant, (step, matmuls) in timers.items():
                    times[variant][0].append(median_seconds(step, reps))
                    times[variant][1].append(median_seconds(matmuls, reps))
            flops = projection_flops(models["packed"], batch)
            for variant, (step_s, matmul_s) in times.items():
                step_ms = 1e3 * statistics.median(step_s)
                matmul_ms = 1e3 * statistics.median(matmul_s)
                rows.append(
                    {
                        "dtype": dtype_name,
                        "batch": batch,
                        "variant": variant,
                        "step_ms": step_ms,
                        "matmul_ms": matmul_ms,
                        "rest_ms": step_ms - matmul_ms,
                        "matmul_gflops": flops / matmul_ms / 1e6,
                        "ceiling_ms": flops / ceilings[dtype_name] / 1e6,
                    }
                )
    for row in rows:
        unpacked = next(
            r
            for r in rows
            if (r["dtype"], r["batch"], r["variant"]) == (row["dtype"], row["batch"], "unpacked")
        )
        row["step_vs_unpacked"] = row["step_ms"] / unpacked["step_ms"]
    return {
        "rows": rows,
        "ceiling_gflops": ceilings,
        "context_len": context_len,
        "attention_backend": backend,
    }


def machine() -> dict:
    """What the results file says about the CPU: its model, the flags that matter here."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "cpu": _cpu_model() or platform.processor(),
        "cpu_flags": sorted(cpu_flags() & set(wanted)),
        "native_bf16": native_bf16(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str | None:
    try:
        for line in open("/proc/cpuinfo"):  # noqa: SIM115 (read to the first match)
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def format_table(result: dict) -> str:
    return common.format_table(
        result["rows"],
        [
            Column("dtype", "dtype"),
            Column("batch", "batch"),
            Column("projections", "variant"),
            Column("step", "step_ms", "{:.1f} ms"),
            Column("of which matmuls", "matmul_ms", "{:.1f} ms"),
            Column("the rest", "rest_ms", "{:.1f} ms"),
            Column("matmul rate", "matmul_gflops", "{:.0f} GFLOP/s"),
            Column("at the ceiling", "ceiling_ms", "{:.1f} ms"),
            Column("step vs F.linear", "step_vs_unpacked", "{:.2f}x"),
        ],
    )


def plot_cpu_step(result: dict, title: str) -> Figure:
    """Per dtype: each variant's step split into matmuls and the rest, per batch size,
    with the time the projections would take at the measured ceiling."""
    dtypes = list(result["ceiling_gflops"])
    fig = Figure(figsize=(5.5 * max(1, len(dtypes)), 3.8), layout="constrained")
    axes = fig.subplots(1, max(1, len(dtypes)), squeeze=False)[0]
    for ax, dtype in zip(axes, dtypes):
        rows = [r for r in result["rows"] if r["dtype"] == dtype]
        labels = [f"{r['batch']}\n{r['variant']}" for r in rows]
        x = range(len(rows))
        ax.bar(x, [r["matmul_ms"] for r in rows], label="projections")
        ax.bar(
            x, [r["rest_ms"] for r in rows], bottom=[r["matmul_ms"] for r in rows], label="the rest"
        )
        ax.scatter(x, [r["ceiling_ms"] for r in rows], color="k", marker="_", s=300, zorder=3)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set(
            title=f"{dtype} (ceiling {result['ceiling_gflops'][dtype]:.0f} GFLOP/s: black)",
            ylabel="ms per decode step",
        )
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="a checkpoint (default: %(default)s)")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], help="(default: %(default)s)"
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=list(BATCHES), help="(default: %(default)s)"
    )
    for flag, default, help_ in (
        ("--context-len", 128, "tokens in each sequence's cache"),
        ("--rounds", 3, "alternations of the two variants"),
        ("--threads", None, "torch threads (default: the cores this process may use)"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{help_} (default: %(default)s)")
    add_output_flags(parser, NAME)


def main(args) -> None:
    from minipaged.models.hub import resolve_model

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or default_threads())
    try:
        result = bench_cpu_step(
            resolve_model(args.model),
            tuple(args.dtypes),
            tuple(args.batches),
            args.context_len,
            args.rounds,
        )
        result["machine"] = machine()
    finally:
        torch.set_num_threads(threads)
    print(format_table(result))
    title = f"{args.model}: one decode step, {args.context_len} tokens of context each"
    figure = plot_cpu_step(result, title)
    write(args, NAME, torch.device("cpu"), result.pop("rows"), figure, **result)

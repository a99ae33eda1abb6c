"""``minipaged bench structured``: what structured outputs cost a decode step
(`minipaged.structured_output`; vLLM's ``benchmarks/benchmark_serving_structured_output.py``
asks the same of a server).

Two engines on the same model, one decoding a full batch of free completions (off), the
other the same prompts held to a JSON schema (on), their steps taken in turn (a busy
machine slows both alike):

- **TPOT** (time per output token of each sequence: the median decode step) at batch
  1 and 32, and the ratio on / off: what filling one bitmask row per sequence
  (llguidance, parallel threads) and masking the logits add to a step;
- **compile time**, apart: building llguidance's view of the tokenizer (once per
  engine, on the first structured request) and compiling the schema (once per spec;
  then cached), each paid before the first token, never per step.

The schema asks for an array of at least ``steps`` records, so no completion can end
while its steps are timed.  On a CPU torch runs on one thread (`one_cpu_thread`).
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from minipaged.arg_utils import add_model_flag
from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, one_cpu_thread
from minipaged.llm import LLM
from minipaged.models.hub import resolve_model
from minipaged.sampling_params import SamplingParams, StructuredOutputsParams

NAME = "structured"
HELP = "structured outputs on vs off: TPOT at batch 1 and 32, schema compile time"
DESCRIPTION = (
    "Decode a full batch with and without a JSON schema held by llguidance, steps taken in "
    "turn; report each one's time per output token, their ratio, and the tokenizer's and "
    "the schema's compile times apart."
)
MODES = ("off", "on")


def records_schema(min_items: int) -> dict:
    """An array of at least ``min_items`` small records: each takes a few tokens."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "ok": {"type": "boolean"},
            "tag": {"type": "string", "maxLength": 8},
        },
        "required": ["id", "ok", "tag"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": record, "minItems": min_items}


def compile_times(engine, params: StructuredOutputsParams, repeats: int) -> dict[str, float]:
    """Seconds to build llguidance's tokenizer (once) and the median to compile the
    schema afresh; leaves it compiled in the engine's cache."""
    manager = engine.structured_output
    start = time.perf_counter()
    backend = manager.backend  # built on first use
    tokenizer_s = time.perf_counter() - start
    compiles = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.compile_grammar(params)
        compiles.append(time.perf_counter() - start)
    manager.grammar_init(params)  # cached: the timed steps compile nothing
    return {"tokenizer_init_s": tokenizer_s, "schema_compile_s": statistics.median(compiles)}


def tpot(engines: dict, structured: SamplingParams, batch: int, steps: int, prompt_len: int):
    """Each engine's median decode step at ``batch`` (its TPOT), steps taken in turn."""
    rng = random.Random(0)
    vocab = engines["off"].vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    free = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for mode, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{batch}-{i}", prompt, structured if mode == "on" else free)
        first = engine.num_generated_tokens + batch
        while engine.num_generated_tokens < first:  # the prefills (chunked, maybe)
            engine.step()
    times = {mode: [] for mode in engines}
    for _ in tqdm(range(steps), desc=f"batch {batch}", leave=False):
        for mode, engine in engines.items():
            times[mode].append(common.timed(engine.step, torch.device("cpu"))[1])
    for engine in engines.values():
        while engine.has_unfinished_requests():
            engine.step()
    return {mode: statistics.median(t) for mode, t in times.items()}


def bench_structured(
    model, batches=(1, 32), steps: int = 16, prompt_len: int = 32, dtype: str = "float32"
) -> tuple[list[dict], dict]:
    """One row per batch (TPOT off and on, their ratio) and the compile times."""
    schema = records_schema(min_items=steps)
    spec = StructuredOutputsParams(json=schema)
    structured = SamplingParams(max_tokens=steps + 1, ignore_eos=True, structured_outputs=spec)
    rows = []
    with one_cpu_thread("cpu"):
        engines = {
            mode: LLM(
                str(model), device="cpu", dtype=dtype, max_num_seqs=max(batches), swap_space=0
            ).engine
            for mode in MODES
        }
        compiled = compile_times(engines["on"], spec, repeats=3)
        for batch in batches:
            times = tpot(engines, structured, batch, steps, prompt_len)
            rows.append(
                {
                    "batch": batch,
                    "tpot_off_ms": times["off"] * 1e3,
                    "tpot_on_ms": times["on"] * 1e3,
                    "on_vs_off": times["on"] / times["off"],
                }
            )
    return rows, compiled


def format_table(rows: list[dict]) -> str:
    return common.format_table(
        rows,
        [
            Column("batch", "batch"),
            Column("TPOT off (ms)", "tpot_off_ms", "{:.2f}"),
            Column("TPOT on (ms)", "tpot_on_ms", "{:.2f}"),
            Column("on / off", "on_vs_off", "{:.3f}"),
        ],
    )


def plot_structured(rows: list[dict], compiled: dict, title: str) -> Figure:
    """TPOT off and on per batch, and the one-off compile times."""
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    tpot_ax, compile_ax = fig.subplots(1, 2)
    xs = range(len(rows))
    for offset, mode in ((-0.2, "off"), (0.2, "on")):
        bars = tpot_ax.bar(
            [x + offset for x in xs], [r[f"tpot_{mode}_ms"] for r in rows], 0.4, label=mode
        )
        if mode == "on":
            tpot_ax.bar_label(bars, [f"x{r['on_vs_off']:.2f}" for r in rows], fontsize=7)
    tpot_ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    tpot_ax.set_ylabel("TPOT (ms)")
    tpot_ax.legend(title="structured outputs", fontsize=7)
    names = ["tokenizer (once)", "schema (once per spec)"]
    values = [compiled["tokenizer_init_s"] * 1e3, compiled["schema_compile_s"] * 1e3]
    bars = compile_ax.bar(names, values)
    compile_ax.bar_label(bars, [f"{v:.1f}" for v in values], fontsize=7)
    compile_ax.set_ylabel("compile time (ms)")
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, "smollm2", default="smollm2")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    for flag, default, help_ in (
        ("--steps", 16, "decode steps timed per engine and batch"),
        ("--prompt-len", 32, "tokens per prompt"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{help_} (default: %(default)s)")
    parser.add_argument(
        "--dtype", default="float32", help="the model's dtype (default: %(default)s)"
    )
    add_output_flags(parser, NAME)


def main(args) -> None:
    model = resolve_model(args.model)
    rows, compiled = bench_structured(
        model, tuple(args.batches), args.steps, args.prompt_len, args.dtype
    )
    print(format_table(rows))
    print(
        f"compile: tokenizer {compiled['tokenizer_init_s'] * 1e3:.1f} ms (once), "
        f"schema {compiled['schema_compile_s'] * 1e3:.1f} ms (once per spec)"
    )
    title = f"{model.name} ({args.dtype}) on a CPU, one thread: structured outputs"
    write(
        args,
        NAME,
        "cpu",
        rows,
        plot_structured(rows, compiled, title),
        model=str(model),
        dtype=args.dtype,
        **compiled,
    )

"""``minipaged bench lora``: many LoRA adapters in one batch, against the base model alone
(Punica, S-LoRA).

Two measurements, on SmolLM2 by default, with random rank-16 adapters on every
projection (q, k, v, o, gate, up, down) written in PEFT's format:

- **step**: the time of one decode step of a full batch, all of the base model, all of
  one adapter, or spread over 4 distinct adapters (``max_loras`` 4), the engines' steps
  taken in turn so that a busy machine slows them alike; the ratio to the base model's
  step is the LoRA terms' cost (the goal: at most 1.3x with 4 adapters);
- **workload**: the same requests spread over 1, 4 or 16 adapters through
  ``LLM.generate``, against the base model: with 16 adapters and 4 slots, requests wait
  for a slot, so fewer run at once.

On a CPU torch runs on one thread (`bench.common.one_cpu_thread`).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure
from safetensors.torch import save_file
from tqdm.auto import tqdm

from minipaged.arg_utils import add_model_flag
from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, one_cpu_thread
from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine
from minipaged.llm import LLM
from minipaged.lora_request import LoRARequest
from minipaged.models.hub import resolve_model
from minipaged.models.loader import read_config
from minipaged.models.lora import CONFIG_FILE, WEIGHTS_FILE, lora_shapes
from minipaged.sampling_params import SamplingParams

NAME = "lora"
HELP = "many LoRA adapters in one batch against the base model (Punica, S-LoRA)"
DESCRIPTION = (
    "Time a decode step of a full batch of the base model, of one adapter and of 4 "
    "distinct adapters; then run one workload spread over 1, 4 and 16 adapters "
    "(max_loras 4) against the base model alone."
)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORAS = 4
RANK = 16
SPREADS = (1, 4, 16)  # adapters the workload is spread over


def write_random_adapter(
    path: Path, model_config, seed: int, rank: int = RANK, std: float = 0.02
) -> Path:
    """A PEFT-format adapter of ``rank`` on every projection, random weights of
    standard deviation ``std``."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(model_config.num_hidden_layers):
        for module in MODULES:
            block = "self_attn" if module in MODULES[:4] else "mlp"
            a_shape, b_shape = lora_shapes(model_config, module, rank)
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(a_shape, generator=generator) * std
            weights[f"{key}.lora_B.weight"] = torch.randn(b_shape, generator=generator) * std
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": MODULES}
    (path / CONFIG_FILE).write_text(json.dumps(config))
    save_file(weights, path / WEIGHTS_FILE)
    return path


@dataclass
class StepRun:
    adapters: int  # distinct adapters in the batch (0: the base model alone)
    batch: int
    step_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


@dataclass
class WorkloadRun:
    adapters: int
    output_tokens: int
    elapsed_s: float
    num_loads: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def _settings(num_adapters: int) -> dict:
    """The engine settings of a run over ``num_adapters`` adapters (0: the base model)."""
    lora = dict(enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=RANK, max_cpu_loras=16)
    return dict(device="cpu", swap_space=0, **(lora if num_adapters else {}))


def bench_steps(model, adapters: list[LoRARequest], batch: int, prompt_len: int, steps: int):
    """Each decode step of ``batch`` requests of the base model, of one adapter and of
    4 adapters, the three engines stepping in turn."""
    cases = {0: [None], 1: adapters[:1], MAX_LORAS: adapters[:MAX_LORAS]}
    engines = {}
    for n, loras in cases.items():
        engine = engines[n] = LLMEngine(
            EngineConfig(str(model), max_num_seqs=batch, **_settings(n))
        )
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
        for i, prompt in enumerate(_prompts(batch, prompt_len, engine.vocab_size)):
            engine.add_request(str(i), prompt, params, lora_request=loras[i % len(loras)])
        engine.step()  # every prompt at once: the steps from here on are decodes
    times = {n: [] for n in cases}
    for _ in tqdm(range(steps), desc="decode steps", leave=False):
        for n, engine in engines.items():  # in turn: the machine's load falls on all alike
            times[n].append(common.timed(engine.step, torch.device("cpu"))[1])
    return [StepRun(n, batch, times[n]) for n in cases]


def bench_workload(
    model, adapters: list[LoRARequest], num_requests: int, prompt_len: int, output_len: int
):
    """The same requests through ``LLM.generate``: the base model's, then spread over
    1, 4 and 16 adapters."""
    runs = []
    for spread in tqdm((0, *SPREADS), desc="workloads", leave=False):
        llm = LLM(str(model), **_settings(spread))
        prompts = _prompts(num_requests, prompt_len, llm.engine.vocab_size)
        loras = [adapters[i % spread] for i in range(num_requests)] if spread else None
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append(WorkloadRun(spread, tokens, elapsed, llm.engine.scheduler.lora_slots.num_loads))
    return runs


def _prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)  # the same prompts for every run
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def bench_lora(
    model,
    workdir: Path,
    batch: int = 16,
    steps: int = 10,
    num_requests: int = 32,
    prompt_len: int = 32,
    output_len: int = 16,
) -> tuple[list[StepRun], list[WorkloadRun]]:
    """Write 16 random adapters of ``model`` into ``workdir``, then both measurements."""
    config = read_config(Path(model))
    adapters = [
        LoRARequest(f"adapter{i}", i + 1, str(write_random_adapter(workdir / f"a{i}", config, i)))
        for i in range(max(SPREADS))
    ]
    with one_cpu_thread("cpu"):
        return (
            bench_steps(model, adapters, batch, prompt_len, steps),
            bench_workload(model, adapters, num_requests, prompt_len, output_len),
        )


def step_rows(runs: list[StepRun]) -> list[dict]:
    base = runs[0].median_s
    return [
        {
            "adapters": r.adapters,
            "batch": r.batch,
            "median_step_s": r.median_s,
            "step_s": r.step_s,
            "vs_base": r.median_s / base,
        }
        for r in runs
    ]


def workload_rows(runs: list[WorkloadRun]) -> list[dict]:
    base = runs[0].output_tokens_per_s
    return [
        {
            "adapters": r.adapters,
            "output_tokens": r.output_tokens,
            "elapsed_s": r.elapsed_s,
            "output_tokens_per_s": r.output_tokens_per_s,
            "adapter_loads": r.num_loads,
            "vs_base": r.output_tokens_per_s / base,
        }
        for r in runs
    ]


def _name(adapters: int) -> str:
    return "base model" if adapters == 0 else f"{adapters} adapter{'s' * (adapters > 1)}"


def format_tables(steps: list[StepRun], workload: list[WorkloadRun]) -> str:
    first = common.format_table(
        step_rows(steps),
        [
            Column("decode step of", lambda r: _name(r["adapters"])),
            Column("batch", "batch"),
            Column("median step (ms)", lambda r: r["median_step_s"] * 1e3, "{:.1f}"),
            Column("x base", "vs_base", "{:.2f}"),
        ],
    )
    second = common.format_table(
        workload_rows(workload),
        [
            Column("workload over", lambda r: _name(r["adapters"])),
            Column("tokens/s", "output_tokens_per_s", "{:.1f}"),
            Column("adapter loads", "adapter_loads"),
            Column("x base", "vs_base", "{:.2f}"),
        ],
    )
    return f"{first}\n\n{second}"


def plot_lora(steps: list[StepRun], workload: list[WorkloadRun], title: str) -> Figure:
    """Step time against the base model's, and the workload's throughput."""
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    step_ax, work_ax = fig.subplots(1, 2)
    base = steps[0].median_s
    bars = step_ax.bar([_name(r.adapters) for r in steps], [r.median_s / base for r in steps])
    step_ax.bar_label(bars, [f"{r.median_s / base:.2f}x" for r in steps], fontsize=8)
    step_ax.axhline(1.3, color="#c44e52", linestyle="--", label="goal: 1.3x")
    step_ax.set_ylabel("decode step time / base model's")
    step_ax.legend(fontsize=8)
    bars = work_ax.bar(
        [_name(r.adapters) for r in workload], [r.output_tokens_per_s for r in workload]
    )
    work_ax.bar_label(bars, [f"{r.num_loads} loads" for r in workload], fontsize=8)
    work_ax.set_ylabel("output tokens / s")
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, "smollm2", default="smollm2")
    for flag, default, help_ in (
        ("--batch", 16, "requests in the timed decode batch"),
        ("--steps", 10, "decode steps timed per engine"),
        ("--num-requests", 32, "requests of the workload"),
        ("--prompt-len", 32, "tokens per prompt"),
        ("--output-len", 16, "tokens per answer in the workload"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{help_} (default: %(default)s)")
    add_output_flags(parser, NAME)


def main(args) -> None:
    model = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="minipaged-lora-") as workdir:
        steps, workload = bench_lora(
            model,
            Path(workdir),
            args.batch,
            args.steps,
            args.num_requests,
            args.prompt_len,
            args.output_len,
        )
    print(format_tables(steps, workload))
    title = f"{model.name}: rank-{RANK} adapters, max_loras {MAX_LORAS}, on a CPU"
    write(
        args,
        NAME,
        "cpu",
        step_rows(steps),
        plot_lora(steps, workload, title),
        workload=workload_rows(workload),
        model=str(model),
        rank=RANK,
        max_loras=MAX_LORAS,
    )

"""``minipaged bench moe``: a mixture of experts against a dense model with the same
active parameters, step by step, and where the tokens went.

The MoE model is OLMoE-1B-7B's shape scaled down for a CPU (random weights): 64 experts
per layer, top-8 routing, each expert's MLP an eighth of the dense one's width, the
hidden size a quarter of its ratio to the experts' kept.  The dense model has the same
attention and one MLP as wide as the 8 experts a token uses together, so per token both
multiply by the same number of weights; what differs is that the MoE layer must group
the step's tokens by expert and run 64 small matmuls (two grouped ones) instead of one
large one.  Both serve the same requests, alternately, ``rounds`` times each, and the
ratio of their step times is reported (a ratio measured in one run means something on
any machine), with the MoE model's expert-load histogram over the workload
(``expert_tokens_total``, `minipaged.models.moe.routing_stats`).
"""

from __future__ import annotations

import time

from matplotlib.figure import Figure

from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, one_cpu_thread
from minipaged.core.memory.workloads import synthetic_requests
from minipaged.llm import LLM
from minipaged.models.tiny import cached_checkpoint
from minipaged.sampling_params import SamplingParams

NAME = "moe"
HELP = "a mixture of experts (OLMoE's shape, scaled down) against a dense model"
DESCRIPTION = (
    "Serve the same requests with a scaled-down OLMoE-shaped mixture of experts and a "
    "dense model with the same active parameters, alternately; report the step time "
    "ratio and the experts' load over the workload."
)
# OLMoE-1B-7B: hidden 2048, 16 layers of 16 heads, 64 experts of width 1024, top-8.
OLMOE_SCALED = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=32,
    num_experts=64,
    num_experts_per_tok=8,
    intermediate_size=128,
)


def checkpoints(sizes: dict) -> dict[str, object]:
    """The MoE checkpoint of ``sizes`` and its dense twin: the same attention, one MLP
    as wide as the ``num_experts_per_tok`` experts a token goes through."""
    dense = {k: v for k, v in sizes.items() if k not in ("num_experts", "num_experts_per_tok")}
    dense["intermediate_size"] = sizes["intermediate_size"] * sizes["num_experts_per_tok"]
    return {
        "moe": cached_checkpoint("bench-moe", arch="olmoe", **sizes),
        "dense": cached_checkpoint("bench-moe-dense", arch="llama", **dense),
    }


def run_steps(llm: LLM, prompts: list[list[int]], output_len: int) -> list[float]:
    """Every request at once, stepped by hand: each step's seconds."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{engine.num_steps}-{i}", prompt, params)
    seconds = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def bench_moe(
    num_requests: int = 16,
    output_len: int = 32,
    rounds: int = 3,
    sizes: dict | None = None,
    seed: int = 0,
) -> dict:
    """Both models on the same requests, alternately ``rounds`` times; the per-step
    seconds of each (the median over rounds) and the MoE model's routing totals."""
    if num_requests < 1 or output_len < 1 or rounds < 1:
        raise ValueError(
            f"num_requests, output_len and rounds must be >= 1, got "
            f"{num_requests!r}, {output_len!r}, {rounds!r}"
        )
    sizes = {**OLMOE_SCALED, **(sizes or {})}
    specs = synthetic_requests("alpaca", num_requests, seed=seed, max_len=256)
    prompts = [[(7 * i + j) % 256 for j in range(s.prompt_len)] for i, s in enumerate(specs)]
    settings = dict(device="cpu", swap_space=0, num_gpu_blocks=1024, attention_backend="torch")
    with one_cpu_thread("cpu"):
        llms = {name: LLM(str(path), **settings) for name, path in checkpoints(sizes).items()}
        times = {name: [] for name in llms}
        for _ in range(rounds):
            for name, llm in llms.items():
                times[name].append(run_steps(llm, prompts, output_len))
    routing = llms["moe"].stats()
    return {
        "step_seconds": {
            name: [sorted(step)[len(step) // 2] for step in zip(*runs)]
            for name, runs in times.items()
        },
        "expert_tokens_total": routing["expert_tokens_total"],
        "prompt_tokens": sum(len(p) for p in prompts),
        "rounds": rounds,
        "output_len": output_len,
        "top_k": sizes["num_experts_per_tok"],
    }


def rows(result: dict) -> list[dict]:
    steps = result["step_seconds"]
    return [
        {
            "model": name,
            "steps": len(seconds),
            "total_s": sum(seconds),
            "mean_step_ms": 1e3 * sum(seconds) / len(seconds),
            "vs_dense": sum(seconds) / sum(steps["dense"]),
        }
        for name, seconds in steps.items()
    ]


def format_table(result: dict) -> str:
    return common.format_table(
        rows(result),
        [
            Column("model", "model"),
            Column("steps", "steps"),
            Column("mean step", "mean_step_ms", "{:.1f} ms"),
            Column("time vs dense", "vs_dense", "{:.2f}x"),
        ],
    )


def plot_moe(result: dict, title: str) -> Figure:
    """Step time per step for both models, and the (token, choice) pairs each expert
    received over the workload, summed over the layers."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    steps, load = fig.subplots(1, 2)
    for name, seconds in result["step_seconds"].items():
        steps.plot([1e3 * s for s in seconds], label=name)
    steps.set(xlabel="engine step", ylabel="ms (median of rounds)", yscale="log")
    steps.legend()
    per_expert = [sum(counts) for counts in zip(*result["expert_tokens_total"])]
    load.bar(range(len(per_expert)), per_expert)
    load.set(xlabel="expert", ylabel="pairs over the run, all layers", title="expert load")
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    for flag, default, help_ in (
        ("--num-requests", 16, "requests, all at once"),
        ("--output-len", 32, "tokens generated per request"),
        ("--rounds", 3, "times each model serves the workload, alternately"),
        ("--seed", 0, "the workload's seed"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{help_} (default: %(default)s)")
    add_output_flags(parser, NAME)


def main(args) -> None:
    result = bench_moe(args.num_requests, args.output_len, args.rounds, seed=args.seed)
    print(format_table(result))
    title = f"{args.num_requests} requests: OLMoE's shape scaled down vs dense, on a CPU"
    write(args, NAME, "cpu", rows(result), plot_moe(result, title), **result)

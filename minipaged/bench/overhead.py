"""The engine's own overhead per decode step: the overhead probe of ``minipaged bench
throughput``.

A serving step is also Python: scheduling, block-table bookkeeping, building the
attention metadata, sampling and the update phase.  `measure_engine_overhead` runs the
engine at 256 running sequences with the model's forward replaced by a stub returning
zero hidden states (`ZeroModel`), so that everything but the model runs, and reports
milliseconds per decode step and where they go (`PhaseTimer`; a batch that spends
longer in Python than on the GPU leaves the GPU idle; our goal is 1 ms).  On a CPU the
sampler's random draws over 256 x vocab probabilities are a large part of it, so the
bookkeeping alone (schedule, block operations, inputs, update: `BOOKKEEPING`) is
reported beside the total.

``python -m minipaged.bench.overhead`` runs the probe before (a git commit, checked out
in a temporary worktree) and after (this checkout), alternately, in one run
(`compare_overhead`), on the wall clock or its thread's CPU time (a shared machine).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Callable
from unittest import mock

import torch

from minipaged.bench.common import one_cpu_thread, sync, timed

OVERHEAD_GOAL_MS = 1.0
# A decode step's phases, in step order (`measure_engine_overhead`).
PHASES = (
    "schedule",
    "block_ops",
    "prepare_inputs",
    "model_stub",
    "logits",
    "sample",
    "update",
    "other",
)
# The engine's own Python, which a GPU would wait on: all but the model and the
# sampler's tensor math (on a GPU that runs on the device; on a CPU its random draws
# over 256 x vocab probabilities cost more than all the bookkeeping).
BOOKKEEPING = ("schedule", "block_ops", "prepare_inputs", "update", "other")


class ZeroModel:
    """Stands in for the model's forward: zero hidden states of the right shape, at no
    cost; ``compute_logits`` stays the real LM head (on zeros: uniform logits)."""

    def __init__(self, model, timer: PhaseTimer | None = None) -> None:
        self.model, self.config, self.timer = model, model.config, timer
        self.dtype, self.pp = model.model.embed_tokens.weight.dtype, model.pp

    def __call__(self, input_ids, positions, kv_caches, attn, hidden=None):
        with self.timer.phase("model_stub") if self.timer else contextlib.nullcontext():
            return torch.zeros(
                input_ids.shape[0],
                self.config.hidden_size,
                dtype=self.dtype,
                device=input_ids.device,
            )

    def compute_logits(self, hidden):
        with self.timer.phase("logits") if self.timer else contextlib.nullcontext():
            return self.model.compute_logits(hidden)


class PhaseTimer:
    """Seconds spent per named phase; nested phases are subtracted from their parent,
    and the GPU is synchronised at every boundary so work lands in its own phase."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self._stack = device, defaultdict(float), []

    @contextlib.contextmanager
    def phase(self, name: str):
        sync(self.device)
        start, self._stack = time.perf_counter(), [*self._stack, name]
        try:
            yield
        finally:
            sync(self.device)
            elapsed = time.perf_counter() - start
            self._stack.pop()
            self.seconds[name] += elapsed
            if self._stack:  # the parent's own time excludes this phase
                self.seconds[self._stack[-1]] -= elapsed

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed


def measure_engine_overhead(
    path,
    device: torch.device | str = "cpu",
    num_seqs: int = 256,
    prompt_len: int = 128,
    num_steps: int = 50,
    block_size: int = 16,
    seed: int = 0,
) -> dict:
    """Milliseconds per decode step of the engine at ``num_seqs`` running sequences with
    the model stubbed out (`ZeroModel`): scheduling, block bookkeeping, metadata,
    sampling 256 cheap rows and the update phase.

    ``num_seqs`` requests of ``prompt_len`` random tokens are admitted and prefilled
    until every one decodes; then ``num_steps`` steps are timed bare (the headline
    number), and as many again with each phase timed, GPU synchronised between phases
    (the breakdown, which sums to its own, slightly larger, total).
    """
    from minipaged.config import EngineConfig
    from minipaged.core.memory.block_table import blocks_for
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.sampling_params import SamplingParams

    warmup, budget = 5, max(2048, num_seqs)  # budget: max_num_batched_tokens' default
    # Nobody may finish while timed: early prefills decode while later ones still run,
    # each decode taking a token of the budget the prefills have.
    prefill_steps = -(-num_seqs * prompt_len // max(1, budget - num_seqs))
    max_tokens = prefill_steps + warmup + 2 * num_steps + 8
    per_seq = blocks_for(prompt_len + max_tokens, block_size)
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            device=str(torch.device(device).type),
            block_size=block_size,
            num_gpu_blocks=num_seqs * per_seq,
            swap_space=0,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=budget,
            attention_backend="torch",
            seed=seed,
        )
    )
    engine.runner.model = ZeroModel(engine.runner.model)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(256) for _ in range(prompt_len)], params)
    try:
        while engine.scheduler.waiting or any(
            s.num_uncomputed_tokens > 1 for g in engine.requests.values() for s in g.seqs
        ):
            engine.step()
        for _ in range(warmup):
            engine.step()
        _check_all_running(engine, num_seqs)
        with one_cpu_thread(engine.device):
            _, bare = timed(lambda: [engine.step() for _ in range(num_steps)], engine.device)
            breakdown = _phase_breakdown(engine, num_steps)
        _check_all_running(engine, num_seqs)  # still: every timed step ran them all
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
    return {
        "ms_per_step": bare / num_steps * 1e3,
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "num_steps": num_steps,
        "breakdown_ms": breakdown,
        "bookkeeping_ms_per_step": sum(breakdown[f"{p}_ms"] for p in BOOKKEEPING),
    }


def _check_all_running(engine, num_seqs: int) -> None:
    running = engine.scheduler.num_running_seqs()
    if running != num_seqs:
        raise RuntimeError(f"{running} of {num_seqs} sequences are running")


def _phase_breakdown(engine, num_steps: int) -> dict[str, float]:
    """Time ``num_steps`` steps phase by phase: the engine's parts are wrapped on the
    instance (the sampler, a module-level function, is patched where it is called)."""
    import minipaged.sample.parallel_sampling as sampling_module

    timer = PhaseTimer(engine.device)
    engine.runner.model.timer = timer
    originals = {
        "scheduler.schedule": engine.scheduler.schedule,
        "cache_engine.execute": engine.cache_engine.execute,
        "runner.execute_model": engine.runner.execute_model,
        "sample": engine.sample,
        "scheduler.update_from_output": engine.scheduler.update_from_output,
        "output_processor.outputs": engine.output_processor.outputs,
    }
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.cache_engine.execute = timer.wrap("block_ops", engine.cache_engine.execute)
    engine.runner.execute_model = timer.wrap("prepare_inputs", engine.runner.execute_model)
    # The update: choosing tokens around the sampler's own work, then applying them.
    engine.sample = timer.wrap("update", engine.sample)
    engine.scheduler.update_from_output = timer.wrap("update", engine.scheduler.update_from_output)
    engine.output_processor.outputs = timer.wrap("update", engine.output_processor.outputs)
    try:
        with mock.patch.object(
            sampling_module, "sample", timer.wrap("sample", sampling_module.sample)
        ):
            for _ in range(num_steps):
                with timer.phase("other"):
                    engine.step()
    finally:
        for name in originals:  # back to the class's methods
            owner, _, attr = name.rpartition(".")
            delattr(engine if not owner else getattr(engine, owner), attr)
        engine.runner.model.timer = None
    return {f"{p}_ms": timer.seconds[p] / num_steps * 1e3 for p in PHASES}


def format_overhead(overhead: dict) -> str:
    """`measure_engine_overhead`'s result in two lines: the total and where it goes."""
    parts = "  ".join(
        f"{k.removesuffix('_ms')} {v:.2f}" for k, v in overhead["breakdown_ms"].items()
    )
    return (
        f"engine overhead at {overhead['num_seqs']} running sequences, model stubbed: "
        f"{overhead['ms_per_step']:.2f} ms/step, of which bookkeeping (schedule, block "
        f"ops, inputs, update) {overhead['bookkeeping_ms_per_step']:.2f} ms "
        f"(goal <= {OVERHEAD_GOAL_MS:g} ms)\n"
        f"  where it goes (ms/step, timed separately): {parts}"
    )


def plot_overhead(ax, overhead: dict) -> None:
    """One bar of ms per decode step on ``ax``, split into its phases: the bookkeeping
    first, so that where it ends faces the goal line (dashed); the rest of the step (the
    stub, the LM head, the sampler) after it, in grey."""
    left, rest = 0.0, [p for p in PHASES if p not in BOOKKEEPING]
    for i, phase in enumerate([*BOOKKEEPING, *rest]):
        ms = overhead["breakdown_ms"][f"{phase}_ms"]
        color = f"C{i}" if phase in BOOKKEEPING else str(0.55 + 0.15 * rest.index(phase))
        ax.barh([0], [ms], left=left, label=phase, color=color)
        left += ms
    ax.axvline(
        OVERHEAD_GOAL_MS,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"goal: bookkeeping <= {OVERHEAD_GOAL_MS:g} ms",
    )
    ax.set_yticks([])
    ax.set_xlabel("ms per decode step")
    ax.set_title(f"engine overhead, {overhead['num_seqs']} sequences, model stubbed")
    ax.legend(
        fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, frameon=False
    )


# -- before and after, in one run ------------------------------------------------------
PROBE = """
import json, sys, time
if sys.argv[4] == "cpu":  # the thread's CPU time: what other processes take is not counted
    time.perf_counter = time.thread_time
from minipaged.bench.overhead import measure_engine_overhead
from minipaged.bench.presets import preset_model
from minipaged.bench.throughput import PRESETS
o = measure_engine_overhead(preset_model("cpu", PRESETS), "cpu", num_seqs=int(sys.argv[1]),
                            num_steps=int(sys.argv[2]), prompt_len=int(sys.argv[3]))
print(json.dumps(o))
"""


def compare_overhead(
    baseline: str,
    num_seqs: list[int],
    num_steps: int,
    rounds: int,
    prompt_len: int = 128,
    clock: str = "cpu",
) -> dict:
    """The probe at each of ``num_seqs`` on the git commit ``baseline`` (checked out in
    a temporary worktree) and on this checkout, alternating, ``rounds`` times each, in
    fresh processes; per side the round with the least bookkeeping (the least disturbed
    by other work on the machine).  ``clock="cpu"`` times the probe's thread's CPU time
    instead of the wall clock (torch runs on that one thread): on a shared machine,
    the time other processes take is then not counted."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parents[2]
    results: dict = {
        "baseline": baseline,
        "num_steps": num_steps,
        "rounds": rounds,
        "prompt_len": prompt_len,
        "clock": clock,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(here), "worktree", "add", "--detach", str(worktree), baseline],
            check=True,
            capture_output=True,
        )
        try:
            for n in num_seqs:
                best: dict[str, dict] = {}
                for r in range(rounds):
                    sides = [("before", worktree), ("after", here)]
                    for side, root in sides if r % 2 == 0 else reversed(sides):
                        env = {**os.environ, "PYTHONPATH": str(root)}
                        done = subprocess.run(
                            [
                                sys.executable,
                                "-c",
                                PROBE,
                                str(n),
                                str(num_steps),
                                str(prompt_len),
                                clock,
                            ],
                            cwd=root,
                            env=env,
                            check=True,
                            capture_output=True,
                            text=True,
                        )
                        run = json.loads(done.stdout.strip().splitlines()[-1])
                        key = "bookkeeping_ms_per_step"
                        if side not in best or run[key] < best[side][key]:
                            best[side] = run
                results["runs"][str(n)] = best
        finally:
            subprocess.run(
                ["git", "-C", str(here), "worktree", "remove", "--force", str(worktree)],
                check=False,
                capture_output=True,
            )
    return results


def format_comparison(results: dict) -> str:
    """Per ``num_seqs``, before and after: ms per step of each phase, the bookkeeping,
    and the ratio."""
    lines = []
    for n, sides in results["runs"].items():
        before, after = sides["before"], sides["after"]
        lines.append(
            f"{n} running sequences, prompts of {results['prompt_len']}, model stubbed "
            f"(ms per step, {results['clock']} clock):"
        )
        lines.append(f"  {'phase':<16}{'before':>9}{'after':>9}")
        for phase in PHASES:
            b, a = before["breakdown_ms"][f"{phase}_ms"], after["breakdown_ms"][f"{phase}_ms"]
            lines.append(f"  {phase:<16}{b:>9.2f}{a:>9.2f}")
        b, a = before["bookkeeping_ms_per_step"], after["bookkeeping_ms_per_step"]
        lines.append(f"  {'bookkeeping':<16}{b:>9.2f}{a:>9.2f}   {b / a:.1f}x less")
        b, a = before["ms_per_step"], after["ms_per_step"]
        lines.append(f"  {'whole step':<16}{b:>9.2f}{a:>9.2f}   {b / a:.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(
        description="The engine-overhead probe before (a git commit) and after (this "
        "checkout), alternating, in one run."
    )
    parser.add_argument("--baseline", default="f061e33", help="git commit (default: %(default)s)")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--num-steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=128,
        help="the baseline's probe needs it small at 1,024 sequences (32 will do)",
    )
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="the probe thread's CPU time, or the wall clock (default: %(default)s)",
    )
    parser.add_argument("--output", default="overhead_before_after.json")
    args = parser.parse_args()
    results = compare_overhead(
        args.baseline, args.num_seqs, args.num_steps, args.rounds, args.prompt_len, args.clock
    )
    print(format_comparison(results))
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)

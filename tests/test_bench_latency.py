"""``minipaged.bench.latency``: normalized latency against request rate (paper Fig. 12).

Oracles: the metric and the serving loop on hand-made timings (a fake engine whose
every step takes one second of a fake clock, worked out by hand); Poisson arrivals
checked for seeding, scaling and their mean gap; a tiny end-to-end run whose rows and
JSON are recounted from the workload it served, on the real engine, with every request's
token count and every block checked.
"""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_helpers import run_main
from minipaged import LLM
from minipaged.bench import latency as bench
from minipaged.bench.presets import make_prompts
from minipaged.bench.results import write_results
from minipaged.config import MEMORY_MODES
from minipaged.core.memory.workloads import RequestSpec, arrival_times, synthetic_requests
from minipaged.models import make_tiny_model
from minipaged.sampling_params import SamplingParams

ROW_FIELDS = {
    "mode",
    "rate",
    "num_requests",
    "normalized_latency_s_per_token",
    "mean_latency_s",
    "requests_per_s",
    "output_tokens_per_s",
    "mean_batch",
    "num_steps",
    "num_preemptions",
    "duration_s",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


# -- the metric -----------------------------------------------------------------------


def test_normalized_latency_by_hand():
    """(4 - 0) / 2 = 2, (4 - 1) / 3 = 1, (10 - 4) / 1 = 6: the mean is 3 s/token."""
    assert bench.normalized_latency([0, 1, 4], [4, 4, 10], [2, 3, 1]) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "arrivals, finishes, output_lens, match",
    [
        ([0, 1], [2], [1, 1], "arrivals, finishes and output_lens"),
        ([], [], [], "non-empty"),
        ([0], [1], [0], "output_lens must be >= 1, got 0"),
        ([2], [1], [1], "finishes must not come before"),
    ],
)
def test_normalized_latency_refuses_bad_timings(arrivals, finishes, output_lens, match):
    with pytest.raises(ValueError, match=match):
        bench.normalized_latency(arrivals, finishes, output_lens)


# -- the serving loop on a fake engine and a fake clock ---------------------------------


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Runs every request it has, one token each per step; a step takes 1 s."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.left, self.made, self.added = clock, {}, {}, []

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.left[request_id], self.made[request_id] = params.max_tokens, 0
        self.added.append((request_id, self.clock.now))

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list:
        self.clock.now += 1.0
        outputs = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            self.made[request_id] += 1
            if not self.left[request_id]:
                del self.left[request_id]
                outputs.append(
                    SimpleNamespace(
                        request_id=request_id,
                        finished=True,
                        outputs=[SimpleNamespace(token_ids=[0] * self.made[request_id])],
                    )
                )
        return outputs


def test_serve_by_hand():
    """Arrivals at 0, 0.5 and 5 s, outputs of 2, 1 and 1 tokens, 1 s a step, the fake
    clock starting at 100:
    t=0: r0 arrives and runs; the step ends at 1.  t=1: r1 (arrived at 0.5, during the
    step) joins; both finish in the step ending at 2.  The engine is then idle until 5:
    the clock jumps there (no waiting), r2 runs and finishes at 6.
    Normalized: (2 - 0) / 2, (2 - 0.5) / 1, (6 - 5) / 1: mean 3.5 / 3."""
    clock = FakeClock(100.0)
    engine = FakeEngine(clock)
    params = [SimpleNamespace(max_tokens=n) for n in (2, 1, 1)]
    served = bench.serve(engine, [[1], [2], [3]], params, [0.0, 0.5, 5.0], clock=clock, tag="x")
    assert served.finishes == [2.0, 2.0, 6.0]
    assert served.output_tokens == [2, 1, 1] and served.num_steps == 3
    assert engine.added == [("x0", 100.0), ("x1", 101.0), ("x2", 102.0)]  # 3 s skipped
    assert bench.normalized_latency([0.0, 0.5, 5.0], served.finishes, [2, 1, 1]) == pytest.approx(
        3.5 / 3
    )


# -- the workload and the setting -----------------------------------------------------


def test_requests_keep_the_drawn_lengths_at_full_context():
    assert bench.make_requests("alpaca", 200, 2048, seed=5) == synthetic_requests(
        "alpaca", 200, seed=5, max_len=2048
    )


def test_requests_are_scaled_to_the_context():
    """At a 1024-token context with length_scale 0.5, each length is a quarter of the
    drawn one, rounded, at least 1, and every request fits."""
    drawn = synthetic_requests("sharegpt", 300, seed=2, max_len=2048)
    scaled = bench.make_requests("sharegpt", 300, 1024, length_scale=0.5, seed=2)
    for d, s in zip(drawn, scaled):
        assert s.prompt_len == max(1, round(d.prompt_len / 4))
        assert s.output_len == min(max(1, round(d.output_len / 4)), 1024 - s.prompt_len)
        assert s.total_len <= 1024


def test_resolve_setting_takes_the_preset_unless_overridden():
    setting = bench.resolve_setting("cpu", rates=[5, 10], num_requests=None)
    preset = bench.PRESETS["cpu"]
    assert setting["rates"] == [5, 10] and setting["num_requests"] == preset.num_requests
    assert setting["num_gpu_blocks"] == preset.num_gpu_blocks
    assert set(setting) == set(bench.SETTING)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: bench.check_setting(["paged", "orca"], [1], 4, 1.0), "modes.*'orca'"),
        (lambda: bench.check_setting([], [1], 4, 1.0), "modes"),
        (lambda: bench.check_setting(["paged"], [], 4, 1.0), "rates"),
        (lambda: bench.check_setting(["paged"], [1, 0], 4, 1.0), "rates.*0"),
        (lambda: bench.check_setting(["paged"], [math.inf], 4, 1.0), "rates.*inf"),
        (lambda: bench.check_setting(["paged"], ["fast"], 4, 1.0), "rates.*'fast'"),
        (lambda: bench.check_setting(["paged"], [1], 0, 1.0), "num_requests.*0"),
        (lambda: bench.check_setting(["paged"], [1], 4, 0.0), "length_scale.*0.0"),
        (lambda: bench.make_requests("sharegpt", 4, 256, length_scale=-1), "length_scale"),
        (lambda: bench.resolve_setting("tpu"), "preset.*'tpu'"),
        (lambda: bench.resolve_setting("cpu", rate=3), "overrides.*'rate'"),
        (lambda: bench.bench_latency("nowhere", ["paged"], [1], [], [], {}), "requests"),
        (
            lambda: bench.bench_latency("nowhere", ["fifo"], [1], [RequestSpec(1, 1)], [[1]], {}),
            "modes.*'fifo'",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_make_workload_refuses_an_unknown_workload(tiny):
    with pytest.raises(ValueError, match="workload.*'sharegtp'"):
        bench.make_workload(tiny, "sharegtp", 4, 64)


def test_presets_fit_their_pools():
    """Every preset's Max reservation fits its pool (the engine would refuse it)."""
    for preset in bench.PRESETS.values():
        assert preset.max_model_len <= preset.num_gpu_blocks * preset.block_size


# -- end to end on the engine ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["paged", "contiguous-oracle"])
def test_serve_on_the_engine(tiny, mode):
    """Eight Alpaca-like requests (scaled to 64 tokens: about 10 in, 29 out) at 200
    per second on 128 slots: each generates exactly its output length, finishes after
    it arrived, and every block and range is free afterwards."""
    llm = LLM(
        str(tiny),
        device="cpu",
        block_size=4,
        num_gpu_blocks=32,
        max_model_len=64,
        memory_mode=mode,
        swap_space=0,
    )
    requests = bench.make_requests("alpaca", 8, 64, length_scale=16, seed=1)
    prompts = make_prompts(requests, llm.get_tokenizer(), llm.engine.vocab_size, seed=1)
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    arrivals = arrival_times(8, 200.0, seed=1)
    served = bench.serve(llm.engine, prompts, params, arrivals, tag="r")
    assert served.output_tokens == [r.output_len for r in requests]
    assert all(f >= a for a, f in zip(arrivals, served.finishes))
    assert served.num_steps >= max(r.output_len for r in requests)
    stats = llm.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] and not llm.engine.kv.tables
    assert not llm.engine.has_unfinished_requests()
    if mode != "paged":
        assert llm.engine.scheduler.reservations.starts == {}


def test_bench_end_to_end(tiny, tmp_path):
    """Two modes at two rates, six requests: one row per (mode, rate) in that order,
    every count recounted from the workload, and the results file of the contract."""
    work = bench.make_workload(tiny, "alpaca", 6, max_model_len=64, length_scale=16, seed=0)
    engine = dict(device="cpu", block_size=4, num_gpu_blocks=32, max_model_len=64, swap_space=0)
    modes, rates = ["paged", "contiguous-max"], [50.0, 400.0]
    rows = bench.bench_latency(
        tiny, modes, rates, work.requests, work.prompts, engine, progress=False
    )
    assert [(r["mode"], r["rate"]) for r in rows] == [(m, r) for m in modes for r in rates]
    output_lens = [r.output_len for r in work.requests]
    for row in rows:
        assert ROW_FIELDS <= row.keys()
        assert row["num_requests"] == 6
        # One token per running request per step: tokens = batch x steps.
        assert row["mean_batch"] * row["num_steps"] == pytest.approx(sum(output_lens))
        assert row["num_steps"] >= max(output_lens)
        assert row["normalized_latency_s_per_token"] > 0 and row["duration_s"] > 0
        assert row["output_tokens_per_s"] * row["duration_s"] == pytest.approx(sum(output_lens))
        if row["mode"] == "contiguous-max":
            assert row["num_preemptions"] == 0
            assert row["mean_batch"] <= 2  # 128 slots / 64 reserved a request
    path = write_results(
        tmp_path / "latency.json",
        rows,
        "cpu",
        "minipaged bench latency",
        bench.plot_latency(rows, "test"),
        modes=modes,
    )
    doc = json.loads(path.read_text())
    assert {"device", "torch", "triton", "date", "command", "results", "modes"} <= doc.keys()
    assert doc["results"] == rows
    assert path.with_suffix(".png").stat().st_size > 0
    table = bench.format_table(rows)
    assert len(table.splitlines()) == 2 + len(rows) and "contiguous-max" in table


def test_modes_are_the_engines():
    assert set(bench.COLORS) == set(MEMORY_MODES)


def test_command_line_writes_the_results_file(tmp_path):
    out = tmp_path / "latency.json"
    assert (
        run_main(
            [
                "bench",
                "latency",
                "--preset",
                "cpu",
                "--modes",
                "paged",
                "contiguous-max",
                "--rates",
                "50",
                "--num-requests",
                "6",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "results"} <= set(document)
    assert [(r["mode"], r["rate"]) for r in document["results"]] == [
        ("paged", 50),
        ("contiguous-max", 50),
    ]
    assert out.with_suffix(".png").stat().st_size > 0


def test_every_latency_point_is_inside_the_axes():
    """The committed CPU run, whose highest point is over 10x its lowest: every point is
    drawn inside the axes."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cpu"
    rows = json.loads((results / "latency-sharegpt.json").read_text())["results"]
    axes = bench.plot_latency(rows).axes[0]
    low, high = axes.get_ylim()
    plotted = [y for line in axes.get_lines() for y in line.get_ydata()]
    assert sorted(plotted) == sorted(r["normalized_latency_s_per_token"] for r in rows)
    assert all(low <= y <= high for y in plotted)

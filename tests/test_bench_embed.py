"""``minipaged bench embed``: both systems timed on the same prompts, their embeddings
compared (Hugging Face's batched forward, pooled by the benchmark itself, is the
oracle), ratios and a PNG saved."""

import json

import pytest

from cli_helpers import run_main


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_the_command_times_both_systems_and_they_agree(tiny, tmp_path, capsys, pooling_type):
    path = tiny("llama")[0]
    argv = [
        "bench", "embed", "--model", str(path), "--num-requests", "6", "--min-len", "3",
        "--max-len", "40", "--hf-batch-size", "4", "--pooling-type", pooling_type,
        "--max-num-batched-tokens", "16", "--max-num-seqs", "4", "--out", str(tmp_path),
    ]  # fmt: skip
    assert run_main(argv) in (0, None)
    record = json.loads((tmp_path / "embed.json").read_text())
    rows = {r["system"]: r for r in record["results"]}
    assert set(rows) == {"minipaged", "hf-batched-4"}
    assert record["max_abs_diff"] < 1e-4  # the same vectors, padding and chunking aside
    for row in rows.values():
        assert row["requests_per_s"] == pytest.approx(6 / row["seconds"])
    hf_s = rows["hf-batched-4"]["seconds"]
    assert rows["minipaged"]["vs_hf"] == pytest.approx(hf_s / rows["minipaged"]["seconds"])
    assert rows["hf-batched-4"]["vs_hf"] == pytest.approx(1.0)
    assert (tmp_path / "embed.png").is_file()
    assert "requests/s" in capsys.readouterr().out

"""``minipaged bench mm``: the encoder runs counted against the workload's own images (a
cache for all of them encodes each distinct image once; one for a single image encodes
again whenever the image changes between consecutive admissions, counted from the draw),
the two runs' greedy tokens equal, ratios recomputed from the saved seconds."""

import json

import pytest

from cli_helpers import run_main
from minipaged.bench.mm import workload


def test_the_command_counts_encoder_runs_and_saves_ratios(tmp_path, capsys):
    argv = [
        "bench", "mm", "--num-requests", "12", "--num-images", "3", "--image-size", "40",
        "--max-tokens", "2", "--max-num-seqs", "1", "--block-size", "4", "--out", str(tmp_path),
    ]  # fmt: skip
    assert run_main(argv) in (0, None)
    record = json.loads((tmp_path / "mm.json").read_text())
    rows = {r["system"]: r for r in record["results"]}
    requests, _ = workload(12, 3, 40, seed=0)
    picks = [k for _, k in requests]
    assert rows["all images"]["num_encoded_images"] == len(set(picks))
    # One request at a time, a one-image cache: a miss whenever the image changes.
    changes = 1 + sum(a != b for a, b in zip(picks, picks[1:]))
    assert rows["one image"]["num_encoded_images"] == changes
    assert rows["all images"]["encoder_cache_hit_rate"] == pytest.approx(1 - len(set(picks)) / 12)
    assert rows["no repeats"]["num_encoded_images"] == 12
    assert rows["no repeats"]["encoder_cache_hit_rate"] == 0
    baseline = rows["no repeats"]["seconds"]
    for row in rows.values():
        assert row["speedup"] == pytest.approx(baseline / row["seconds"])
        assert row["requests_per_s"] == pytest.approx(12 / row["seconds"])
    assert (tmp_path / "mm.png").is_file()
    assert "images encoded" in capsys.readouterr().out

"""``minipaged bench lora``: its runs on the tiny model, counted rather than timed."""

import json

from cli_helpers import run_main
from minipaged.bench.lora import MAX_LORAS, SPREADS, bench_lora
from minipaged.models.tiny import cached_checkpoint


def test_every_run_makes_the_same_tokens_and_loads_each_adapter(tmp_path):
    steps, workload = bench_lora(
        cached_checkpoint("bench-sharing"),
        tmp_path,
        batch=8,
        steps=2,
        num_requests=20,
        prompt_len=8,
        output_len=4,
    )
    assert [(r.adapters, r.batch, len(r.step_s)) for r in steps] == [
        (0, 8, 2),
        (1, 8, 2),
        (MAX_LORAS, 8, 2),
    ]
    assert [r.adapters for r in workload] == [0, *SPREADS]
    assert {r.output_tokens for r in workload} == {20 * 4}
    # Each adapter is loaded once while it fits the slots; 16 adapters through 4 slots
    # take at least 16 loads.
    assert [r.num_loads for r in workload[:3]] == [0, 1, 4]
    assert workload[3].num_loads >= 16


def test_results_file(tmp_path):
    out = tmp_path / "lora.json"
    model = cached_checkpoint("bench-sharing")
    argv = ["bench", "lora", "--model", str(model), "--batch", "4", "--steps", "1"]
    argv += ["--num-requests", "4", "--prompt-len", "4", "--output-len", "2", "--json", str(out)]
    assert run_main(argv) == 0
    document = json.loads(out.read_text())
    assert [r["adapters"] for r in document["results"]] == [0, 1, MAX_LORAS]
    assert document["results"][0]["vs_base"] == 1
    assert [r["adapters"] for r in document["workload"]] == [0, *SPREADS]
    assert out.with_suffix(".png").stat().st_size > 0

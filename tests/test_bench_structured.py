"""``minipaged bench structured``: its rows on the tiny model, and what it measures:
the "on" engine's completions hold to the bench's schema (oracle: jsonschema)."""

import json

from cli_helpers import run_main
from minipaged.bench.structured import records_schema
from minipaged.llm import LLM
from minipaged.models.tiny import cached_checkpoint
from minipaged.sampling_params import SamplingParams, StructuredOutputsParams


def test_results_file(tmp_path):
    out = tmp_path / "structured.json"
    model = cached_checkpoint("bench-sharing")
    argv = ["bench", "structured", "--model", str(model), "--batches", "1", "3"]
    argv += ["--steps", "2", "--prompt-len", "4", "--json", str(out)]
    assert run_main(argv) == 0
    results = json.loads(out.read_text())
    rows = results["results"]
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        assert row["tpot_off_ms"] > 0 and row["tpot_on_ms"] > 0
        assert abs(row["on_vs_off"] - row["tpot_on_ms"] / row["tpot_off_ms"]) < 1e-9
    assert results["tokenizer_init_s"] > 0 and results["schema_compile_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_schema_outlasts_the_timed_steps():
    """No structured completion can end before ``steps`` + 1 tokens (the bench's
    ``max_tokens``): the timed steps decode a full batch.  Sampled, several ways."""
    steps = 6
    spec = StructuredOutputsParams(json=records_schema(min_items=steps))
    llm = LLM(str(cached_checkpoint("bench-sharing")), device="cpu", swap_space=0)
    params = SamplingParams(
        n=4, max_tokens=steps + 1, temperature=1.0, seed=0, structured_outputs=spec
    )
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    for completion in out.outputs:
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == steps + 1

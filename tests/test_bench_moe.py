"""``minipaged bench moe``: a mixture of experts against its dense twin.  Timings are
not checked (they depend on the machine); what is: both models ran the same steps, and
the expert-load histogram holds exactly top-k pairs per token each layer ran, counted
by hand from the workload (every prompt token, and every generated token but the last,
goes through the model once)."""

import json

from cli_helpers import run_main
from minipaged.bench.moe import bench_moe, checkpoints
from minipaged.models import load_model

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    intermediate_size=16,
)


def test_load_counts_top_k_pairs_per_token_and_both_models_step_alike():
    result = bench_moe(num_requests=3, output_len=4, rounds=1, sizes=TINY)
    steps = result["step_seconds"]
    assert len(steps["moe"]) == len(steps["dense"]) > 0
    tokens = result["prompt_tokens"] + 3 * (4 - 1)
    assert [sum(layer) for layer in result["expert_tokens_total"]] == [2 * tokens] * 2


def test_dense_twin_has_the_moe_models_active_parameters():
    paths = checkpoints(TINY)
    moe, dense = (load_model(paths[name]) for name in ("moe", "dense"))
    expert = moe.model.layers[0].mlp.experts
    active = 2 * (expert.gate_up_proj.weight[0].numel() + expert.down_proj.weight[0].numel())
    mlp = dense.model.layers[0].mlp
    assert mlp.gate_up_proj.weight.numel() + mlp.down_proj.weight.numel() == active


def test_results_file(tmp_path):
    out = tmp_path / "moe.json"
    argv = ["bench", "moe", "--num-requests", "2", "--output-len", "2", "--rounds", "1"]
    assert run_main([*argv, "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [row["model"] for row in saved["results"]] == ["moe", "dense"]
    assert out.with_suffix(".png").stat().st_size > 0

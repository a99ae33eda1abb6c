"""Mixture-of-experts layers and models against Hugging Face transformers (the oracle).

The routers against each family's own ``*TopKRouter``, the readable loop against
``MixtralExperts``, the grouped path against the loop (experts that receive no token
included), the three families' logits against HF over a paged cache, and the loader's
split of the experts over ranks against the checkpoint's own tensors.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from engine_helpers import make_llm
from minipaged import SamplingParams
from minipaged.distributed.parallel_state import TensorParallelGroup
from minipaged.models import load_model
from minipaged.models.moe import (
    Routing,
    expert_ranges,
    moe_grouped,
    moe_reference,
    route,
    routing_stats,
)
from minipaged.models.moe_models import MODELS, MixtralForCausalLM
from test_models import FP32, PagedRunner, hf_logits, random_tokens, run_schedule

ARCHS = ["mixtral", "qwen2_moe", "olmoe"]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- the router ------------------------------------------------------------------------
ROUTERS = {
    "mixtral": (MixtralTopKRouter, MixtralConfig, True, True),
    "qwen2_moe": (Qwen2MoeTopKRouter, Qwen2MoeConfig, False, False),
    "qwen2_moe-renormalised": (Qwen2MoeTopKRouter, Qwen2MoeConfig, True, False),
    "olmoe": (OlmoeTopKRouter, OlmoeConfig, False, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ROUTERS)
def test_route_equals_each_familys_router(family, dtype):
    router_cls, config_cls, renormalize, float32_weights = ROUTERS[family]
    config = config_cls(
        hidden_size=32, num_experts=7, num_experts_per_tok=3, norm_topk_prob=renormalize
    )
    hf = router_cls(config).to(dtype)
    torch.nn.init.normal_(hf.weight, std=0.5, generator=generator(0))
    x = torch.randn(40, 32, generator=generator(1)).to(dtype)
    with torch.no_grad():
        logits, hf_weights, hf_experts = hf(x)
        ours = route(logits, 3, renormalize, torch.float32 if float32_weights else dtype)
    assert ours.weights.dtype == hf_weights.dtype
    assert torch.equal(ours.experts, hf_experts)
    torch.testing.assert_close(ours.weights, hf_weights, atol=0, rtol=0)
    if renormalize:
        sums = ours.weights.float().sum(-1)
        torch.testing.assert_close(sums, torch.ones(40), atol=1e-2, rtol=0)  # bfloat16 too


# -- the readable loop and the grouped path --------------------------------------------
def random_layer(num_experts, hidden, intermediate, tokens, top_k, unused=(), seed=0):
    """Expert weights, inputs and a routing that never picks the ``unused`` experts."""
    g = generator(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate**0.5
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, list(unused)] = float("-inf")
    return x, w13, w2, route(logits, top_k, True, torch.float32)


def test_reference_loop_equals_transformers_experts():
    x, w13, w2, routing = random_layer(6, 32, 16, tokens=25, top_k=2, unused=[4])
    config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=6)
    hf = MixtralExperts(config)
    hf.gate_up_proj.data.copy_(w13)
    hf.down_proj.data.copy_(w2)
    with torch.no_grad():
        expected = hf(x, routing.experts, routing.weights)
    torch.testing.assert_close(moe_reference(x, w13, w2, routing, F.silu), expected, **FP32)


@pytest.mark.parametrize(
    "tokens, top_k, unused",
    [(1, 2, []), (3, 2, [0, 2, 5, 6]), (50, 2, [1]), (50, 4, []), (17, 1, [3, 4, 5, 6, 7])],
)
def test_grouped_path_equals_the_loop(tokens, top_k, unused):
    x, w13, w2, routing = random_layer(8, 32, 16, tokens, top_k, unused, seed=tokens)
    assert not set(routing.experts.flatten().tolist()) & set(unused)
    expected = moe_reference(x, w13, w2, routing, F.silu)
    torch.testing.assert_close(moe_grouped(x, w13, w2, routing, F.silu), expected, **FP32)


def test_grouped_path_equals_the_loop_in_bfloat16():
    x, w13, w2, routing = random_layer(5, 32, 16, tokens=30, top_k=2, unused=[2])
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    routing = Routing(routing.weights.bfloat16(), routing.experts)
    expected = moe_reference(x, w13, w2, routing, F.silu).float()
    torch.testing.assert_close(
        moe_grouped(x, w13, w2, routing, F.silu).float(), expected, atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("num_experts, size", [(5, 2), (6, 4), (7, 4), (4, 4), (8, 2)])
def test_expert_ranges_cover_every_expert_once_and_evenly(num_experts, size):
    ranges = expert_ranges(num_experts, size)
    assert [e for r in ranges for e in r] == list(range(num_experts))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


# -- the three families against HF -----------------------------------------------------
@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("mixtral", {}),
        ("qwen2_moe", {}),
        # A dense layer among the sparse ones, and renormalised top-k weights.
        ("qwen2_moe", dict(mlp_only_layers=(1,), norm_topk_prob=True)),
        ("olmoe", {}),
        # Biases on q/k/v/o, and q/k/v clipped.
        ("olmoe", dict(attention_bias=True, clip_qkv=0.5, norm_topk_prob=True)),
    ],
)
def test_chunked_prefill_and_decode_logits_equal_hf(tiny, arch, overrides):
    path, oracle = tiny(arch, **overrides)
    ours = load_model(path)
    assert type(ours) is MODELS[type(oracle.hf).__name__]
    sequences = {"A": random_tokens(17, seed=2), "B": random_tokens(13, seed=3)}
    full = {seq: hf_logits(oracle.hf, tokens) for seq, tokens in sequences.items()}
    for seq, start, end, logits in run_schedule(PagedRunner(ours, block_size=4), sequences):
        torch.testing.assert_close(logits, full[seq][start:end], **FP32)


def test_routing_stats_count_hfs_router_choices(tiny):
    """One prompt, one step: the counts are the top-2 of HF's router logits per layer."""
    path, oracle = tiny("olmoe")
    prompt = random_tokens(23, seed=4)
    with torch.no_grad():
        router_logits = oracle.hf(torch.tensor([prompt]), output_router_logits=True).router_logits
    expected = [
        torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=6).tolist()
        for logits in router_logits
    ]
    llm = make_llm(path, attention_backend="torch")
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    stats = llm.stats()
    assert stats["expert_tokens"] == stats["expert_tokens_total"] == expected
    counts = torch.tensor(expected, dtype=torch.float)
    imbalance = (counts.max(dim=1).values / counts.mean(dim=1)).mean()
    assert stats["expert_load_imbalance"] == pytest.approx(float(imbalance))


def test_dense_models_report_no_routing(tiny):
    path, _ = tiny("llama")
    assert routing_stats(load_model(path)) == {}


# -- loading a rank's experts ----------------------------------------------------------
def test_mixtral_checkpoints_keep_the_hubs_expert_names(tiny):
    path, _ = tiny("mixtral")
    names = load_file(path / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.experts.4.w3.weight" in names
    assert not any(".mlp." in name for name in names)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_loads_its_experts_or_its_slice_of_each(tiny, arch, expert_parallel):
    path, _ = tiny(arch)
    stored = load_file(path / "model.safetensors")
    prefix = "model.layers.1." + ("block_sparse_moe" if arch == "mixtral" else "mlp")
    gate, up, down = MODELS[type(load_model(path)).__name__].expert_names
    num_experts = load_model(path).config.num_experts
    for rank in range(2):
        tp = TensorParallelGroup(rank, 2, expert_parallel=expert_parallel)
        experts = load_model(path, tp=tp).model.layers[1].mlp.experts
        held = expert_ranges(num_experts, 2)[rank] if expert_parallel else range(num_experts)
        assert experts.gate_up_proj.weight.shape[0] == len(held)
        for local, expert in enumerate(held):
            w = {p: stored[f"{prefix}.experts.{expert}.{p}.weight"] for p in (gate, up, down)}
            if not expert_parallel:  # this rank's half of the intermediate size
                rows = slice(rank * 16, (rank + 1) * 16)
                w = {gate: w[gate][rows], up: w[up][rows], down: w[down][:, rows]}
            torch.testing.assert_close(
                experts.gate_up_proj.weight[local], torch.cat([w[gate], w[up]]), atol=0, rtol=0
            )
            torch.testing.assert_close(experts.down_proj.weight[local], w[down], atol=0, rtol=0)


# -- refusals --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, kwargs, name",
    [
        ("llama", dict(enable_expert_parallel=True), "enable_expert_parallel"),
        ("olmoe", dict(enable_expert_parallel=True, tensor_parallel_size=8), "enable_expert"),
        ("mixtral", dict(all2all_backend="pplx"), "all2all_backend"),
        ("mixtral", dict(enable_expert_parallel="yes"), "enable_expert_parallel"),
    ],
)
def test_expert_parallel_settings_that_cannot_work_are_refused(tiny, arch, kwargs, name):
    path, _ = tiny(arch)
    with pytest.raises(ValueError, match=name):
        make_llm(path, attention_backend="torch", **kwargs)


def test_experts_must_split_under_tensor_parallelism_but_not_under_expert_parallelism(tiny):
    path, _ = tiny("mixtral", intermediate_size=30)
    config = load_model(path).config
    with pytest.raises(ValueError, match="intermediate_size"):
        MixtralForCausalLM.check_parallel(config, 4)
    MixtralForCausalLM.check_parallel(config, 4, expert_parallel=True)


def test_metrics_expose_the_routing(tiny):
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from minipaged.server.metrics import make_registry

    path, _ = tiny("mixtral")
    llm = make_llm(path, attention_backend="torch")
    llm.generate([{"prompt_token_ids": random_tokens(9, seed=5)}], use_tqdm=False)
    stats = llm.engine.counters()
    text = generate_latest(make_registry(SimpleNamespace(stats=stats))).decode()
    for layer, counts in enumerate(stats["expert_tokens_total"]):
        for expert, count in enumerate(counts):
            sample = f'minipaged:expert_tokens_total{{expert="{expert}",layer="{layer}"}} {count}.0'
            assert sample in text
    assert f"minipaged:expert_load_imbalance {stats['expert_load_imbalance']}" in text

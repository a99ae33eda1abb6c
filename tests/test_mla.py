"""Multi-head latent attention (DeepSeek-V2) against two oracles.

- The ops and `MLAPagedAttention` against the naive one: every head's full keys and
  values rebuilt from the latents (``kv_b_proj`` on ``c_kv``, ``k_pe`` broadcast), then
  contiguous attention in float64 (`minipaged.ops.attention_oracle`).  Prefill
  (decompressed), absorbed decode and unabsorbed decode, on the torch, CPU and Triton
  backends (Triton in its interpreter), over shuffled blocks whose unwritten slots hold
  NaN, and an fp8 cache, whose oracle reads the same bytes times the same scale.
- `DeepseekV2ForCausalLM` against transformers' on tiny checkpoints of several shapes:
  ``q_lora_rank`` None and set, YaRN, group-limited routing, biases, a routed scaling
  factor; logits over chunked prefill and decode, then greedy tokens through the whole
  engine with swap preemption, prefix caching, chunked prefill and n > 1, and over two
  tensor- and expert-parallel ranks.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import pytest
import torch

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import SamplingParams
from minipaged.core.memory.block_table import blocks_for
from minipaged.distributed.layers import ColumnParallelLinear
from minipaged.models import AttentionMetadata, allocate_kv_caches, load_model
from minipaged.models.deepseek_v2 import (
    ABSORPTION_ENV,
    DeepseekV2ForCausalLM,
    MLAPagedAttention,
    deepseek_route,
    set_mla_absorption,
)
from minipaged.ops import attention_oracle, kv_quant, mla
from minipaged.worker.cache_engine import block_bytes
from test_models import PagedRunner, hf_logits, random_tokens, run_schedule

HEADS, NOPE, ROPE, V_DIM, RANK = 4, 16, 8, 12, 24
SCALE = (NOPE + ROPE) ** -0.5
BACKENDS = ["torch", "cpu", "triton"]
# float64 oracle against float32 kernels; the absorbed form also sums in another order.
FP32 = dict(atol=2e-5, rtol=1e-5)


def generator(seed):
    return torch.Generator().manual_seed(seed)


# -- the ops against the naive oracle --------------------------------------------------
def naive(q_nope, q_pe, latents, w_kv_b, causal):
    """Attention of one sequence with every head's K/V rebuilt from ``latents [L,
    RANK + ROPE]``: ``k = [W_UK c_kv, k_pe]``, ``v = W_UV c_kv``."""
    c_kv, k_pe = latents.double().split([RANK, ROPE], dim=-1)
    kv = torch.einsum("lr,hdr->lhd", c_kv, w_kv_b.double().view(HEADS, NOPE + V_DIM, RANK))
    k_nope, v = kv.split([NOPE, V_DIM], dim=-1)
    keys = torch.cat((k_nope, k_pe[:, None].expand(-1, HEADS, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1).double()
    # The oracle takes one head width: pad the values to the keys' (zeros change nothing).
    v = torch.nn.functional.pad(v, (0, NOPE + ROPE - V_DIM))
    out = attention_oracle(query, keys, v, SCALE, causal=causal)[..., :V_DIM]
    return out.to(q_nope.dtype)


class Step:
    """Sequences of ``(num_cached, num_new)`` tokens, their blocks drawn from a shuffled
    pool whose slots hold NaN until written; the cached latents are in the cache before
    the step, the step writes the new ones, the oracle reads them all."""

    def __init__(self, shapes, block_size, dtype=torch.float32, seed=0):
        g = generator(seed)
        self.cache = torch.full((64, block_size, RANK + ROPE), float("nan")).to(dtype)
        self.scale = torch.tensor(0.05) if kv_quant.is_quantized(dtype) else None
        free = torch.randperm(64, generator=g).tolist()
        self.latents = torch.randn(sum(c + n for c, n in shapes), RANK + ROPE, generator=g)
        tables, slots, self.histories, offset = [], [], [], 0
        for cached, new in shapes:
            table = [free.pop() for _ in range(blocks_for(cached + new, block_size))]
            slot = [
                table[i // block_size] * block_size + i % block_size for i in range(cached + new)
            ]
            if cached:
                prefix = self.latents[offset : offset + cached]
                mla.write_latent(prefix, self.cache, torch.tensor(slot[:cached]), self.scale)
            tables.append(table)
            slots += slot[cached:]
            self.histories.append((offset, cached, new))
            offset += cached + new
        rows = [o + c + i for o, c, n in self.histories for i in range(n)]
        self.new = self.latents[rows]
        self.attn = AttentionMetadata.build(
            tables, [c for c, _ in shapes], [n for _, n in shapes], block_size, slot_mapping=slots
        )

    def stored(self, offset, length):
        """What the cache gives back for these latents: fp8's rounding included."""
        latents = self.latents[offset : offset + length]
        if self.scale is None:
            return latents
        quantized = kv_quant.quantize(latents, self.scale, self.cache.dtype)
        return kv_quant.dequantize(quantized, self.scale)


SHAPES = {
    "decodes": [(5, 1), (17, 1), (1, 1), (33, 1)],
    "prefills": [(0, 7), (9, 4), (0, 2)],
    "mixed": [(0, 6), (12, 3), (20, 1), (3, 1)],
}


@pytest.fixture(scope="module")
def kv_b_proj():
    layer = ColumnParallelLinear(RANK, {"kv_b_proj": HEADS * (NOPE + V_DIM)}, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator(7)) / RANK**0.5)
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "unabsorbed"])
@pytest.mark.parametrize("shapes, block_size", [("decodes", 4), ("prefills", 4), ("mixed", 16)])
def test_latent_attention_equals_the_naive_oracle(kv_b_proj, backend, absorb, shapes, block_size):
    step = Step(SHAPES[shapes], block_size, seed=block_size)
    tokens = step.new.shape[0]
    g = generator(3)
    q_nope, q_pe = (
        torch.randn(tokens, HEADS, NOPE, generator=g),
        torch.randn(tokens, HEADS, ROPE, generator=g),
    )
    layer = MLAPagedAttention(SCALE, backend, NOPE, V_DIM, absorb)
    with torch.no_grad():
        out = layer(q_nope, q_pe, step.new, (step.cache,), step.attn, kv_b_proj)
    row = 0
    for offset, cached, new in step.histories:
        expected = naive(
            q_nope[row : row + new],
            q_pe[row : row + new],
            step.stored(offset, cached + new),
            kv_b_proj.weight,
            causal=True,
        )
        torch.testing.assert_close(out[row : row + new], expected, **FP32)
        row += new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_latent_cache_equals_the_oracle_on_its_bytes(kv_b_proj, backend, fp8):
    step = Step(SHAPES["mixed"], 4, dtype=fp8, seed=1)
    tokens = step.new.shape[0]
    g = generator(4)
    q_nope, q_pe = (
        torch.randn(tokens, HEADS, NOPE, generator=g),
        torch.randn(tokens, HEADS, ROPE, generator=g),
    )
    for absorb in (True, False):
        layer = MLAPagedAttention(SCALE, backend, NOPE, V_DIM, absorb)
        with torch.no_grad():
            out = layer(q_nope, q_pe, step.new, (step.cache, step.scale), step.attn, kv_b_proj)
        row = 0
        for offset, cached, new in step.histories:
            expected = naive(
                q_nope[row : row + new],
                q_pe[row : row + new],
                step.stored(offset, cached + new),
                kv_b_proj.weight,
                causal=True,
            )
            torch.testing.assert_close(out[row : row + new], expected, **FP32)
            row += new


def test_the_latent_cache_is_one_vector_per_token_and_layer(tmp_path):
    from minipaged.models import make_tiny_model
    from minipaged.models.loader import read_config

    config = read_config(make_tiny_model(tmp_path, arch="deepseek_v2"))
    caches = allocate_kv_caches(config, 10, 4, torch.bfloat16, "cpu")
    assert len(caches) == config.num_hidden_layers
    assert [tuple(t.shape) for t in caches[0]] == [(10, 4, 24 + 8)]
    fp8 = allocate_kv_caches(config, 10, 4, torch.float8_e4m3fn, "cpu")
    assert fp8[0][0].shape == (10, 4, 32) and fp8[0][1].shape == ()  # one scale a layer
    assert block_bytes(config, 4, torch.bfloat16) == 2 * 4 * 32 * 2
    with pytest.raises(ValueError, match="int8"):
        allocate_kv_caches(config, 10, 4, torch.int8, "cpu")


# -- the router ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method, groups",
    [("greedy", (None, None)), ("group_limited_greedy", (3, 2)), ("group_limited_greedy", (4, 1))],
)
def test_routing_equals_transformers_router(method, groups):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    n_group, topk_group = groups
    config = DeepseekV2Config(
        hidden_size=32,
        n_routed_experts=12,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=1.7,
    )
    hf = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(hf.weight, std=0.5, generator=generator(0))
    x = torch.randn(40, 32, generator=generator(1))
    with torch.no_grad():
        logits, hf_weights, hf_experts = hf(x)
    ours = deepseek_route(logits, 3, 1.7, n_group, topk_group)
    order = hf_experts.argsort(dim=-1)  # HF's top-k is unsorted; compare as sets
    torch.testing.assert_close(
        ours.experts.sort(dim=-1).values, hf_experts.gather(1, order), atol=0, rtol=0
    )
    ours_order = ours.experts.argsort(dim=-1)
    torch.testing.assert_close(
        ours.weights.gather(1, ours_order), hf_weights.gather(1, order), atol=0, rtol=0
    )


# -- the model against transformers ---------------------------------------------------
YARN = dict(
    type="yarn",
    factor=4.0,
    original_max_position_embeddings=256,
    beta_fast=32,
    beta_slow=1,
    mscale=0.707,
    mscale_all_dim=0.707,
)
SHAPES_OF_MODELS = {
    "v2-lite-like": {},  # q_lora_rank None
    "q_lora-yarn-groups": dict(
        q_lora_rank=12,
        rope_scaling=YARN,
        topk_method="group_limited_greedy",
        n_group=3,
        topk_group=2,
        routed_scaling_factor=2.5,
        n_shared_experts=2,
        attention_bias=True,
    ),
    "wide-latent-no-dense": dict(
        kv_lora_rank=40,
        qk_rope_head_dim=16,
        qk_nope_head_dim=8,
        v_head_dim=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        first_k_dense_replace=0,
        q_lora_rank=20,
    ),
}


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("shape", SHAPES_OF_MODELS)
def test_chunked_prefill_and_decode_logits_equal_hf(tiny, shape, backend):
    if backend == "triton" and shape != "q_lora-yarn-groups":
        pytest.skip("the interpreter is slow: one shape is enough for Triton")
    path, oracle = tiny("deepseek_v2", **SHAPES_OF_MODELS[shape])
    ours = load_model(path, attention_backend=backend)
    assert type(ours) is DeepseekV2ForCausalLM
    sequences = {"A": random_tokens(17, seed=2), "B": random_tokens(13, seed=3)}
    full = {seq: hf_logits(oracle.hf, tokens) for seq, tokens in sequences.items()}
    for absorb in (True, False):
        set_mla_absorption(ours, absorb)
        for seq, start, end, logits in run_schedule(PagedRunner(ours, block_size=4), sequences):
            torch.testing.assert_close(logits, full[seq][start:end], atol=1e-4, rtol=1e-5)


def test_the_environment_flag_builds_models_that_decode_unabsorbed(tiny, monkeypatch):
    """``MINIPAGED_MLA_DISABLE_ABSORPTION=1``: every layer decodes by decompressing the
    latents (the absorbed op is never called), and still equals transformers."""
    path, oracle = tiny("deepseek_v2")
    assert all(m.absorb for m in mla_layers(load_model(path, attention_backend="torch")))
    monkeypatch.setenv(ABSORPTION_ENV, "1")
    ours = load_model(path, attention_backend="torch")
    assert not any(m.absorb for m in mla_layers(ours))

    def absorbed(*args, **kwargs):
        raise AssertionError("decoded in the absorbed form")

    monkeypatch.setattr(mla, "decode_absorbed", absorbed)
    tokens = random_tokens(9, seed=4)
    runner = PagedRunner(ours, block_size=4)
    (prefill,) = runner.step([("A", tokens[:-1], 0)])
    (decode,) = runner.step([("A", tokens[-1:], len(tokens) - 1)])
    expected = hf_logits(oracle.hf, tokens)
    torch.testing.assert_close(torch.cat((prefill, decode)), expected, atol=1e-4, rtol=1e-5)


def mla_layers(model):
    return [m for m in model.modules() if isinstance(m, MLAPagedAttention)]


MAX_TOKENS = 8
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
SHARED = random_prompt(3 * BLOCK_SIZE, seed=99)  # three full blocks, for the prefix cache
# test_moe_engine's prompts: the pool holds the largest request but not the batch.
PROMPTS = [
    random_prompt(3, 0),
    SHARED + random_prompt(14, 1),
    random_prompt(17, 2),
    SHARED + random_prompt(5, 3),
    random_prompt(9, 4),
]
POOL = dict(
    block_size=BLOCK_SIZE,
    preemption_mode="swap",
    enable_prefix_caching=True,
    num_gpu_blocks=max(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS) + 1,
)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_equals_hf_with_every_feature_at_once(tiny, backend):
    """Swap preemption, prefix caching (copy-on-write of the shared blocks' latents),
    chunked prefill (8 tokens a step) and n = 2, over the latent cache."""
    path, oracle = tiny("deepseek_v2", q_lora_rank=12)
    llm = make_llm(
        path, max_num_seqs=4, max_num_batched_tokens=8, attention_backend=backend, **POOL
    )
    outputs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, 2)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_swapped_out_blocks"] > 0
    # The pool is too small for the shared prefix to outlive the batch: one prompt
    # caches it, the next reads its latents from the cache.
    for seed in (5, 6):
        again = [SHARED + random_prompt(6, seed)]
        outputs = llm.generate(as_inputs(again), GREEDY, use_tqdm=False)
        assert_greedy_matches_hf(outputs, again, oracle, MAX_TOKENS, 2)
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    twice = llm.generate(
        as_inputs(PROMPTS[:1]),
        SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    expected, _ = oracle.greedy(PROMPTS[0], MAX_TOKENS)
    assert [c.token_ids for c in twice[0].outputs] == [expected, expected]
    assert_all_blocks_free(llm)
    # 2 layers x (kv_lora_rank 24 + qk_rope_head_dim 8) x float32.
    assert stats["kv_cache_bytes_per_token"] == 2 * (24 + 8) * 4


def test_metrics_report_the_latent_caches_bytes_per_token(tiny):
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from minipaged.server.metrics import make_registry

    per_token = {}
    for arch in ("deepseek_v2", "llama"):
        path, _ = tiny(arch)
        stats = make_llm(path, attention_backend="torch", num_gpu_blocks=8).engine.counters()
        text = generate_latest(make_registry(SimpleNamespace(stats=stats))).decode()
        per_token[arch] = stats["kv_cache_bytes_per_token"]
        assert f"minipaged:kv_cache_bytes_per_token {float(per_token[arch])}" in text
    # 2 layers x 32 latent values, against 2 layers x 2 KV heads x 16 x (key, value).
    assert per_token == {"deepseek_v2": 2 * 32 * 4, "llama": 2 * 2 * 16 * 2 * 4}


def test_recompute_preemption_and_an_fp8_cache_run_through_the_engine(tiny):
    """Recompute preemption rewrites the latents HF's tokens need.  fp8 rounds the
    latents, which moves this tiny model's logits too far for HF to judge (its 0.3-wide
    weights amplify 2^-4 of rounding): the C++ kernel's run is checked against the torch
    reference's, which reads the same bytes by plain indexing (the ops' oracle test
    checks both against the naive one)."""
    path, oracle = tiny("deepseek_v2")
    llm = make_llm(path, attention_backend="cpu", **{**POOL, "preemption_mode": "recompute"})
    outputs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, 2)
    assert llm.stats()["num_preemptions"] > 0
    runs = {}
    for backend in ("cpu", "torch"):
        fp8 = make_llm(path, attention_backend=backend, kv_cache_dtype="fp8", **POOL)
        assert fp8.engine.cache_engine.gpu_cache[0][0].dtype == torch.float8_e4m3fn
        runs[backend] = fp8.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
        assert fp8.stats()["num_swapped_out_blocks"] > 0
        assert_all_blocks_free(fp8)
    for kernel, reference in zip(runs["cpu"], runs["torch"]):
        assert kernel.outputs[0].token_ids == reference.outputs[0].token_ids
        for ours, theirs in zip(kernel.outputs[0].logprobs, reference.outputs[0].logprobs):
            assert ours.keys() == theirs.keys()
            for token in ours:
                assert ours[token] == pytest.approx(theirs[token], abs=2e-4)


@pytest.mark.parametrize(
    "parallel",
    [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)],
    ids=["tp2", "ep2"],
)
def test_heads_split_over_ranks_latent_cache_replicated_equals_hf(tiny, parallel):
    path, oracle = tiny("deepseek_v2", q_lora_rank=12)
    llm = make_llm(path, attention_backend="torch", **POOL, **parallel)
    try:
        outputs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
        assert_greedy_matches_hf(outputs, PROMPTS, oracle, MAX_TOKENS, logprobs=2)
        assert llm.stats()["num_swapped_out_blocks"] > 0
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_each_rank_holds_its_heads_and_the_whole_latent_path(tiny):
    from minipaged.distributed.parallel_state import TensorParallelGroup

    path, _ = tiny("deepseek_v2", q_lora_rank=12)
    whole = load_model(path).model.layers[0].self_attn
    for rank in range(2):
        attn = load_model(path, tp=TensorParallelGroup(rank, 2)).model.layers[0].self_attn
        assert attn.num_heads == 2
        heads = slice(rank * 2 * 32, (rank + 1) * 2 * 32)  # 2 heads of nope 16 + v 16
        torch.testing.assert_close(
            attn.kv_b_proj.weight, whole.kv_b_proj.weight[heads], atol=0, rtol=0
        )
        for name in ("kv_a_proj_with_mqa", "q_a_proj"):
            torch.testing.assert_close(
                getattr(attn, name).weight, getattr(whole, name).weight, atol=0, rtol=0
            )


def test_configs_it_cannot_run_are_refused(tiny, tmp_path):
    from minipaged.models import make_tiny_model

    path = make_tiny_model(tmp_path, arch="deepseek_v2", topk_method="noaux_tc")
    with pytest.raises(ValueError, match="topk_method"):
        load_model(path)
    path, _ = tiny("deepseek_v2")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        make_llm(path, attention_backend="torch", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="enable_lora"):
        make_llm(path, attention_backend="torch", enable_lora=True)
    with pytest.raises(ValueError, match="compilation_config"):
        make_llm(path, attention_backend="cpu", compilation_config={"mode": 1})
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        DeepseekV2ForCausalLM.check_parallel(load_model(path).config, 3)

"""A quantized KV cache in the engine (``LLM(kv_cache_dtype=...)``): the pool sized in
bytes, and every feature that moves or shares blocks over quantized ones.

The oracle for a feature is the same engine and cache format without it (a pool big
enough that nothing is preempted, no prefix cache, whole prompts): moving a block's
bytes (swap), copying them (copy-on-write for n > 1 and beam search) or reading cached
ones (prefix caching) must not change a single token.  Recomputing a preempted request
and chunking a prompt write the same keys again, and both formats round what a token
leaves on its own (fp8 each element, int8 each token's head over its own scale), so
they too must agree.  Tensor parallelism splits the KV
heads, whose scales are their own (fp8's per layer on each rank, int8's per head), so
TP=2 equals TP=1 (each rank calculating fp8 scales from its own heads would not).  How
far a quantized cache moves the tokens from the model's own dtype is measured on
SmolLM2 in ``docs/performance.md``, not asserted here.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import as_inputs, assert_all_blocks_free, make_llm, random_prompt
from minipaged import SamplingParams
from minipaged.core.memory.block_table import blocks_for
from minipaged.sampling_params import BeamSearchParams
from minipaged.worker.cache_engine import GIB

BLOCK_SIZE = 4
MAX_TOKENS = 10
PROMPTS = [random_prompt(length, seed) for seed, length in enumerate([3, 30, 17, 9, 25])]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(n=2, temperature=0.9, max_tokens=MAX_TOKENS, seed=7, ignore_eos=True)
NEEDED = sum(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS)
# Holds the largest request but not the batch: requests are preempted.
TIGHT = max(blocks_for(len(p) + MAX_TOKENS, BLOCK_SIZE) for p in PROMPTS) + 2
TIGHT_FORKED = 2 * TIGHT  # two sequences (n = 2, two beams) of the largest request
SHARED = random_prompt(12, 99)


@pytest.fixture(scope="module")
def path(tiny):
    return tiny("llama")[0]


def run(path, prompts=PROMPTS, params=GREEDY, beam=False, **kwargs):
    """Token ids per request (per completion), the stats, after checking no block leaked."""
    kwargs.setdefault("num_gpu_blocks", 4 * NEEDED)
    llm = make_llm(path, block_size=BLOCK_SIZE, **kwargs)
    if beam:
        outputs = llm.beam_search(as_inputs(prompts), BeamSearchParams(beam_width=2, max_tokens=6))
        tokens = [[s.tokens for s in o.sequences] for o in outputs]
    else:
        outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        tokens = [[c.token_ids for c in o.outputs] for o in outputs]
    stats = llm.stats()
    assert_all_blocks_free(llm)
    llm.shutdown()
    return tokens, stats


# feature: (run kwargs, what shows it happened, formats it holds exactly for)
FEATURES = {
    "swap": (
        dict(num_gpu_blocks=TIGHT, preemption_mode="swap"),
        lambda s: s["num_swapped_out_blocks"] > 0,
        ("fp8", "int8"),
    ),
    "recompute": (
        dict(num_gpu_blocks=TIGHT, preemption_mode="recompute"),
        lambda s: s["num_preemptions"] > 0,
        ("fp8", "int8"),
    ),
    "chunked-prefill": (
        dict(max_num_batched_tokens=8, max_num_seqs=8),
        lambda s: s["num_steps"] > MAX_TOKENS,  # the 30-token prompt took several steps
        ("fp8", "int8"),
    ),
    "n2-copy-on-write-swap": (
        dict(num_gpu_blocks=TIGHT_FORKED, preemption_mode="swap", params=SEEDED),
        lambda s: s["num_preemptions"] > 0,
        ("fp8", "int8"),
    ),
    "beam-search-swap": (
        dict(num_gpu_blocks=TIGHT_FORKED, preemption_mode="swap", beam=True),
        lambda s: s["num_preemptions"] > 0,
        ("fp8", "int8"),
    ),
}


@pytest.mark.parametrize(
    "feature, fmt", [(f, fmt) for f, (*_, formats) in FEATURES.items() for fmt in formats]
)
def test_a_feature_changes_no_token_over_a_quantized_cache(path, feature, fmt):
    kwargs, happened, _ = FEATURES[feature]
    oracle_kwargs = {k: kwargs[k] for k in ("params", "beam") if k in kwargs}
    expected, _ = run(path, kv_cache_dtype=fmt, **oracle_kwargs)
    got, stats = run(path, kv_cache_dtype=fmt, **kwargs)
    assert happened(stats), stats
    assert got == expected


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_cuda_kernels_decode_as_the_torch_reference(tiny, fmt):
    """The CUDA kernels (emulated on a CPU, prefill by Triton, interpreted) read the
    quantized bytes the torch reference reads, and decode the same greedy tokens, on a
    checkpoint and block size the kernels are built for."""
    cuda_path = tiny("llama", head_dim=64)[0]
    prompts, kwargs = PROMPTS[:2], dict(block_size=8, num_gpu_blocks=16, kv_cache_dtype=fmt)
    outputs = {}
    for backend in ("torch", "cuda"):
        llm = make_llm(cuda_path, attention_backend=backend, **kwargs)
        outputs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False)
        ]
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert outputs["cuda"] == outputs["torch"]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_prefix_caching_reuses_quantized_blocks(path, fmt):
    prompts = [SHARED + random_prompt(5, seed) for seed in range(4)]
    expected, _ = run(path, prompts, kv_cache_dtype=fmt)
    got, stats = run(path, prompts, kv_cache_dtype=fmt, enable_prefix_caching=True)
    assert stats["prefix_cache_hit_rate"] > 0
    assert got == expected


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_tensor_parallel_equals_one_rank(path, fmt):
    """(Not with ``calculate_kv_scales``: each rank computes its own from its heads.)"""
    expected, _ = run(path, kv_cache_dtype=fmt, num_gpu_blocks=TIGHT, preemption_mode="swap")
    got, stats = run(
        path,
        kv_cache_dtype=fmt,
        num_gpu_blocks=TIGHT,
        preemption_mode="swap",
        tensor_parallel_size=2,
    )
    assert stats["num_swapped_out_blocks"] > 0
    assert got == expected


def test_calculated_scales_follow_the_first_batch(path):
    llm = make_llm(path, block_size=BLOCK_SIZE, kv_cache_dtype="fp8", calculate_kv_scales=True)
    layer = llm.engine.cache_engine.gpu_cache[0]
    assert float(layer[2]) == float(layer[3]) == 1.0
    llm.generate(as_inputs(PROMPTS[:1]), GREEDY, use_tqdm=False)
    assert float(layer[2]) != 1.0 and float(layer[3]) != 1.0
    with pytest.raises(ValueError, match="calculate_kv_scales sets fp8's"):
        make_llm(path, kv_cache_dtype="int8", calculate_kv_scales=True)


def bytes_per_block(path, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """A block's bytes from the checkpoint's config.json, counted by hand: keys and
    values of every layer and KV head, ``head_dim`` elements per token, of
    ``dtype``'s size or one byte, plus int8's float32 scale per token and head."""
    config = json.loads((path / "config.json").read_text())
    rows = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * BLOCK_SIZE
    dim = config["hidden_size"] // config["num_attention_heads"]
    if kv_cache_dtype == "auto":
        return rows * dim * dtype.itemsize
    return rows * (dim + (4 if kv_cache_dtype == "int8" else 0))


@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_the_same_budget_holds_more_blocks(path, dtype, ratio):
    """The pool is sized in bytes: a budget of 7 fp32 blocks holds 7 blocks in fp32
    (14 in bf16), and ``ratio`` times as many in fp8; int8's scales take 4 bytes per
    token and head besides."""
    budget = 7 * bytes_per_block(path, "auto", torch.float32)
    blocks = {}
    for fmt in ("auto", "fp8", "int8"):
        llm = make_llm(
            path,
            dtype=str(dtype).removeprefix("torch."),
            kv_cache_dtype=fmt,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=None,
            cpu_kv_space=budget / GIB,
        )
        stats = llm.stats()
        assert stats["kv_cache_block_bytes"] == bytes_per_block(path, fmt, dtype)
        blocks[fmt] = stats["num_gpu_blocks"]
        llm.shutdown()
    assert blocks["auto"] == budget // bytes_per_block(path, "auto", dtype)
    assert blocks["fp8"] == ratio * blocks["auto"]
    assert blocks["int8"] == budget // bytes_per_block(path, "int8", dtype) < blocks["fp8"]


def test_under_a_tight_budget_auto_preempts_and_fp8_does_not(path):
    """Half the blocks the batch needs in fp32 are, in fp8, twice what it needs."""
    budget = dict(
        cpu_kv_space=NEEDED // 2 * bytes_per_block(path, "auto", torch.float32) / GIB,
        num_gpu_blocks=None,
    )
    auto, auto_stats = run(path, kv_cache_dtype="auto", **budget)
    fp8, fp8_stats = run(path, kv_cache_dtype="fp8", **budget)
    assert auto_stats["num_preemptions"] > 0
    assert fp8_stats["num_preemptions"] == 0
    assert fp8_stats["num_gpu_blocks"] >= NEEDED > auto_stats["num_gpu_blocks"]
    assert len(fp8) == len(auto) == len(PROMPTS)


@pytest.mark.parametrize("fmt", ["auto", "fp8", "int8"])
def test_the_startup_log_and_metrics_show_the_pool_in_bytes(path, fmt, caplog):
    """``minipaged serve``'s startup log and ``/metrics`` (``minipaged:kv_cache_bytes``)
    give a block's bytes in the cache's dtype and the pool's, as counted by hand; a
    swapped block moves as many (fp8: a quarter of fp32's)."""
    pytest.importorskip("prometheus_client")
    from minipaged.engine.protocol import EngineFacts
    from minipaged.server.app import log_startup
    from minipaged.server.limits import ServerLimits
    from minipaged.server.metrics import make_registry

    llm = make_llm(path, block_size=BLOCK_SIZE, kv_cache_dtype=fmt, num_gpu_blocks=10)
    per_block = bytes_per_block(path, fmt, torch.float32)
    with caplog.at_level("INFO", logger="minipaged.server"):
        description = EngineFacts.of(llm.engine).description
        log_startup(description, str(path), "tiny", "127.0.0.1", 8000, None, ServerLimits(), [])
    assert f"{per_block} bytes a block, {10 * per_block / 2**20:.1f} MiB" in caplog.text
    registry = make_registry(SimpleNamespace(stats=llm.stats()))
    assert registry.get_sample_value("minipaged:kv_cache_bytes") == 10 * per_block
    # What a swap moves per block: the swap pool's row of each per-block tensor.
    swap_pool = llm.engine.cache_engine.cpu_cache
    assert sum(t[0].nbytes for layer in swap_pool for t in layer if t.dim()) == per_block
    llm.shutdown()

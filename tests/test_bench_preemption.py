"""``minipaged bench preemption`` (paper Fig. 19): a swap round trip gives back exactly
the KV it took away (checked against a copy taken with plain indexing before the swap),
the per-block copy against a hand-made mapping, the microbenchmark's sizes worked out
from the tiny model's shape, a preemption worked out step by step, the rows' keys, and
bad arguments refused by name.  No timing is asserted."""

import json
import math

import pytest
import torch
from matplotlib.figure import Figure

from cli_helpers import run_main
from minipaged.bench import preemption as bench
from minipaged.bench.presets import make_prompts
from minipaged.core.memory.workloads import RequestSpec
from minipaged.llm import LLM
from minipaged.models import make_tiny_model
from minipaged.models.tiny import BASE_CONFIG
from minipaged.worker.cache_engine import GIB

# The tiny model's KV per token and block slot: keys and values, every layer, its KV heads.
LAYERS, KV_HEADS, HEAD_DIM = (
    BASE_CONFIG[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
)
SLOT_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def engine(tiny, block_size=4, num_gpu_blocks=16, num_cpu_blocks=16, mode="swap"):
    swap_space = (num_cpu_blocks + 1) * block_size * SLOT_BYTES / GIB
    return LLM(
        str(tiny),
        device="cpu",
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        swap_space=swap_space,
        preemption_mode=mode,
    )


def gathered(pool, blocks):
    """Every layer's keys and values of ``blocks``, by plain indexing: the oracle."""
    return [[cache[blocks].clone() for cache in layer] for layer in pool]


def assert_all_free(llm):
    stats = llm.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


# -- the copies --------------------------------------------------------------------------
@pytest.mark.parametrize("method", bench.SWAP_METHODS)
def test_swap_round_trip_restores_the_exact_kv(tiny, method):
    """Random KV in a 10-token request's 3 blocks; swapped out, the CPU blocks hold it;
    with the whole GPU pool then overwritten with NaN, swapping in brings it back
    bit for bit, wherever the new blocks are."""
    llm = engine(tiny)
    e = llm.engine
    e.kv.allocate(bench.PROBE, [0] * 10)
    blocks = e.kv.block_table(bench.PROBE)
    assert len(blocks) == 3
    gen = torch.Generator().manual_seed(0)
    for layer in e.cache_engine.gpu_cache:
        for cache in layer:
            cache.copy_(torch.randn(cache.shape, generator=gen))
    original = gathered(e.cache_engine.gpu_cache, blocks)

    assert bench.swap(e, bench.PROBE, "out", method) >= 0
    assert e.kv.is_swapped(bench.PROBE)
    assert _equal(gathered(e.cache_engine.cpu_cache, e.kv.block_table(bench.PROBE)), original)
    for layer in e.cache_engine.gpu_cache:
        for cache in layer:
            cache.fill_(float("nan"))
    bench.swap(e, bench.PROBE, "in", method)
    assert not e.kv.is_swapped(bench.PROBE)
    assert _equal(gathered(e.cache_engine.gpu_cache, e.kv.block_table(bench.PROBE)), original)
    e.kv.free(bench.PROBE)
    assert_all_free(llm)


def _equal(a, b):
    return all(
        torch.equal(x, y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True)
    )


def test_copy_per_block_copies_exactly_the_pairs():
    """dst[2] = src[0] and dst[1] = src[3] in every layer, keys and values; dst's other
    blocks keep their own values."""
    gen = torch.Generator().manual_seed(1)

    def pool():
        return [
            (torch.randn(5, 4, 2, 3, generator=gen), torch.randn(5, 4, 2, 3, generator=gen))
            for _ in range(2)
        ]

    src, dst = pool(), pool()
    before = [[c.clone() for c in layer] for layer in dst]
    bench.copy_per_block(src, dst, [(0, 2), (3, 1)])
    for src_layer, dst_layer, old_layer in zip(src, dst, before):
        for s, d, old in zip(src_layer, dst_layer, old_layer):
            assert torch.equal(d[2], s[0]) and torch.equal(d[1], s[3])
            for b in (0, 3, 4):
                assert torch.equal(d[b], old[b])


# -- the microbenchmark ------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_micro_rows_by_hand(tiny, block_size):
    """A 10-token request in blocks of B: ceil(10 / B) blocks of B slots moved, 2 copies
    per layer batched (keys, values), 2 per layer per block one by one."""
    llm = engine(tiny, block_size, num_gpu_blocks=64 // block_size, num_cpu_blocks=64 // block_size)
    rows = bench.measure_micro(llm, 10, repeats=2, warmup=1)
    num_blocks = math.ceil(10 / block_size)
    assert [(r["op"], r["method"]) for r in rows] == [
        ("swap-out", "batched"),
        ("swap-in", "batched"),
        ("swap-out", "per-block"),
        ("swap-in", "per-block"),
        ("recompute", "prefill"),
    ]
    for r in rows:
        assert tuple(r) == bench.MICRO_KEYS and r["experiment"] == "microbenchmark"
        assert (r["block_size"], r["num_tokens"], r["num_blocks"]) == (block_size, 10, num_blocks)
        assert r["time_ms"] > 0 and r["us_per_token"] == pytest.approx(r["time_ms"] * 100)
        if r["op"] == "recompute":
            assert r["bytes"] is r["num_copies"] is r["bandwidth_gbs"] is None
        else:
            assert r["bytes"] == num_blocks * block_size * SLOT_BYTES
            per_block = num_blocks if r["method"] == "per-block" else 1
            assert r["num_copies"] == 2 * LAYERS * per_block
    assert_all_free(llm)


# -- end to end --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_one_preemption_worked_out(tiny, mode):
    """Two requests of 6 prompt + 4 output tokens on 4 blocks of 4.  Step 1 prefills both
    (2 blocks each: the pool is full).  Step 2 the older one's 7th token needs a third
    block: the newer one is preempted, its 2 blocks swapped out (or freed).  The older one
    then finishes in 3 blocks and the newer one comes back: one preemption, 2 blocks
    swapped out in swap mode and none in recompute mode, all tokens made, all blocks free."""
    llm = engine(tiny, 4, num_gpu_blocks=4, num_cpu_blocks=4, mode=mode)
    requests = [RequestSpec(6, 4)] * 2
    prompts = make_prompts(requests, llm.get_tokenizer(), llm.engine.vocab_size)
    run = bench.run_engine(llm, requests, prompts)
    assert run.output_tokens == 8 and run.num_preemptions == 1
    assert run.num_swapped_out_blocks == (2 if mode == "swap" else 0)
    assert_all_free(llm)


def test_bench_rows_have_the_declared_keys(tiny):
    rows = bench.bench_preemption(
        tiny,
        [16, 4],
        num_tokens=20,
        repeats=1,
        warmup=0,
        num_requests=4,
        kv_slots=64,
        length_scale=0.05,
        engine_kwargs={"device": "cpu"},
        progress=False,
    )
    micro = [r for r in rows if r["experiment"] == "microbenchmark"]
    end_to_end = [r for r in rows if r["experiment"] == "end-to-end"]
    assert [r["block_size"] for r in micro] == [4] * 5 + [16] * 5
    assert [(r["block_size"], r["preemption_mode"]) for r in end_to_end] == [
        (4, "recompute"),
        (4, "swap"),
        (16, "recompute"),
        (16, "swap"),
    ]
    assert all(tuple(r) == bench.END_TO_END_KEYS for r in end_to_end)
    assert max(r["normalized_throughput"] for r in end_to_end) == 1
    assert all(
        r["num_swapped_out_blocks"] == 0 for r in end_to_end if r["preemption_mode"] == "recompute"
    )
    assert "recompute" in bench.format_table(rows)
    assert isinstance(bench.plot_preemption(rows, "cpu"), Figure)


# -- bad arguments -----------------------------------------------------------------------
GOOD = dict(
    num_tokens=20,
    repeats=1,
    warmup=0,
    num_requests=2,
    kv_slots=64,
    length_scale=0.05,
    engine_kwargs={"device": "cpu"},
    progress=False,
)


@pytest.mark.parametrize(
    "change, name",
    [
        ({"num_tokens": 0}, "num_tokens"),
        ({"repeats": 0}, "repeats"),
        ({"warmup": -1}, "warmup"),
        ({"num_requests": 0}, "num_requests"),
        ({"kv_slots": 0}, "kv_slots"),
        ({"num_tokens": 64}, "num_tokens"),
        ({"num_tokens": 1024, "kv_slots": 4096}, "num_tokens"),
        ({"engine_kwargs": {"preemption_mode": "swap"}}, "preemption_mode"),
        ({"engine_kwargs": {"enable_prefix_caching": True}}, "enable_prefix_caching"),
        ({"length_scale": 0}, "scale"),
        ({"length_scale": 1.0, "kv_slots": 100}, "kv_slots"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_engine(tiny, change, name, monkeypatch):
    monkeypatch.setattr(bench, "measure_micro", None)  # reaching an engine would fail
    monkeypatch.setattr(bench, "run_engine", None)
    with pytest.raises(ValueError, match=name):
        bench.bench_preemption(tiny, [4, 16], **{**GOOD, **change})


def test_bad_block_sizes_and_swap_arguments_are_refused_by_name(tiny):
    with pytest.raises(ValueError, match="block_sizes"):
        bench.bench_preemption(tiny, [0], **GOOD)
    llm = engine(tiny)
    llm.engine.kv.allocate(bench.PROBE, [0] * 5)
    with pytest.raises(ValueError, match="direction"):
        bench.swap(llm.engine, bench.PROBE, "sideways", "batched")
    with pytest.raises(ValueError, match="method"):
        bench.swap(llm.engine, bench.PROBE, "out", "teleport")
    assert not llm.engine.kv.is_swapped(bench.PROBE)  # refused before anything moved


def test_command_line_writes_the_results_file(tmp_path):
    out = tmp_path / "preemption.json"
    assert (
        run_main(
            [
                "bench",
                "preemption",
                "--preset",
                "cpu",
                "--block-sizes",
                "16",
                "--num-tokens",
                "64",
                "--repeats",
                "2",
                "--warmup",
                "1",
                "--num-requests",
                "4",
                "--kv-slots",
                "256",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "results"} <= set(document)
    assert {row["experiment"] for row in document["results"]} == {"microbenchmark", "end-to-end"}
    assert out.with_suffix(".png").stat().st_size > 0

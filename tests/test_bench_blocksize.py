"""``minipaged bench block-size`` (paper Fig. 18b): the paged pool's counts per block
size on hand-made workloads worked out by hand, the engine's run on requests whose step
count is known, the rows' keys, and bad arguments refused by name.

The counts follow `memory.simulate`'s rules: a request is admitted with its prompt,
every step adds one token to every resident request, shares are averaged over the
steps in which a request waits (over all steps if none does), and a request holds
ceil(tokens / block_size) blocks, the slots past its last token being internal
fragmentation.
"""

import json

import pytest
from matplotlib.figure import Figure

from cli_helpers import run_main
from minipaged.bench import blocksize as bench
from minipaged.bench.presets import make_prompts, preset_device
from minipaged.core.memory.workloads import RequestSpec
from minipaged.llm import LLM
from minipaged.models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


# -- counts, by hand ---------------------------------------------------------------------
@pytest.mark.parametrize("block_size, internal", [(1, 0), (4, 2), (16, 6)])
def test_one_request_wastes_the_rest_of_its_last_block(block_size, internal):
    """Prompt 9, one output token: the one step holds 10 tokens in ceil(10 / B) blocks
    of a 16-slot pool; in blocks of 16 that is 6 empty slots, of 4, 2, of 1, none."""
    report = bench.count_block_sizes([RequestSpec(9, 1)], 16, [block_size])[block_size]
    assert report.token_share == pytest.approx(10 / 16)
    assert report.internal_share == pytest.approx(internal / 16)
    assert report.free_share == pytest.approx((16 - 10 - internal) / 16)
    assert report.max_batch == 1 and report.num_steps == 1


def test_fragmentation_averages_over_the_steps():
    """Prompt 3, two output tokens, blocks of 4: the steps hold 4 tokens in 1 block (no
    waste), then 5 in 2 blocks (3 empty slots): internal = (0 + 3) / (2 steps * 16)."""
    report = bench.count_block_sizes([RequestSpec(3, 2)], 16, [4])[4]
    assert report.token_share == pytest.approx((4 + 5) / 32)
    assert report.internal_share == pytest.approx(3 / 32)


def test_big_blocks_shrink_the_batch():
    """Four requests of 3 + 1 tokens on 16 slots.  Blocks of 4: each fits one block, all
    four run in one step, the pool full of tokens.  Blocks of 16: the pool is one block,
    so they run one at a time, four steps; in the three steps where others wait each
    holds 4 tokens and 12 empty slots."""
    requests = [RequestSpec(3, 1)] * 4
    counts = bench.count_block_sizes(requests, 16, [4, 16])
    small, big = counts[4], counts[16]
    assert (small.max_batch, small.num_steps, small.token_share) == (4, 1, pytest.approx(1))
    assert small.internal_share == 0
    assert (big.max_batch, big.num_steps) == (1, 4)
    assert big.token_share == pytest.approx(4 / 16)
    assert big.internal_share == pytest.approx(12 / 16)


def test_make_requests_scales_and_cuts_to_the_context():
    """Scale 1 keeps the drawn lengths; a tiny context cuts every request to fit it."""
    plain = bench.make_requests("alpaca", 20, 1.0, 4096)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in plain)
    short = bench.make_requests("sharegpt", 20, 1.0, 8)
    assert all(r.total_len <= 8 and r.prompt_len <= 7 and r.output_len >= 1 for r in short)
    halved = bench.make_requests("alpaca", 20, 0.5, 4096)
    for a, b in zip(plain, halved):
        assert b.prompt_len == max(1, round(a.prompt_len * 0.5))


# -- the engine --------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_engine_run_counts_and_frees_everything(tiny, block_size):
    """Two requests that both fit: step 1 prefills both and samples each one token, then
    one decode step per further token, so max(output) = 3 steps, no preemption, and
    3 + 2 tokens out.  Afterwards every block is free."""
    llm = LLM(
        str(tiny),
        device="cpu",
        block_size=block_size,
        num_gpu_blocks=256 // block_size,
        swap_space=0,
    )
    requests = [RequestSpec(10, 3), RequestSpec(5, 2)]
    prompts = make_prompts(requests, llm.get_tokenizer(), llm.engine.vocab_size)
    run = bench.run_engine(llm, requests, prompts)
    assert (run.output_tokens, run.num_steps, run.num_preemptions) == (5, 3, 0)
    assert run.elapsed_s > 0 and run.output_tokens_per_s == 5 / run.elapsed_s
    stats = llm.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] == 256 // block_size


def test_bench_rows_have_the_declared_keys(tiny):
    rows = bench.bench_block_size(
        tiny,
        ["alpaca", "sharegpt"],
        [16, 1],
        {"alpaca": 3, "sharegpt": 2},
        512,
        {"alpaca": 0.2, "sharegpt": 0.05},
        {"device": "cpu"},
        progress=False,
    )
    assert [(r["workload"], r["block_size"]) for r in rows] == [
        ("alpaca", 1),
        ("alpaca", 16),
        ("sharegpt", 1),
        ("sharegpt", 16),
    ]
    for r in rows:
        assert tuple(r) == bench.ROW_KEYS
        assert r["num_gpu_blocks"] == 512 // r["block_size"] and r["kv_slots"] == 512
    for workload in ("alpaca", "sharegpt"):
        assert max(r["normalized_throughput"] for r in rows if r["workload"] == workload) == 1
    assert [r["num_requests"] for r in rows] == [3, 3, 2, 2]
    assert len(bench.format_table(rows).splitlines()) == 2 + len(rows)  # header, rule, rows
    assert isinstance(bench.plot_block_size(rows, "cpu"), Figure)


# -- bad arguments -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, name",
    [
        ({"block_sizes": [0]}, "block_sizes"),
        ({"block_sizes": []}, "block_sizes"),
        ({"block_sizes": [4.0]}, "block_sizes"),
        ({"workloads": ["lmsys"]}, "workloads"),
        ({"workloads": []}, "workloads"),
        ({"engine_kwargs": {"block_size": 8}}, "block_size"),
        ({"kv_slots": 8}, "kv_slots"),
        ({"num_requests": {"alpaca": 0}}, "num_requests"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_engine(tiny, change, name, monkeypatch):
    monkeypatch.setattr(bench, "run_engine", None)  # reaching an engine would fail otherwise
    kwargs = dict(
        workloads=["alpaca"],
        block_sizes=[1, 16],
        num_requests={"alpaca": 2},
        kv_slots=512,
        length_scales={"alpaca": 1.0},
        engine_kwargs={"device": "cpu"},
        progress=False,
    )
    with pytest.raises(ValueError, match=name):
        bench.bench_block_size(tiny, **{**kwargs, **change})


def test_bad_preset_and_scale_are_refused_by_name():
    with pytest.raises(ValueError, match="preset"):
        preset_device("tpu", presets=bench.PRESETS)
    with pytest.raises(ValueError, match="scale"):
        bench.make_requests("alpaca", 2, 0.0, 1024)


def test_command_line_writes_the_results_file(tmp_path):
    out = tmp_path / "block-size.json"
    assert (
        run_main(
            [
                "bench",
                "block-size",
                "--preset",
                "cpu",
                "--workloads",
                "alpaca",
                "--block-sizes",
                "4",
                "16",
                "--num-requests",
                "6",
                "--kv-slots",
                "512",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "results"} <= set(document)
    assert sorted(row["block_size"] for row in document["results"]) == [4, 16]
    assert out.with_suffix(".png").stat().st_size > 0

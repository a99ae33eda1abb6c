"""``minipaged bench sharing`` (paper Fig. 15): its block counts on hand-made requests,
worked out from how sharing works rather than from our code.  Parallel sampling shares
the prompt's blocks; every completion's own tokens take blocks of their own.  After step
k (k = 1 .. O-1; at step O the completions finish and free everything) each of the n
sequences has P + k - 1 tokens in the cache, so with P a multiple of the block size B:

    used(k)     = P/B + n * (ceil((P + k - 1)/B) - P/B)     shared prompt once
    unshared(k) = n * ceil((P + k - 1)/B)                     every table in full
"""

import json
import math

import pytest

from cli_helpers import run_main
from minipaged.bench.results import committed_path
from minipaged.bench.sharing import measure_sharing
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS
from minipaged.core.memory.workloads import SHARING_NUM_REQUESTS
from minipaged.llm import LLM
from minipaged.models.tiny import cached_checkpoint

P, OUT = 8, 6  # P and O above


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("bench-sharing")


def engine(path, block_size):
    return LLM(path, device="cpu", block_size=block_size, num_gpu_blocks=256, swap_space=0)


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_parallel_sampling_counts_by_hand(path, block_size, n):
    llm = engine(path, block_size)
    run = measure_sharing(llm, [list(range(10, 10 + P))], [OUT], "parallel", n)
    per_seq = [math.ceil((P + k - 1) / block_size) for k in range(1, OUT)]
    prompt = P // block_size
    assert run.used_blocks == sum(prompt + n * (b - prompt) for b in per_seq)
    assert run.unshared_blocks == n * sum(per_seq)
    assert run.saving == 0 if n == 1 else run.saving > 0
    assert not llm.engine.kv.tables and llm.engine.kv.gpu.num_free_blocks == 256


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_saves_between_nothing_and_all_but_one_copy(path, width):
    """Beams share at least their prompt and at most everything (width copies of one)."""
    llm = engine(path, 4)
    run = measure_sharing(llm, [list(range(10, 10 + P))], [OUT], "beam", width)
    assert 0 < run.saving <= 1 - 1 / width
    assert run.num_steps == OUT and not llm.engine.kv.tables


def test_results_file(tmp_path):
    out = tmp_path / "sharing.json"
    assert (
        run_main(
            [
                "bench",
                "sharing",
                "--workload",
                "alpaca",
                "--num-requests",
                "3",
                "--widths",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    document = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "results"} <= set(document)
    assert [(r["mode"], r["width"]) for r in document["results"]] == [("parallel", 2), ("beam", 2)]
    assert all(0 < r["saving"] < 1 for r in document["results"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_bad_arguments_are_refused_by_name(capsys):
    assert run_main(["bench", "sharing", "--num-requests", "0", "--json", "/dev/null/x"]) == 2
    assert "num_requests" in capsys.readouterr().err


@pytest.mark.parametrize("workload", sorted(SHARING_NUM_REQUESTS))
def test_committed_results_are_the_course_workload(workload):
    """Lessons 03 and 11 and docs/reproducing.md quote the committed file as the run on
    the course's requests; a rerun with other flags must not slip in unnoticed."""
    data = json.loads(committed_path(f"sharing-{workload}", "cpu").read_text())
    assert (data["num_requests"], data["seed"]) == (SHARING_NUM_REQUESTS[workload], 0)
    assert data["kv_slots"] == OPT13B_A100_SLOTS

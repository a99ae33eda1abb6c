"""Decode steps replayed from CUDA graphs (minipaged.worker.cuda_graphs).  On a CPU: which batch
sizes and context bounds are captured, how a batch is padded and which bound a step's
longest context picks, worked out by hand, and that nothing is captured where graphs
cannot run.  On a GPU (``gpu``-marked): greedy tokens identical with and without graphs,
for batches that need padding and for contexts that cross a bound, each step replaying
the graph of its own bound, with every block freed."""

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.models import make_tiny_model
from minipaged.worker.cuda_graphs import (
    context_bound,
    graph_batch_sizes,
    graph_context_bounds,
    padded_batch_size,
)


@pytest.mark.parametrize(
    "max_num_seqs, sizes",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (40, [1, 2, 4, 8, 16, 32, 40]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    ],
)
def test_captured_sizes(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


@pytest.mark.parametrize(
    "num_seqs, padded",
    [(1, 1), (3, 4), (5, 8), (9, 16), (17, 32), (33, 48), (48, 48), (63, 64), (64, 64)],
)
def test_a_batch_pads_to_the_next_captured_size(num_seqs, padded):
    assert padded_batch_size(num_seqs, graph_batch_sizes(64)) == padded


def test_no_size_holds_a_batch_beyond_the_largest():
    assert padded_batch_size(65, graph_batch_sizes(64)) is None


@pytest.mark.parametrize(
    "max_model_len, block_size, bounds",
    [
        (512, 16, [512]),  # one graph per batch size: the capacity is below 1K
        (1000, 16, [1008]),  # rounded up to whole blocks
        (1024, 16, [1024]),
        (2048, 16, [1024, 2048]),
        (32768, 16, [1024, 4096, 16384, 32768]),
        (65536, 32, [1024, 4096, 16384, 65536]),
        (5000, 48, [1056, 4128, 5040]),  # each bound a whole number of 48-token blocks
    ],
)
def test_context_bounds_captured(max_model_len, block_size, bounds):
    assert graph_context_bounds(max_model_len, block_size) == bounds


@pytest.mark.parametrize(
    "max_context_len, bound",
    [(1, 1024), (1024, 1024), (1025, 4096), (4096, 4096), (4097, 16384), (32768, 32768)],
)
def test_a_step_replays_the_smallest_bound_holding_its_longest_context(max_context_len, bound):
    assert context_bound(max_context_len, [1024, 4096, 16384, 32768]) == bound


def test_no_bound_holds_a_context_beyond_the_capacity():
    with pytest.raises(ValueError, match="exceeds the largest captured bound 2048"):
        context_bound(2049, [1024, 2048])


def test_enforce_eager_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(tmp_path, enforce_eager="yes")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """head_dim 64: one the CUDA kernels are compiled for, so both kernel backends run."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=0, head_dim=64)


def test_nothing_is_captured_on_a_cpu(checkpoint):
    llm = LLM(checkpoint, device="cpu", swap_space=0.01)
    assert llm.engine.runner.graphs is None


def greedy(llm, prompts, max_tokens=16):
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("num_prompts", [3, 20])
def test_graphs_give_the_eager_tokens(checkpoint, backend, num_prompts):
    """3 and 20 sequences pad to graphs of 4 and 32; fp32, so no near-tie can differ."""
    g = torch.Generator().manual_seed(num_prompts)
    prompts = [
        torch.randint(0, 256, (1 + 7 * i % 50,), generator=g).tolist() for i in range(num_prompts)
    ]
    outputs = {}
    for eager in (True, False):
        llm = LLM(
            checkpoint,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            num_gpu_blocks=256,
            max_num_seqs=32,
            enforce_eager=eager,
        )
        outputs[eager] = greedy(llm, prompts)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        if not eager:
            assert graphs.num_replays >= 15  # every decode step after the prefill
        stats = llm.stats()
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert outputs[False] == outputs[True]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_each_step_replays_the_graph_of_its_longest_context(tmp_path, backend):
    """A 4096-token model captures bounds 1K and 4K: short sequences replay the 1K
    graphs, and a batch whose longest context passes 1024 switches to the 4K ones, with
    the eager tokens throughout (fp32)."""
    path = make_tiny_model(
        tmp_path, arch="llama", seed=0, head_dim=64, max_position_embeddings=4096
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 1000, 40)]
    outputs = {}
    for eager in (True, False):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            num_gpu_blocks=512,
            max_num_seqs=4,
            enforce_eager=eager,
        )
        outputs[eager] = greedy(llm, prompts, max_tokens=40)
        if not eager:
            graphs = llm.engine.runner.graphs
            assert graphs.context_bounds == [1024, 4096]
            # The 1000-token prompt passes 1024 tokens after 24 new ones: the steps
            # before replay the 1K graphs, the ones after the 4K graphs.
            assert graphs.replays_per_bound[1024] >= 20
            assert graphs.replays_per_bound[4096] >= 10
    assert outputs[False] == outputs[True]

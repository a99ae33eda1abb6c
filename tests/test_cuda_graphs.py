"""Decode steps replayed from CUDA graphs (minipaged.worker.cuda_graphs).  On a CPU: which batch
sizes are captured and how a batch is padded, worked out by hand, and that nothing is
captured where graphs cannot run.  On a GPU (``gpu``-marked): greedy tokens identical
with and without graphs, for batches that need padding, with every block freed."""

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.models import make_tiny_model
from minipaged.worker.cuda_graphs import graph_batch_sizes, padded_batch_size


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

"""Each tensor-parallel layer against its unsharded reference (paper §4.6).

A group of two gloo processes builds every parallel layer from one seeded reference
layer (each rank keeping the slice its ``load_targets`` names, as the loader does) and
runs it on the same input; the parent compares what each rank computed with the
reference's output (each process imports this module, which imports torch only).
Rules that need no processes (KV-head replication, which sizes split) are checked
directly.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minipaged.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minipaged.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    free_port,
    init_tensor_parallel,
    kv_heads_per_rank,
)

TOL = dict(atol=1e-5, rtol=1e-5)
HIDDEN, HEAD, VOCAB, TOKENS = 12, 4, 11, 5  # 11: the vocabulary does not split evenly


def _reference():
    """The unsharded layers and the input, identical on every rank (seeded)."""
    torch.manual_seed(0)
    return dict(
        q=nn.Linear(HIDDEN, 4 * HEAD),
        k=nn.Linear(HIDDEN, HEAD),
        o=nn.Linear(4 * HEAD, HIDDEN),
        embed=torch.randn(VOCAB, HIDDEN),
        x=torch.randn(TOKENS, HIDDEN),
        xo=torch.randn(TOKENS, 4 * HEAD),
        ids=torch.tensor([0, 5, 6, 10, 3]),
    )


def _load(layer, name: str, tensor: torch.Tensor, kind: str = "weight") -> None:
    """Copy this rank's slice of ``tensor`` (HF projection ``name``) into ``layer``."""
    ours, theirs = layer.load_targets(kind)[name]
    with torch.no_grad():
        getattr(layer, kind)[ours].copy_(tensor[theirs])


def _run_rank(rank: int, size: int, port: int, results) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, port, torch.device("cpu"))
    try:
        with torch.no_grad():
            out = _outputs(rank, tp)
        # As lists: a queued tensor is shared through a file descriptor that vanishes
        # with this process, which may exit before the parent reads it.
        results.put((rank, {k: None if v is None else v.tolist() for k, v in out.items()}))
    finally:
        destroy_tensor_parallel()


def _outputs(rank: int, tp: TensorParallelGroup) -> dict:
    ref = _reference()
    # q: 4 heads split 2 ways; k: 1 head, replicated on both ranks (shards=1).
    qk = ColumnParallelLinear(
        HIDDEN, {"q_proj": 4 * HEAD, "k_proj": HEAD}, bias=True, tp=tp, shards={"k_proj": 1}
    )
    for name, linear in (("q_proj", ref["q"]), ("k_proj", ref["k"])):
        _load(qk, name, linear.weight)
        _load(qk, name, linear.bias, "bias")
    q, k = qk.split(ref["x"])
    o = RowParallelLinear(4 * HEAD, HIDDEN, bias=True, tp=tp)
    _load(o, "", ref["o"].weight)
    _load(o, "", ref["o"].bias, "bias")
    x_slice = ref["xo"][:, rank * 2 * HEAD : (rank + 1) * 2 * HEAD]  # this rank's heads
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    _load(embed, "", ref["embed"])
    head = ParallelLMHead(VOCAB, HIDDEN, tp)
    head.weight = embed.weight  # tied, as the models tie them
    return {"q": q, "k": k, "o": o(x_slice), "embed": embed(ref["ids"]), "logits": head(ref["x"])}


@pytest.fixture(scope="module")
def ranks():
    """Each rank's outputs, from a gloo group of two processes."""
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    processes = [
        context.Process(target=_run_rank, args=(rank, 2, port, results)) for rank in range(2)
    ]
    for process in processes:
        process.start()
    out = {
        rank: {k: None if v is None else torch.tensor(v) for k, v in values.items()}
        for rank, values in (results.get(timeout=120) for _ in processes)
    }
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    return out, _reference()


def test_column_parallel_splits_output_rows(ranks):
    out, ref = ranks
    q = ref["q"](ref["x"])
    # Rank r holds query heads [2r, 2r + 2): the rows of the output, in rank order.
    torch.testing.assert_close(torch.cat([out[0]["q"], out[1]["q"]], dim=-1), q, **TOL)
    assert out[0]["q"].shape == (TOKENS, 2 * HEAD)


def test_column_parallel_replicates_a_part_with_fewer_shards_than_ranks(ranks):
    out, ref = ranks
    for rank in (0, 1):  # one KV head, two ranks: both hold all of it (vLLM's rule)
        torch.testing.assert_close(out[rank]["k"], ref["k"](ref["x"]), **TOL)


def test_row_parallel_all_reduces_partial_outputs(ranks):
    out, ref = ranks
    expected = ref["o"](ref["xo"])
    for rank in (0, 1):  # the sum over ranks, bias once, on every rank
        torch.testing.assert_close(out[rank]["o"], expected, **TOL)


def test_vocab_parallel_embedding_equals_lookup(ranks):
    out, ref = ranks
    for rank in (0, 1):  # ids on both sides of the split, rows exact (sums with zeros)
        torch.testing.assert_close(
            out[rank]["embed"], F.embedding(ref["ids"], ref["embed"]), atol=0, rtol=0
        )


def test_parallel_lm_head_gathers_logits_on_rank_0(ranks):
    out, ref = ranks
    torch.testing.assert_close(out[0]["logits"], ref["x"] @ ref["embed"].T, **TOL)
    assert out[0]["logits"].shape == (TOKENS, VOCAB)  # the padding row is cut off
    assert out[1]["logits"] is None


def test_single_rank_layers_equal_torch_layers():
    ref = _reference()
    o = RowParallelLinear(4 * HEAD, HIDDEN, bias=True)
    o.load_state_dict(ref["o"].state_dict())
    torch.testing.assert_close(o(ref["xo"]), ref["o"](ref["xo"]), atol=0, rtol=0)
    head = ParallelLMHead(VOCAB, HIDDEN)
    assert head.weight.shape == (VOCAB, HIDDEN)
    with torch.no_grad():
        head.weight.copy_(ref["embed"])
    torch.testing.assert_close(head(ref["x"]), F.linear(ref["x"], ref["embed"]), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("num_kv_heads", "size", "per_rank", "head_of_rank"),
    [
        (2, 2, 1, [0, 1]),
        (8, 2, 4, [0, 1]),  # a shard of 4 heads each
        (2, 4, 1, [0, 0, 1, 1]),  # replicated: ranks 0-1 hold head 0, ranks 2-3 head 1
        (3, 3, 1, [0, 1, 2]),  # SmolLM2 at tensor_parallel_size=3
    ],
)
def test_kv_heads_per_rank(num_kv_heads, size, per_rank, head_of_rank):
    assert kv_heads_per_rank(num_kv_heads, size) == per_rank
    rows = num_kv_heads * HEAD
    for rank, head in enumerate(head_of_rank):
        layer = ColumnParallelLinear(
            HIDDEN,
            {"k_proj": rows},
            bias=False,
            tp=TensorParallelGroup(rank, size),
            shards={"k_proj": min(size, num_kv_heads)},
        )
        _, theirs = layer.load_targets("weight")["k_proj"]
        assert theirs[0] == slice(head * per_rank * HEAD, (head + 1) * per_rank * HEAD)


class _Config:
    num_attention_heads, num_key_value_heads, intermediate_size = 9, 3, 1536


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (2, "must divide the model's num_attention_heads \\(9\\)"),
        (9, "must divide the model's intermediate_size \\(1536\\)"),
        (0, "tensor_parallel_size must be an int >= 1, got 0"),
    ],
)
def test_check_tensor_parallel_names_what_does_not_split(size, message):
    from minipaged.models.llama import check_tensor_parallel  # (transformers: not in workers)

    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(_Config(), size)
    check_tensor_parallel(_Config(), 3)  # SmolLM2's sizes split three ways


def _idle_rank(rank: int, port: int, ready, results) -> None:
    """A group whose collectives time out after 3 s (joined once both processes are up);
    the driver (rank 0) has nothing to run for 6 s, then sends its plan."""
    from datetime import timedelta

    from minipaged.distributed import parallel_state

    parallel_state.TIMEOUT = timedelta(seconds=3)
    ready.wait()
    try:
        tp = init_tensor_parallel(rank, 2, port, torch.device("cpu"))
        if rank == 0:
            time.sleep(6)
        results.put((rank, tp.broadcast_object("plan" if rank == 0 else None)))
    except RuntimeError as error:
        results.put((rank, str(error)))
    finally:
        destroy_tensor_parallel()


def test_a_worker_waits_for_the_next_plan_past_the_collectives_timeout():
    """An idle server sends no plan for as long as no request comes: the workers wait
    on the control group, which has no practical deadline, so they outlive the
    collectives' ``TIMEOUT`` (gloo would end a default-group wait then)."""
    context = multiprocessing.get_context("spawn")
    results, ready, port = context.Queue(), context.Barrier(2), free_port()
    processes = [
        context.Process(target=_idle_rank, args=(r, port, ready, results)) for r in range(2)
    ]
    for process in processes:
        process.start()
    answers = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(30)
    assert answers == {0: "plan", 1: "plan"}

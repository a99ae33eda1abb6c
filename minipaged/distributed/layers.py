"""Linear layers and embeddings split over a tensor-parallel group (paper §4.6).

Megatron-LM's two ways to split ``Y = X A^T`` (Shoeybi et al. 2019, §3):

- **column-parallel**: each rank holds some *output* rows of ``A`` and computes those
  columns of ``Y``; no communication.  q/k/v and gate/up (whose outputs are consumed
  head by head, or element by element, on the same rank);
- **row-parallel**: each rank holds some *input* columns of ``A``, takes the matching
  slice of ``X`` (what a column-parallel layer left it) and computes a partial ``Y``; one
  all-reduce sums them.  o_proj and down_proj.

So an attention block and an MLP block each cost one all-reduce.  The embedding and the
LM head split the *vocabulary*: a rank looks up only ids in its range (zeros elsewhere,
then an all-reduce), and projects onto its range of the vocabulary (the slices are
gathered on the driver, which samples).  A tied LM head is the embedding's slice itself.

Each layer also says which part of each checkpoint tensor its rank loads
(``load_targets``): the loader reads only that slice of the file.  With a group of one,
every layer computes exactly what its ``nn`` counterpart does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.distributed.parallel_state import SINGLE, TensorParallelGroup

__all__ = [
    "ColumnParallelLinear",
    "LoadTargets",
    "ParallelLMHead",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "linear",
]

# What ``load_targets(kind)`` returns for the parameter ``kind`` ("weight", "bias"): HF
# tensor -> (index into our parameter, index into the checkpoint tensor), or None for a
# tensor the rank does not read (under expert parallelism, another rank's expert).  The
# key "" is the parameter's own name; a merged layer has one key per HF projection.
LoadTargets = dict[str, tuple[tuple[slice, ...], tuple[slice, ...]] | None]
ALL = (slice(None),)


def linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ layer.weight.T (+ bias)``: through oneDNN's packed copy of the weight where
    `minipaged.models.cpu_linear` made one (on a CPU), else ``F.linear``, which is also
    what torch.compile traces: inductor packs the weights of its graph itself (its
    ``freezing``), and cannot take a packed copy as an input.  A quantized layer's
    ``quant_method`` multiplies by its weight (`minipaged.models.quantization`)."""
    if (method := getattr(layer, "quant_method", None)) is not None:
        return method.apply(layer, x, bias)
    if layer.packed_weight is None or torch.compiler.is_compiling():
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), layer.packed_weight, bias, "none", [], ""
    )


def _divide(what: str, total: int, parts: int) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({parts})")
    return total // parts


class ColumnParallelLinear(nn.Linear):
    """Output rows split over ranks; ``parts`` stacks several projections of the same
    input (vLLM's ``QKVParallelLinear``, ``MergedColumnParallelLinear``).

    ``parts`` maps each HF projection (``q_proj``, ``k_proj``, ...) to its full number of
    rows, in order; each is split on its own into ``shards[name]`` slices (default: the
    group's size).  With fewer shards than ranks, ranks share a slice: rank ``r`` holds
    slice ``r * shards // size`` (the KV heads, replicated when there are fewer than
    ranks).  The layer holds, and ``split`` returns, its rank's slice of each part.
    """

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        bias: bool,
        tp: TensorParallelGroup = SINGLE,
        shards: dict[str, int] | None = None,
    ) -> None:
        shards = {name: (shards or {}).get(name, tp.size) for name in parts}
        for name, count in shards.items():
            if max(count, tp.size) % min(count, tp.size):
                raise ValueError(
                    f"{name} has {count} shards, which tensor_parallel_size "
                    f"({tp.size}) must divide or be divided by"
                )
        local = {
            name: _divide(f"{name}'s rows", rows, shards[name]) for name, rows in parts.items()
        }
        super().__init__(in_features, sum(local.values()), bias=bias)
        self.tp, self.parts = tp, local
        self.packed_weight = None
        self.shard_index = {name: tp.rank * count // tp.size for name, count in shards.items()}

    def slices(self) -> dict[str, slice]:
        """The rows of each part in this layer."""
        out, start = {}, 0
        for name, rows in self.parts.items():
            out[name], start = slice(start, start + rows), start + rows
        return out

    def load_targets(self, kind: str) -> LoadTargets:
        """Each part's rows here, and the rows of its HF tensor this rank holds."""
        return {
            name: (
                (rows,),
                (
                    slice(
                        self.shard_index[name] * self.parts[name],
                        (self.shard_index[name] + 1) * self.parts[name],
                    ),
                ),
            )
            for name, rows in self.slices().items()
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's slice of each part's projection of ``x``."""
        return self(x).split(list(self.parts.values()), dim=-1)


class RowParallelLinear(nn.Linear):
    """Input columns split over ranks; the partial outputs summed by one all-reduce,
    the bias added once, after it."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup = SINGLE
    ) -> None:
        super().__init__(_divide("in_features", in_features, tp.size), out_features, bias=bias)
        self.tp = tp
        self.packed_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self, self.bias)
        return self.reduce(linear(x, self))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partial outputs summed, plus the bias (a LoRA term joins the
        partial output first, `minipaged.models.lora`)."""
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def load_targets(self, kind: str) -> LoadTargets:
        """The weight's columns of this rank; the bias is whole on every rank."""
        if kind == "bias":
            return {"": (ALL, ALL)}
        start = self.tp.rank * self.in_features
        return {"": (ALL, (slice(None), slice(start, start + self.in_features)))}


class _VocabParallel(nn.Module):
    """A ``[vocab, dim]`` weight split by rows: rank ``r`` holds ids ``[start, end)``,
    padded to ``ceil(vocab / size)`` rows so every rank's slice has one shape."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        rows = -(-vocab_size // tp.size)
        self.start = min(vocab_size, tp.rank * rows)
        self.end = min(vocab_size, self.start + rows)
        self.weight = nn.Parameter(torch.zeros(rows, dim))
        self.packed_weight = None  # the LM head's, where `cpu_linear` packs it

    def load_targets(self, kind: str) -> LoadTargets:
        return {"": ((slice(0, self.end - self.start),), (slice(self.start, self.end),))}


class VocabParallelEmbedding(_VocabParallel):
    """``nn.Embedding`` with the vocabulary split over ranks: each rank looks up the ids
    in its range, zeros for the rest, and one all-reduce adds up the rows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        rows = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0))


class ParallelLMHead(_VocabParallel):
    """The LM head with the vocabulary split over ranks: each rank scores its range, the
    driver (rank 0) gathers the full ``[N, vocab]``; the other ranks get None."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather(linear(hidden, self))
        return None if logits is None else logits[:, : self.vocab_size]

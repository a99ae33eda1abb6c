"""Mixture of experts: each token's MLP is the top-k of E expert MLPs (Shazeer et al.
2017, §2; Mixtral, Jiang et al. 2024, §2.1), and expert parallelism (GShard, Lepikhin
et al. 2020, §2.2).

A router (one linear layer, ``hidden -> E``) scores every expert for every token; each
token goes to its ``top_k`` best experts, and the layer's output is their outputs
weighted by the router's probabilities.  Attention and the KV cache do not change; what
changes is that a step's MLP work depends on how its tokens spread over the experts.

`moe_reference` is the layer written to be read, as transformers' ``MixtralExperts``:

1. `route`: router logits ``[T, E]`` -> softmax in float32 -> top-k -> weights and expert
   ids ``[T, k]``, the k weights renormalised to sum to 1 where the family does
   (Mixtral always, Qwen2-MoE and OLMoE when ``norm_topk_prob``);
2. for each expert: the (token, choice) pairs that picked it, its SwiGLU MLP on those
   tokens, the outputs scaled by their weights and added back at their tokens.

`moe_grouped` computes the same with one sort and two grouped matmuls: the (token,
choice) pairs sorted by expert, so each expert's tokens are one contiguous run, and
``torch.nn.functional.grouped_mm`` multiplies every run by its expert's weights in one
call (what vLLM's fused MoE kernels do).  An expert no token picked is an empty run.

Over a tensor-parallel group (`FusedMoE`):

- **tensor parallelism** slices every expert's intermediate size, like a dense MLP
  (gate/up by rows, down by columns): every rank runs every expert on its slice, and
  one all-reduce sums the partial outputs;
- **expert parallelism** (vLLM's ``enable_expert_parallel``) gives each rank whole
  experts instead, ``E // size`` each and one more on the first ``E % size`` ranks, so
  the tokens must travel to their experts.  Each rank takes its share of the step's
  tokens, and either sends each (token, choice) pair to the rank holding its expert and
  gets the output back (two **all-to-all** exchanges, ``all2all_backend="alltoall"``),
  or, with every token on every rank, runs its experts on the pairs routed to them and
  sums each token's outputs on the rank that owns it with a **reduce-scatter**
  (``"allgather_reducescatter"``: attention's all-reduce already left every token on
  every rank, which is the all-gather).  An all-gather then gives every rank the whole
  step again, for the next layer's attention.  Tokens move, weights stay: a token's
  hidden state is a few KiB, an expert's weights are megabytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.config import ALL2ALL_BACKENDS
from minipaged.distributed.layers import LoadTargets
from minipaged.distributed.parallel_state import SINGLE, TensorParallelGroup
from minipaged.ops import fused

__all__ = [
    "ALL2ALL_BACKENDS",
    "FusedMoE",
    "Routing",
    "SparseMoeBlock",
    "expert_ranges",
    "grouped_mlp",
    "moe_grouped",
    "moe_reference",
    "route",
    "routing_stats",
]


class Routing(NamedTuple):
    """Each token's chosen experts ``[T, k]`` (int64) and their weights ``[T, k]``."""

    weights: torch.Tensor
    experts: torch.Tensor


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype
) -> Routing:
    """Top-``top_k`` experts of each token by softmax probability (taken in float32), the
    weights renormalised to sum to 1 if ``renormalize``, then cast to ``weight_dtype``
    (Mixtral keeps them in float32, Qwen2-MoE and OLMoE cast to the model's dtype)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(weight_dtype), experts)


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act) -> torch.Tensor:
    """One expert's SwiGLU: ``w2 (act(gate) * up)``, gate and up stacked in ``w13``."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(act(gate) * up, w2)


def moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing, act
) -> torch.Tensor:
    """The MoE layer, one expert at a time: ``x [T, H]``, ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]`` -> ``[T, H]``."""
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        tokens, choice = torch.where(routing.experts == expert)
        if tokens.numel() == 0:  # no token picked this expert
            continue
        y = expert_mlp(x[tokens], w13[expert], w2[expert], act)
        weighted = y * routing.weights[tokens, choice, None]
        out.index_add_(0, tokens, weighted.to(out.dtype))
    return out


def grouped_mlp(
    rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act
) -> torch.Tensor:
    """Every expert's SwiGLU on its run of ``rows``, which are sorted by expert with
    ``counts[e]`` rows for expert ``e``: two grouped matmuls, no loop over experts."""
    offsets = counts.cumsum(0).to(torch.int32)  # where each expert's run ends
    gate, up = F.grouped_mm(rows, w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    return F.grouped_mm(act(gate) * up, w2.transpose(1, 2), offs=offsets)


def moe_grouped(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing, act
) -> torch.Tensor:
    """`moe_reference`'s result with one sort of the (token, choice) pairs by expert and
    `grouped_mlp`."""
    top_k = routing.experts.shape[1]
    experts = routing.experts.flatten()  # pair p is token p // top_k's choice p % top_k
    order = experts.argsort(stable=True)
    tokens = order // top_k
    counts = torch.bincount(experts, minlength=w13.shape[0])
    y = grouped_mlp(x[tokens], counts, w13, w2, act)
    weighted = y * routing.weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))


def run_each_row(
    rows: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act
) -> torch.Tensor:
    """Row ``i`` through expert ``experts[i]``, unweighted, in the rows' order."""
    order = experts.argsort(stable=True)
    y = grouped_mlp(rows[order], torch.bincount(experts, minlength=w13.shape[0]), w13, w2, act)
    return torch.empty_like(y).index_copy_(0, order, y)


def expert_ranges(num_experts: int, size: int) -> list[range]:
    """The experts each of ``size`` ranks holds under expert parallelism: contiguous,
    ``num_experts // size`` each, one more on the first ``num_experts % size`` ranks."""
    base, extra = divmod(num_experts, size)
    starts = [r * base + min(r, extra) for r in range(size + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(size)]


class ExpertLinear(nn.Module):
    """The weights of one projection of every expert this rank holds, as one
    ``[experts, out, in]`` tensor (transformers 5 stores them so too).

    A checkpoint stores each expert's projections apart (``experts.{e}.{name}.weight``);
    ``parts`` names those stacked along ``out`` (gate and up: ``("w1", "w3")`` in
    Mixtral, ``("gate_proj", "up_proj")`` in the others).  Under tensor parallelism
    (not expert parallelism) the rank holds a slice of the intermediate size: of every
    part's rows (``shard_dim`` 0, gate and up) or of the columns (1, down).
    """

    def __init__(
        self,
        num_experts: int,
        experts: range,
        parts: tuple[str, ...],
        out_features: int,
        in_features: int,
        shard_dim: int,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.num_experts, self.experts = num_experts, experts
        self.parts, self.shard_dim = parts, shard_dim
        self.sliced = tp.size > 1 and not tp.expert_parallel
        self.rank = tp.rank
        self.weight = nn.Parameter(torch.empty(len(experts), out_features, in_features))

    def load_targets(self, kind: str) -> LoadTargets:
        """Per expert and part: where it goes in ``weight`` and this rank's slice of it
        (None for the experts other ranks hold)."""
        rows = self.weight.shape[1] // len(self.parts)
        width = rows if self.shard_dim == 0 else self.weight.shape[2]
        theirs = (slice(None),) * self.shard_dim + (
            slice(self.rank * width, (self.rank + 1) * width) if self.sliced else slice(None),
        )
        return {
            f"{expert}.{name}": (
                ((expert - self.experts.start, slice(p * rows, (p + 1) * rows)), theirs)
                if expert in self.experts
                else None
            )
            for expert in range(self.num_experts)
            for p, name in enumerate(self.parts)
        }


class FusedMoE(nn.Module):
    """The experts of one MoE layer (vLLM's ``FusedMoE``): ``forward(x, routing)``
    runs each token through its chosen experts and returns the weighted sum, on every
    rank, whatever the split (tensor- or expert-parallel, see the module docstring).

    ``names``: the checkpoint's names for gate, up and down.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act,
        names: tuple[str, str, str],
        tp: TensorParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp, self.act, self.num_experts = tp, act, num_experts
        if tp.expert_parallel:
            self.owned = expert_ranges(num_experts, tp.size)[tp.rank]
            size = intermediate_size
            # Each expert's owner, to address the tokens that picked it.
            owners = [r for r, held in enumerate(expert_ranges(num_experts, tp.size)) for _ in held]
            self.register_buffer("owner", torch.tensor(owners), persistent=False)
        else:
            self.owned, size = range(num_experts), intermediate_size // tp.size
        gate, up, down = names
        self.gate_up_proj = ExpertLinear(
            num_experts, self.owned, (gate, up), 2 * size, hidden_size, 0, tp
        )
        self.down_proj = ExpertLinear(num_experts, self.owned, (down,), hidden_size, size, 1, tp)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        w13, w2 = self.gate_up_proj.weight, self.down_proj.weight
        if not self.tp.expert_parallel or self.tp.size == 1:
            return self.tp.all_reduce(moe_grouped(x, w13, w2, routing, self.act))
        # This rank's share of the step's tokens; the last ranks' may be short or empty.
        share = -(-x.shape[0] // self.tp.size)
        mine = slice(self.tp.rank * share, (self.tp.rank + 1) * share)
        if self.tp.all2all_backend == "alltoall":
            out = self._all_to_all(x[mine], Routing(*(t[mine] for t in routing)))
        else:
            out = self._reduce_scatter(x, routing, share)
        if out.shape[0] < share:  # a short (or empty) last share, padded for the gather
            out = torch.cat([out, out.new_zeros(share - out.shape[0], out.shape[1])])
        return self.tp.all_gather(out)[: x.shape[0]]

    def _all_to_all(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Send each (token, choice) pair of this rank's tokens to its expert's owner,
        run the pairs that arrive here, send the outputs back, weight and add them."""
        top_k = routing.experts.shape[1]
        experts = routing.experts.flatten()
        destination = self.owner[experts]
        order = destination.argsort(stable=True)  # pairs grouped by the rank they go to
        send = torch.bincount(destination, minlength=self.tp.size)
        recv = self.tp.all_to_all(send, [1] * self.tp.size, [1] * self.tp.size)
        send, recv = send.tolist(), recv.tolist()
        rows = self.tp.all_to_all(x[order // top_k], send, recv)
        local = self.tp.all_to_all(experts[order], send, recv) - self.owned.start
        y = run_each_row(rows, local, self.gate_up_proj.weight, self.down_proj.weight, self.act)
        y = self.tp.all_to_all(y, recv, send)  # back where each pair came from
        weighted = y * routing.weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, order // top_k, weighted.to(x.dtype))

    def _reduce_scatter(self, x: torch.Tensor, routing: Routing, share: int) -> torch.Tensor:
        """Run this rank's experts on every pair routed to them (other pairs weigh
        nothing here), then sum each token's outputs on its owner (reduce-scatter)."""
        local = routing.experts - self.owned.start
        here = (local >= 0) & (local < len(self.owned))
        # Pairs for other ranks' experts go to local expert 0 with weight 0: exact, and
        # no ragged shapes.  (vLLM's expert map sends them nowhere instead.)
        routed = Routing(routing.weights * here, local.where(here, 0))
        partial = moe_grouped(x, self.gate_up_proj.weight, self.down_proj.weight, routed, self.act)
        padded = torch.zeros(share * self.tp.size, x.shape[1], dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = partial
        return self.tp.reduce_scatter(padded)  # padding rows are zeros


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE MLP: the router (``gate``), the experts, and (Qwen2-MoE) a
    shared expert every token goes through, scaled by a sigmoid gate of its own.

    ``tokens_per_expert`` holds the last step's count of (token, choice) pairs per
    expert, ``tokens_per_expert_total`` their sum over every step (`routing_stats`).
    Every rank routes every token (a ``[T, E]`` matmul, small next to the experts), so
    rank 0's counts are the whole step's without a collective.
    """

    def __init__(
        self,
        config,
        num_experts: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_float32: bool,
        names: tuple[str, str, str],
        tp: TensorParallelGroup,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = config.num_experts_per_tok, renormalize
        self.weights_in_float32 = weights_in_float32
        act = fused.get_act_fn(config.hidden_act)
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, config.hidden_size, intermediate_size, act, names, tp)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
        counts = torch.zeros(num_experts, dtype=torch.long)
        self.register_buffer("tokens_per_expert", counts, persistent=False)
        self.register_buffer("tokens_per_expert_total", counts.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        dtype = torch.float32 if self.weights_in_float32 else logits.dtype
        routing = route(logits, self.top_k, self.renormalize, dtype)
        self._count(routing.experts)
        out = self.experts(x, routing)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _count(self, experts: torch.Tensor) -> None:
        # scatter_add_ rather than bincount: no host sync, and a fixed shape.
        flat = experts.flatten()
        self.tokens_per_expert.zero_().scatter_add_(0, flat, torch.ones_like(flat))
        self.tokens_per_expert_total += self.tokens_per_expert


def routing_stats(model: nn.Module) -> dict:
    """The MoE layers' routing in the last step and over the run: ``expert_tokens`` and
    ``expert_tokens_total`` (``[layer][expert]`` counts of (token, choice) pairs), and
    ``expert_load_imbalance``, the last step's busiest expert's count over the mean
    count, averaged over the layers (1: perfectly even; the step waits on the busiest
    expert).  Empty for a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return {}
    last = torch.stack([b.tokens_per_expert for b in blocks]).cpu()
    total = torch.stack([b.tokens_per_expert_total for b in blocks]).cpu()
    mean = last.float().mean(dim=1)
    imbalance = (last.max(dim=1).values / mean.clamp(min=1e-9)).where(mean > 0, 1.0)
    return {
        "expert_tokens": last.tolist(),
        "expert_tokens_total": total.tolist(),
        "expert_load_imbalance": float(imbalance.mean()),
    }

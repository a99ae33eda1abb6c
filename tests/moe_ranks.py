"""The ranks of test_moe_engine.py's expert-parallel check, in a module of their own so
that each spawned process imports only torch and the MoE layer, not the test module."""

import torch
import torch.nn.functional as F

from minipaged.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from minipaged.models.moe import FusedMoE, moe_reference, route


def expert_parallel_rank(rank: int, size: int, port: int) -> None:
    """One rank of `test_expert_parallel_layer_equals_the_loop_on_four_ranks`."""
    torch.set_num_threads(1)  # four ranks share the machine's cores
    init_tensor_parallel(rank, size, port, torch.device("cpu"))
    try:
        for backend in ("alltoall", "allgather_reducescatter"):
            tp = TensorParallelGroup(rank, size, expert_parallel=True, all2all_backend=backend)
            for num_experts, tokens in [(5, 1), (5, 3), (6, 9), (7, 30)]:
                g = torch.Generator().manual_seed(tokens)  # the same on every rank
                w13 = torch.randn(num_experts, 32, 16, generator=g) / 4
                w2 = torch.randn(num_experts, 16, 16, generator=g) / 4
                x = torch.randn(tokens, 16, generator=g)
                logits = torch.randn(tokens, num_experts, generator=g)
                logits[:, 1] = float("-inf")  # an expert no token picks
                routing = route(logits, 2, True, torch.float32)
                layer = FusedMoE(num_experts, 16, 16, F.silu, ("g", "u", "d"), tp)
                layer.requires_grad_(False)
                layer.gate_up_proj.weight.data.copy_(w13[layer.owned.start : layer.owned.stop])
                layer.down_proj.weight.data.copy_(w2[layer.owned.start : layer.owned.stop])
                torch.testing.assert_close(
                    layer(x, routing),
                    moe_reference(x, w13, w2, routing, F.silu),
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, b=backend, e=num_experts, t=tokens: f"{b} E={e} T={t}: {m}",
                )
    finally:
        destroy_tensor_parallel()

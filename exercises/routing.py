"""Lesson 16: the router of a mixture-of-experts layer (Shazeer et al. 2017, §2.1;
Mixtral, Jiang et al. 2024, §2.1).

Write ``route``, which every MoE layer of `minipaged.models.moe_models` calls on its
router's logits, then check with ``make check LESSON=16``: the tests compare your
routing with transformers' own routers of Mixtral, Qwen2-MoE and OLMoE, and the
engine's per-step expert counts with Hugging Face's router choices.

Hint: three lines of torch.  ``torch.softmax(..., dtype=torch.float32)`` computes the
probabilities in float32 whatever the logits' dtype, ``Tensor.topk`` returns the values
and their indices, largest first; renormalise before the cast, cast last.
"""

import torch

from minipaged.models.moe import Routing


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype
) -> Routing:
    """Each token's ``top_k`` experts and their weights, from ``router_logits [T,
    num_experts]``.

    Softmax over the experts in float32; the ``top_k`` largest probabilities are the
    weights and their experts the choice (``Routing(weights [T, k], experts [T, k])``,
    largest first); with ``renormalize`` the ``k`` weights are divided by their sum, so
    they add up to 1 (Mixtral always, OLMoE and Qwen2-MoE when ``norm_topk_prob``); the
    weights are cast to ``weight_dtype`` last.
    """
    raise NotImplementedError("write route() in exercises/routing.py")

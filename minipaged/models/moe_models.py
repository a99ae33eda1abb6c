"""Mixtral, Qwen2-MoE and OLMoE: the Llama family with a mixture of experts in the MLP's
place (`minipaged.models.moe`), as transformers 5 defines them.

What sets each family apart, each handled where named:

- **Mixtral** (``MixtralForCausalLM``, Jiang et al. 2024): Mistral's attention; the
  top-k weights always renormalised, and kept in float32 until each expert's output is
  scaled; its checkpoints call the MoE block ``block_sparse_moe`` and the projections
  ``w1`` (gate), ``w3`` (up), ``w2`` (down);
- **Qwen2-MoE** (``Qwen2MoeForCausalLM``): Qwen2's attention (biases on q/k/v when
  ``qkv_bias``); experts of ``moe_intermediate_size``; renormalised only with
  ``norm_topk_prob``; a *shared expert* every token goes through, scaled by
  ``sigmoid(shared_expert_gate(x))``; the layers in ``mlp_only_layers``, or off the
  ``decoder_sparse_step`` beat, keep a dense MLP;
- **OLMoE** (``OlmoeForCausalLM``, Muennighoff et al. 2024): biases where
  ``attention_bias``; RMSNorm over the *whole* query and key projections (all heads at
  once, not per head as in Qwen3), then ``clip_qkv``; renormalised with ``norm_topk_prob``.

Under tensor parallelism the attention splits as in Llama and the experts as
`FusedMoE` says; OLMoE's whole-projection norms then need each rank's sum of squares
(one small all-reduce each, `ShardedRMSNorm`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from minipaged.distributed.layers import LoadTargets
from minipaged.distributed.parallel_state import TensorParallelGroup
from minipaged.models.attention import AttentionMetadata
from minipaged.models.llama import (
    ArchOptions,
    KVCache,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    check_tensor_parallel,
)
from minipaged.models.moe import SparseMoeBlock
from minipaged.ops import fused

__all__ = ["MODELS", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM"]


class MoeForCausalLM(LlamaForCausalLM):
    """A decoder whose MLPs are `SparseMoeBlock`s; the subclasses say how their family
    names, sizes and routes its experts."""

    # The checkpoint's names for each expert's gate, up and down projections.
    expert_names = ("gate_proj", "up_proj", "down_proj")
    # The config attribute holding one expert's intermediate size.
    expert_size = "intermediate_size"
    # Mixtral keeps the top-k weights in float32; the others cast them to the model's dtype.
    weights_in_float32 = False
    # Not split into pipeline stages: the routing statistics read every layer's router.
    supports_pp = False

    @classmethod
    def renormalize(cls, config) -> bool:
        """Whether the top-k weights are rescaled to sum to 1."""
        return config.norm_topk_prob

    @classmethod
    def make_layer(
        cls, config, layer_idx: int, arch: ArchOptions, attention_backend: str, tp
    ) -> nn.Module:
        return LlamaDecoderLayer(
            config,
            cls.make_attention(config, arch, attention_backend, tp),
            cls.make_mlp(config, layer_idx, arch, tp),
        )

    @classmethod
    def make_attention(cls, config, arch, attention_backend: str, tp) -> nn.Module:
        return LlamaAttention(config, arch, attention_backend, tp)

    @classmethod
    def make_mlp(cls, config, layer_idx: int, arch: ArchOptions, tp) -> nn.Module:
        return SparseMoeBlock(
            config,
            config.num_experts,
            getattr(config, cls.expert_size),
            cls.renormalize(config),
            cls.weights_in_float32,
            cls.expert_names,
            tp,
            cls.shared_expert(config, tp),
        )

    @classmethod
    def shared_expert(cls, config, tp) -> nn.Module | None:
        """The MLP every token goes through beside its experts, if the family has one."""
        return None

    @classmethod
    def check_parallel(cls, config, size: int, expert_parallel: bool = False) -> None:
        """As Llama's, where under tensor parallelism each expert's intermediate size
        must split; under expert parallelism whole experts do, so there must be at
        least one per rank (but ``num_experts`` need not divide the ranks)."""
        if expert_parallel and config.num_experts < size:
            raise ValueError(
                f"enable_expert_parallel puts at least one expert on each of the "
                f"tensor_parallel_size={size} ranks; the model has {config.num_experts}"
            )
        experts = () if expert_parallel else (cls.expert_size,)
        check_tensor_parallel(config, size, experts + cls.dense_sizes(config))

    @classmethod
    def dense_sizes(cls, config) -> tuple[str, ...]:
        """Config sizes of the dense MLPs besides the experts, split under tensor
        parallelism whatever the experts do."""
        return ()


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral's layers, every MLP a mixture of experts."""

    expert_names = ("w1", "w3", "w2")
    weights_in_float32 = True
    # Mixtral's checkpoints name the MoE block as transformers 4 did; transformers 5
    # reads them into ``mlp`` (its conversion mapping), and so do we.
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def renormalize(cls, config) -> bool:
        return True


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE: Qwen2's attention, experts beside a gated shared expert."""

    expert_size = "moe_intermediate_size"

    @classmethod
    def arch_options(cls, config) -> ArchOptions:
        return replace(super().arch_options(config), qkv_bias=config.qkv_bias, o_bias=False)

    @classmethod
    def is_sparse(cls, config, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has experts (HF's rule), or a dense MLP."""
        return (
            layer_idx not in config.mlp_only_layers
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        )

    @classmethod
    def make_mlp(cls, config, layer_idx: int, arch: ArchOptions, tp) -> nn.Module:
        if not cls.is_sparse(config, layer_idx):
            return LlamaMLP(config, False, tp)
        return super().make_mlp(config, layer_idx, arch, tp)

    @classmethod
    def shared_expert(cls, config, tp) -> nn.Module:
        return LlamaMLP(config, False, tp, config.shared_expert_intermediate_size)

    @classmethod
    def dense_sizes(cls, config) -> tuple[str, ...]:
        layers = range(config.num_hidden_layers)
        dense = any(not cls.is_sparse(config, i) for i in layers)
        return ("shared_expert_intermediate_size",) + (("intermediate_size",) if dense else ())


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE: whole-projection q/k norms and ``clip_qkv`` in attention, every MLP a
    mixture of experts."""

    @classmethod
    def make_attention(cls, config, arch, attention_backend: str, tp) -> nn.Module:
        return OlmoeAttention(config, arch, attention_backend, tp)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose elements are split over the ranks, ``shards`` ways:
    each rank holds ``dim`` of them (a slice replicated on ``size // shards`` ranks when
    there are fewer shards than ranks, as KV heads are) and its slice of the scale.
    The mean square is the sum over the ranks' slices (an all-reduce) over the full
    length, so every rank normalises by the statistic of the whole vector."""

    def __init__(self, dim: int, shards: int, eps: float, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.tp, self.full = eps, tp, dim * shards
        self.replicas = max(1, tp.size // shards)
        self.start = (tp.rank * shards // tp.size) * dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        squares = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.replicas
        x = x * torch.rsqrt(squares / self.full + self.eps)
        return self.weight * x.to(dtype)

    def load_targets(self, kind: str) -> LoadTargets:
        dim = self.weight.shape[0]
        return {"": ((slice(None),), (slice(self.start, self.start + dim),))}


class OlmoeAttention(LlamaAttention):
    """Llama's attention with OLMoE's q/k norms over all heads (before the split into
    heads and RoPE), and q, k, v clipped to ``[-clip_qkv, clip_qkv]`` when it is set."""

    def __init__(self, config, arch: ArchOptions, attention_backend: str, tp) -> None:
        super().__init__(config, arch, attention_backend, tp)
        eps, kv_shards = config.rms_norm_eps, min(tp.size, config.num_key_value_heads)
        self.q_norm = ShardedRMSNorm(self.num_heads * self.head_dim, tp.size, eps, tp)
        self.k_norm = ShardedRMSNorm(self.num_kv_heads * self.head_dim, kv_shards, eps, tp)
        self.clip_qkv = config.clip_qkv

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(hidden)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = fused.rotary_embedding(q, k, cos, sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn).flatten(1))


# config.architectures[0] -> class, for the loader.
MODELS = {cls.__name__: cls for cls in (MixtralForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM)}

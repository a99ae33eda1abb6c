"""DeepSeek-V2 (``DeepseekV2ForCausalLM``, Liu et al. 2024) as transformers 5 defines it:
multi-head latent attention over a paged latent cache, and DeepSeekMoE.

**Multi-head latent attention** (§2.1).  Each token's keys and values come from one
compressed vector: ``kv_a_proj_with_mqa`` projects the hidden state to ``c_kv``
(``kv_lora_rank``, then an RMSNorm) and a RoPE key ``k_pe`` (``qk_rope_head_dim``,
shared by every head); ``kv_b_proj`` expands ``c_kv`` into each head's ``k_nope``
(``qk_nope_head_dim``) and value (``v_head_dim``).  The query is ``q_proj`` of the
hidden state, or (``q_lora_rank`` set) ``q_b_proj`` of a normed low-rank ``q_a_proj``;
its head splits into ``q_nope`` and ``q_pe``.  RoPE rotates ``q_pe`` and ``k_pe`` only,
as interleaved pairs (HF's ``apply_rotary_emb``, complex multiplication), with YaRN's
frequencies where the config asks, and the softmax scale is ``qk_head_dim ** -0.5``
times YaRN's ``mscale_all_dim`` factor squared.

The cache holds ``c_kv`` and ``k_pe`` only, ``kv_lora_rank + qk_rope_head_dim`` values a
token and layer (`minipaged.ops.mla`), where Llama's holds a key and a value per KV
head.  `MLAPagedAttention` writes it, then

- **prefill** decompresses each prefill sequence's latents into per-head keys and values
  and runs the ordinary paged prefill op (values zero-padded to the key's width, as vLLM
  pads them for FlashAttention);
- **decode** attends in the **absorbed** form (`minipaged.ops.mla.decode_absorbed`):
  ``W_UK`` folded into the query, ``W_UV`` applied to each head's weighted latent, so
  the kernel reads one latent per token instead of a key and a value per head.
  ``absorb=False`` (or ``MINIPAGED_MLA_DISABLE_ABSORPTION=1`` when the model is built;
  vLLM has no such switch: its ``VLLM_MLA_DISABLE`` gives up the latent cache altogether)
  decodes as prefill does, to compare the two.

**DeepSeekMoE** (§2.2): ``n_routed_experts`` experts of ``moe_intermediate_size`` (top
``num_experts_per_tok`` by softmax score, in float32, never renormalised, times
``routed_scaling_factor``; with ``topk_method="group_limited_greedy"`` only among the
``topk_group`` of ``n_group`` groups whose best expert scores highest), beside
``n_shared_experts`` shared experts every token goes through (one MLP of
``n_shared_experts * moe_intermediate_size``, no gate); the first
``first_k_dense_replace`` layers keep a dense MLP.

Under tensor parallelism each rank holds its share of the heads (``q_proj`` or
``q_b_proj``, ``kv_b_proj`` by rows, ``o_proj`` by columns, one all-reduce) and the
whole latent path (``q_a_proj``, ``kv_a_proj_with_mqa``, their norms), so every rank
caches the same latents: the latent cache is replicated, as in vLLM.  The experts split
as `minipaged.models.moe.FusedMoE` says; the shared experts are a dense MLP, sliced
over the ranks under expert parallelism too.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.distributed.layers import ColumnParallelLinear, RowParallelLinear
from minipaged.distributed.parallel_state import SINGLE, TensorParallelGroup
from minipaged.models.attention import AttentionMetadata, PagedAttention
from minipaged.models.llama import ArchOptions, LlamaMLP, RMSNorm, rope_frequencies
from minipaged.models.moe import Routing, SparseMoeBlock
from minipaged.models.moe_models import MoeForCausalLM
from minipaged.ops import kv_quant, mla

__all__ = [
    "ABSORPTION_ENV",
    "DeepseekV2ForCausalLM",
    "MLAPagedAttention",
    "MODELS",
    "deepseek_route",
    "set_mla_absorption",
    "softmax_scale",
]

# Set to 1 to build DeepSeek models that decode in the unabsorbed form.
ABSORPTION_ENV = "MINIPAGED_MLA_DISABLE_ABSORPTION"
# HF's DeepseekV2RMSNorm on q_a and kv_a takes its default eps, not the config's.
LATENT_NORM_EPS = 1e-6


def softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` under YaRN with ``mscale_all_dim``
    (YaRN's attention temperature, DeepSeek's ``yarn_get_mscale``; HF's
    ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters
    factor, all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and all_dim and factor > 1:
        scale *= (0.1 * all_dim * math.log(factor) + 1.0) ** 2
    return scale


class InterleavedRotaryEmbedding(nn.Module):
    """cos and sin ``[T, rope / 2]`` in float32, times YaRN's attention factor: RoPE as
    DeepSeek applies it, to consecutive pairs (`rotate_interleaved`)."""

    def __init__(self, config) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        # HF rotates in float32 whatever the model's dtype; so do we.
        angles = positions[:, None].float() * self.inv_freq
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, rope]`` with pairs ``(x[2i], x[2i+1])`` rotated by ``cos, sin [T,
    rope / 2]``: HF's complex product ``x * e^{i angle}``, in float32, cast back."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class MLAPagedAttention(PagedAttention):
    """One MLA layer over its paged latent cache: store the new latents, attend.

    ``forward`` takes the query's two parts and the new tokens' latents, and returns
    each head's attention output ``[T, heads, v_head_dim]``; ``kv_b_proj`` (the layer's,
    this rank's heads) decompresses or is absorbed.  The ``cuda`` backend runs Triton's
    kernels: its compiled kernels take fixed head sizes, none of MLA's.
    """

    def __init__(
        self, scale: float, backend: str, qk_nope_head_dim: int, v_head_dim: int, absorb: bool
    ) -> None:
        super().__init__(scale, backend)
        self.qk_nope_head_dim, self.v_head_dim, self.absorb = qk_nope_head_dim, v_head_dim, absorb

    def bind(self, device: torch.device):
        self.impl = PagedAttention(self.scale, self._kernel_backend()).bind(device)
        return self.impl

    def _kernel_backend(self) -> str:
        return "triton" if self.backend == "cuda" else self.backend

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        kv_cache: tuple[torch.Tensor, ...],
        attn: AttentionMetadata,
        kv_b_proj: nn.Module,
    ) -> torch.Tensor:
        cache, *kv_scale = kv_cache
        kv_scale = kv_scale[0] if kv_scale else None
        if self.calculate_kv_scales:  # vLLM's calc_kv_scales, on the first batch
            amax = float(latent.abs().max()) if latent.numel() else 0.0
            kv_scale.fill_(amax / kv_quant.K_SCALE_CONSTANT if amax > 0 else 1.0)
            self.calculate_kv_scales = False
        impl = self.impl or self.bind(cache.device)
        mla.write_latent(latent, cache, attn.slot_mapping, kv_scale)
        n = attn.num_prefill_tokens
        parts = []
        if n > 0:
            parts.append(
                self._prefill(impl, q_nope[:n], q_pe[:n], cache, kv_scale, attn, kv_b_proj)
            )
        if n < q_nope.shape[0]:
            decode = self._decode_absorbed if self.absorb else self._decode_unabsorbed
            parts.append(decode(impl, q_nope[n:], q_pe[n:], cache, kv_scale, attn, kv_b_proj))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _prefill(self, impl, q_nope, q_pe, cache, kv_scale, attn, kv_b_proj):
        query, keys, values, tables = self._decompressed(
            q_nope, q_pe, cache, kv_scale, attn.prefill_block_tables, kv_b_proj
        )
        out = impl.paged_attention_prefill(
            query,
            keys,
            values,
            tables,
            attn.prefill_query_start_loc,
            attn.prefill_context_lens,
            self.scale,
            max_query_len=attn.max_prefill_query_len,
        )
        return out[..., : self.v_head_dim]

    def _decode_unabsorbed(self, impl, q_nope, q_pe, cache, kv_scale, attn, kv_b_proj):
        query, keys, values, tables = self._decompressed(
            q_nope, q_pe, cache, kv_scale, attn.decode_block_tables, kv_b_proj
        )
        out = impl.paged_attention_decode(
            query,
            keys,
            values,
            tables,
            attn.decode_context_lens,
            self.scale,
            max_context_len=attn.max_decode_context_len,
        )
        return out[..., : self.v_head_dim]

    def _decompressed(self, q_nope, q_pe, cache, kv_scale, block_tables, kv_b_proj):
        """Per-head keys and values of every block the sequences' tables name, as a
        paged cache of its own (block ``j`` of it: entry ``j`` of the flattened tables),
        the query, keys and values zero-padded to one width."""
        latent = mla.gather_latent(cache, block_tables.flatten(), q_nope.dtype, kv_scale)
        blocks, block_size, _ = latent.shape
        rank = latent.shape[-1] - q_pe.shape[-1]
        heads = q_nope.shape[1]
        kv = kv_b_proj(latent[..., :rank].reshape(-1, rank)).view(blocks, block_size, heads, -1)
        k_nope, values = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = latent[..., None, rank:].expand(-1, -1, heads, -1)
        keys = torch.cat((k_nope, k_pe), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        width = max(keys.shape[-1], self.v_head_dim)
        query, keys, values = (_pad(t, width) for t in (query, keys, values))
        tables = torch.arange(blocks, dtype=block_tables.dtype, device=block_tables.device)
        return query, keys, values, tables.view(block_tables.shape)

    def _decode_absorbed(self, impl, q_nope, q_pe, cache, kv_scale, attn, kv_b_proj):
        heads = q_nope.shape[1]
        # W_UK and W_UV are views of kv_b_proj's rows, per head: nothing copied.
        w_kv_b = kv_b_proj.weight.view(heads, -1, kv_b_proj.weight.shape[-1])
        w_uk, w_uv = w_kv_b.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        weighted = mla.decode_absorbed(
            q_latent,
            q_pe,
            cache,
            attn.decode_block_tables,
            attn.decode_context_lens,
            self.scale,
            kv_scale,
            self._kernel_backend(),
            attn.max_decode_context_len,
        )
        return torch.einsum("bhr,hvr->bhv", weighted.to(q_nope.dtype), w_uv)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, absorb={self.absorb}"


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` zero-padded to ``width`` in its last dimension, contiguous (the kernels'
    caches must be)."""
    return x.contiguous() if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def set_mla_absorption(model: nn.Module, absorb: bool) -> None:
    """Decode in the absorbed (True) or the unabsorbed form (False) from now on."""
    for module in model.modules():
        if isinstance(module, MLAPagedAttention):
            module.absorb = absorb


class MLAAttention(nn.Module):
    """DeepSeek-V2's attention: project, rotate the RoPE parts, attend over the latent
    cache (`MLAPagedAttention`), project out.  Under tensor parallelism, this rank's
    heads; the latent path whole on every rank."""

    def __init__(self, config, attention_backend: str, tp: TensorParallelGroup) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.num_heads = heads // tp.size
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk_head_dim = self.nope + self.rope
        bias = config.attention_bias
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                config.hidden_size, {"q_proj": heads * qk_head_dim}, bias=False, tp=tp
            )
        else:
            self.q_a_proj = ColumnParallelLinear(
                config.hidden_size, {"q_a_proj": self.q_lora_rank}, bias=bias
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, {"q_b_proj": heads * qk_head_dim}, bias=False, tp=tp
            )
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            config.hidden_size, {"kv_a_proj_with_mqa": self.kv_lora_rank + self.rope}, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            {"kv_b_proj": heads * (self.nope + config.v_head_dim)},
            bias=False,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            heads * config.v_head_dim, config.hidden_size, bias=bias, tp=tp
        )
        absorb = os.environ.get(ABSORPTION_ENV, "0") != "1"
        self.attn = MLAPagedAttention(
            softmax_scale(config), attention_backend, self.nope, config.v_head_dim, absorb
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, ...],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1
        )
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe = rotate_interleaved(q_pe, cos, sin)
        k_pe = rotate_interleaved(k_pe[:, None], cos, sin)[:, 0]
        latent = torch.cat((c_kv, k_pe), dim=-1)
        out = self.attn(q_nope, q_pe, latent, kv_cache, attn, self.kv_b_proj)
        return self.o_proj(out.flatten(1))


def deepseek_route(
    router_logits: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    n_group: int | None = None,
    topk_group: int | None = None,
) -> Routing:
    """DeepSeekMoE's routing (HF's ``DeepseekV2TopkRouter``): softmax scores in float32;
    with ``n_group`` groups of experts, only the ``topk_group`` groups with the best
    single score may be picked (``group_limited_greedy``, §2.2.2's device-limited
    routing); the top-``top_k`` scores, not renormalised, times
    ``routed_scaling_factor``, kept in float32."""
    scores = router_logits.float().softmax(dim=-1)
    if n_group is not None and topk_group is not None:
        grouped = scores.view(scores.shape[0], n_group, -1)
        chosen = grouped.amax(dim=-1).topk(topk_group, dim=-1).indices
        allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, chosen, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
    weights, experts = scores.topk(top_k, dim=-1)
    return Routing(weights * routed_scaling_factor, experts)


class DeepseekV2MoE(SparseMoeBlock):
    """DeepSeekMoE: routed experts (`deepseek_route`) plus the shared experts' MLP."""

    def __init__(self, config, tp: TensorParallelGroup) -> None:
        super().__init__(
            config,
            config.n_routed_experts,
            config.moe_intermediate_size,
            renormalize=False,
            weights_in_float32=True,
            names=("gate_proj", "up_proj", "down_proj"),
            tp=tp,
        )
        # HF keeps the router's weight, and computes its logits, in float32.
        self.gate = nn.Linear(
            config.hidden_size, config.n_routed_experts, bias=False, dtype=torch.float32
        )
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = LlamaMLP(config, config.mlp_bias, tp, shared)
        self.routed_scaling_factor = config.routed_scaling_factor
        limited = config.topk_method == "group_limited_greedy"
        self.n_group = config.n_group if limited else None
        self.topk_group = config.topk_group if limited else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = deepseek_route(
            F.linear(x.float(), self.gate.weight),
            self.top_k,
            self.routed_scaling_factor,
            self.n_group,
            self.topk_group,
        )
        self._count(routing.experts)
        return self.experts(x, routing) + self.shared_experts(x)


TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """DeepSeek-V2: MLA in every layer, DeepSeekMoE after the first
    ``first_k_dense_replace`` dense layers."""

    expert_size = "moe_intermediate_size"
    weights_in_float32 = True

    def __init__(self, config, attention_backend: str = "torch", tp=SINGLE, **kwargs) -> None:
        _check_config(config)
        super().__init__(config, attention_backend=attention_backend, tp=tp, **kwargs)
        self.model.rotary_emb = InterleavedRotaryEmbedding(config)

    @classmethod
    def make_attention(cls, config, arch, attention_backend: str, tp) -> nn.Module:
        return MLAAttention(config, attention_backend, tp)

    @classmethod
    def make_mlp(cls, config, layer_idx: int, arch: ArchOptions, tp) -> nn.Module:
        if layer_idx < config.first_k_dense_replace:
            return LlamaMLP(config, config.mlp_bias, tp)
        return DeepseekV2MoE(config, tp)

    @classmethod
    def check_parallel(cls, config, size: int, expert_parallel: bool = False) -> None:
        """The heads, the dense and shared MLPs' sizes, and (not under expert
        parallelism) each expert's, must split evenly over ``size`` ranks."""
        super().check_parallel(config, size, expert_parallel)
        shared = config.moe_intermediate_size * config.n_shared_experts
        if shared % size:
            raise ValueError(
                f"tensor_parallel_size={size} must divide the model's shared experts' "
                f"intermediate size (moe_intermediate_size * n_shared_experts = {shared})"
            )

    @classmethod
    def dense_sizes(cls, config) -> tuple[str, ...]:
        return ("intermediate_size",) if config.first_k_dense_replace else ()


def _check_config(config) -> None:
    """Refuse what transformers' DeepseekV2 would not run, or runs differently."""
    if config.topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {config.topk_method!r}")
    if config.topk_method == "group_limited_greedy" and (
        not config.n_group or not config.topk_group or config.n_routed_experts % config.n_group
    ):
        raise ValueError(
            "topk_method='group_limited_greedy' needs n_group dividing n_routed_experts "
            f"and topk_group, got n_group={config.n_group}, topk_group={config.topk_group}, "
            f"n_routed_experts={config.n_routed_experts}"
        )
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {config.qk_rope_head_dim}")


# config.architectures[0] -> class, for the loader.
MODELS = {DeepseekV2ForCausalLM.__name__: DeepseekV2ForCausalLM}

"""The Llama family as Hugging Face defines it, running over the paged KV cache.

Llama, Mistral, Qwen2 and Qwen3 are one decoder-only transformer (pre-norm RMSNorm,
rotary position embeddings, grouped-query attention, SwiGLU MLP) with small
differences, each named where it is handled:

- Qwen2 has biases on q/k/v (HF hard-codes them), none on o;
- Qwen3 normalises every query and key head with an RMSNorm before RoPE;
- Llama and Qwen3 put biases on q/k/v/o if ``config.attention_bias``, Llama on the MLP
  if ``config.mlp_bias``;
- Mistral (and Qwen with ``use_sliding_window``) may have a sliding window: the paged
  ops attend to the whole context, so a sequence may not grow past the window;
- ``tie_word_embeddings`` makes the LM head the embedding matrix itself.

The code mirrors HF's ``modeling_llama.py`` operation for operation (the same dtype
casts, in the same places), so that on the same weights the logits agree to rounding.
It differs in what serving needs (paper §4): no batch dimension and no padding, since a
step is one flat batch of the new tokens of many sequences (``AttentionMetadata``); keys
and values go to the paged cache rather than a per-sequence one; and, as in vLLM,
q/k/v_proj and gate/up_proj each run as one matmul (``ColumnParallelLinear`` with
parts), which the loader fills from HF's separate tensors.  Every other parameter has
its HF name.

With ``tp``, a `TensorParallelGroup` of more than one rank, each rank builds its slice
of every layer (§4.6, Megatron-LM): its share of the query heads and of the KV heads
(one replicated KV head when there are more ranks than KV heads), of the MLP's
intermediate size and of the vocabulary; o_proj and down_proj end in an all-reduce, and
the logits are gathered on rank 0.  `check_tensor_parallel` says which sizes must divide.

With ``pp``, a `PipelineStage` of more than one, the model holds one stage's layers only
(GPipe; vLLM's ``make_layers``): the decoder layers ``pp.layers(num_hidden_layers)``,
the others `PPMissingLayer` placeholders that keep every layer's HF name, the embedding
on the first stage only, the final norm and the LM head on the last only.  A stage's
forward takes the previous stage's hidden states instead of token ids: the residual
stream, which a stage hands on as one tensor (vLLM hands on hidden states and residual).

The layers carry the residual stream beside the hidden states, as vLLM's do: each norm
but the first adds the sublayer's output to the residual and normalises the sum in one
op (`fused.fused_add_rms_norm`).  On the CPU the norms, the rotary embedding and SwiGLU's
activation run as fused C++ ops; the torch ops of `minipaged.ops.fused`, HF's, run
everywhere else (`fused.uses_cpu_kernels` decides).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from minipaged.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minipaged.distributed.parallel_state import (
    NO_PIPELINE,
    SINGLE,
    PipelineStage,
    TensorParallelGroup,
    kv_heads_per_rank,
)
from minipaged.models.attention import AttentionMetadata, PagedAttention, head_dim
from minipaged.ops import fused

__all__ = [
    "MODELS",
    "ROPE_TYPES",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "PPMissingLayer",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "check_tensor_parallel",
    "rope_frequencies",
    "sliding_window",
]

KVCache = tuple[torch.Tensor, torch.Tensor]
# The RoPE variants Llama-family configs use.  "longrope" (Phi-3) picks its frequencies
# per forward pass from the sequence length, which a shared paged cache cannot follow.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class ArchOptions:
    """What sets one architecture of the family apart from Llama."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` (Zhang & Sennrich 2019), as HF's
    ``LlamaRMSNorm`` (`fused.rms_norm`).  Given the ``residual`` too, vLLM's fused form:
    ``residual = x + residual``, returning ``(norm(residual), residual)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies ``[head_dim / 2]`` (float32) and the factor HF scales
    cos and sin by (YaRN's attention temperature; 1 otherwise), for ``config``'s variant.

    The scaled variants come from transformers' ``ROPE_INIT_FUNCTIONS``, so they match HF
    exactly.  "dynamic" is evaluated as HF does at start-up, which equals plain RoPE for
    positions below ``max_position_embeddings``; HF recomputes it per forward pass beyond
    that, from the longest sequence in its batch, so past that length the two differ.
    """
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_parameters['rope_type'] must be one of {ROPE_TYPES}, got {rope_type!r}"
        )
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    # HF keeps plain RoPE on each model class rather than in ROPE_INIT_FUNCTIONS.
    dim = head_dim(config)
    return 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim), 1.0


class RotaryEmbedding(nn.Module):
    """cos and sin of ``position * inv_freq`` for each token (RoFormer, Su et al. 2021)."""

    def __init__(self, config) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """``positions [T]`` -> ``cos, sin [T, head_dim]`` in ``dtype``, computed in float32."""
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (
            (angles.cos() * self.attention_scaling).to(dtype),
            (angles.sin() * self.attention_scaling).to(dtype),
        )


class LlamaAttention(nn.Module):
    """GQA self-attention: project, (Qwen3) norm q/k per head, rotate, attend paged.
    Under tensor parallelism, over this rank's heads, o_proj summing the ranks' outputs."""

    def __init__(
        self, config, arch: ArchOptions, attention_backend: str, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, tp.size)
        self.head_dim = head_dim(config)
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        kv_shards = min(tp.size, config.num_key_value_heads)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            bias=arch.qkv_bias,
            tp=tp,
            shards={"k_proj": kv_shards, "v_proj": kv_shards},
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=arch.o_bias, tp=tp)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        self.attn = PagedAttention(self.head_dim**-0.5, attention_backend)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(hidden)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = fused.rotary_embedding(q, k, cos, sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn).flatten(1))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): ``down(act(gate(x)) * up(x))``, act being SiLU here;
    ``intermediate_size`` replaces the config's (Qwen2-MoE's shared expert)."""

    def __init__(
        self, config, bias: bool, tp: TensorParallelGroup, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=bias, tp=tp
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, tp=tp)
        self.act_fn = fused.get_act_fn(config.hidden_act)
        self.silu = config.hidden_act == "silu"  # the family's; `fused.silu_and_mul`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu:
            return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj.split(x)
        return self.down_proj(self.act_fn(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``, with the
    family's attention and MLP (`LlamaForCausalLM.make_layer`).  As in vLLM, the stream
    ``x`` is carried as ``hidden + residual``: each layer returns its MLP's output and
    the residual before it, and the next norm adds them (`RMSNorm` with a residual)."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual`` None: ``hidden`` is the stream itself (the first layer)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def sliding_window(config) -> int | None:
    """The attention window HF applies to some layer of ``config``, or None.

    Mistral slides every layer when ``sliding_window`` is set; Qwen2/3 only the layers
    ``layer_types`` marks, and leave ``sliding_window`` None unless ``use_sliding_window``.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


class PPMissingLayer(nn.Identity):
    """A decoder layer another pipeline stage holds (vLLM's name): no weights here."""


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: token ids -> last hidden states; of a
    pipeline stage, only its part (``layers``, the placeholders' the other stages')."""

    def __init__(
        self,
        config,
        layers: list[nn.Module],
        tp: TensorParallelGroup,
        pp: PipelineStage = NO_PIPELINE,
    ) -> None:
        super().__init__()
        self.stage_layers = pp.layers(config.num_hidden_layers)
        self.dtype = torch.get_default_dtype()  # the loader builds in the model's dtype
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            if pp.is_first
            else None
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None
        self.rotary_emb = RotaryEmbedding(config)
        self.sliding_window = sliding_window(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden``: the previous pipeline stage's output (None on the first stage,
        which embeds ``input_ids``); the fused ops may write into it (the residual)."""
        if len(kv_caches) != len(self.stage_layers):
            raise ValueError(
                f"kv_caches must hold one (key_cache, value_cache) pair per "
                f"layer ({len(self.stage_layers)}), got {len(kv_caches)}"
            )
        self._check_window(positions)
        if hidden is None:
            hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for i, kv_cache in zip(self.stage_layers, kv_caches):
            hidden, residual = self.layers[i](hidden, residual, cos, sin, kv_cache, attn)
        if self.norm is not None:
            return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        return hidden if residual is None else hidden + residual

    def _check_window(self, positions: torch.Tensor) -> None:
        # Within the window HF's sliding mask hides nothing, so full attention is exact;
        # past it the paged ops would attend to tokens HF masks.  (A host sync, paid only
        # by sliding-window models.)
        if self.sliding_window is None or positions.numel() == 0:
            return
        longest = int(positions.max()) + 1
        if longest > self.sliding_window:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds the model's sliding "
                f"window of {self.sliding_window}, which minipaged does not "
                "implement; keep sequences within it"
            )


class LlamaForCausalLM(nn.Module):
    """Llama (and the base of the family): a decoder and an LM head.

    ``model(input_ids [T], positions [T], kv_caches, attn) -> hidden [T, hidden_size]``
    runs one step; ``compute_logits(hidden [N, hidden_size]) -> [N, vocab] float32`` is
    separate so the engine projects only the rows it samples from.  ``tp``: this
    process's rank in a tensor-parallel group (default: none), whose slice it builds;
    ``pp``: its pipeline stage (default: none), whose layers it builds.
    """

    supports_pp = True  # its layers split into pipeline stages (vLLM's SupportsPP)

    def __init__(
        self,
        config,
        attention_backend: str = "torch",
        tp: TensorParallelGroup = SINGLE,
        pp: PipelineStage = NO_PIPELINE,
    ) -> None:
        super().__init__()
        self.check_parallel(config, tp.size, tp.expert_parallel)
        self.config, self.tp, self.pp = config, tp, pp
        arch = self.arch_options(config)
        held = pp.layers(config.num_hidden_layers)
        layers = [
            self.make_layer(config, i, arch, attention_backend, tp)
            if i in held
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        ]
        self.model = LlamaModel(config, layers, tp, pp)
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size, tp) if pp.is_last else None
        )
        if config.tie_word_embeddings and pp.is_first and pp.is_last:
            # One parameter under two names, as in HF; checkpoints store it once.
            self.lm_head.weight = self.model.embed_tokens.weight
        elif config.tie_word_embeddings and pp.is_last:
            # The head's stage lacks the embedding: it reads the head from it (as vLLM).
            self.checkpoint_renames = {
                **getattr(self, "checkpoint_renames", {}),
                "model.embed_tokens.weight": "lm_head.weight",
            }

    def held_elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) not in self.model.stage_layers
        if name.startswith("model.embed_tokens."):
            return not self.pp.is_first
        return name.startswith(("model.norm.", "lm_head.")) and not self.pp.is_last

    @classmethod
    def check_parallel(cls, config, size: int, expert_parallel: bool = False) -> None:
        """Raise ``ValueError`` unless ``size`` ranks can split this family's ``config``
        (`check_tensor_parallel`); a dense model has no experts to split."""
        if expert_parallel:
            raise ValueError(
                f"enable_expert_parallel needs a mixture-of-experts model, and "
                f"{cls.__name__} has no experts"
            )
        check_tensor_parallel(config, size)

    @classmethod
    def make_layer(
        cls, config, layer_idx: int, arch: ArchOptions, attention_backend: str, tp
    ) -> nn.Module:
        """Decoder layer ``layer_idx``: Llama's attention and SwiGLU MLP (the
        mixture-of-experts families put experts in the MLP's place)."""
        return LlamaDecoderLayer(
            config,
            LlamaAttention(config, arch, attention_backend, tp),
            LlamaMLP(config, arch.mlp_bias, tp),
        )

    @classmethod
    def arch_options(cls, config) -> ArchOptions:
        """Llama's: biases where the config asks for them, no q/k norm."""
        bias = getattr(config, "attention_bias", False)
        return ArchOptions(
            qkv_bias=bias, o_bias=bias, mlp_bias=getattr(config, "mlp_bias", False), qk_norm=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the step's tokens, writing their K/V to ``kv_caches`` (one pair per layer
        of this stage); returns the final hidden state of every token (of a pipeline
        stage but the last: its output, for the next stage).  ``hidden``: the previous
        stage's output, on a pipeline stage but the first."""
        return self.model(input_ids, positions, kv_caches, attn, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden_size] -> [N, vocab_size]`` float32 (projected in the model dtype,
        as HF does, then widened for sampling); None on tensor-parallel ranks other
        than 0, which only contribute their slice of the vocabulary."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()


def check_tensor_parallel(
    config, size: int, split: tuple[str, ...] = ("intermediate_size",)
) -> None:
    """Raise ``ValueError`` unless ``size`` ranks can split ``config``'s model: the query
    heads and the ``split`` sizes (the MLP's intermediate size) evenly, and the KV heads
    evenly or (more ranks than KV heads) each one over a whole number of ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    kv = config.num_key_value_heads
    for what in ("num_attention_heads", *split):
        total = getattr(config, what)
        if total % size:
            raise ValueError(
                f"tensor_parallel_size={size} must divide the model's {what} ({total})"
            )
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size={size} must divide the model's "
            f"num_key_value_heads ({kv}) or be a multiple of it"
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers without biases; its sliding window is checked, not applied."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on q/k/v whatever the config says (HF hard-codes them), none on o."""

    @classmethod
    def arch_options(cls, config) -> ArchOptions:
        return replace(super().arch_options(config), qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: an RMSNorm over each query and key head before RoPE (``q_norm``, ``k_norm``)."""

    @classmethod
    def arch_options(cls, config) -> ArchOptions:
        return replace(super().arch_options(config), qk_norm=True)


# config.architectures[0] -> class, for the loader.
MODELS = {
    cls.__name__: cls
    for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
}

"""Attention over the paged KV cache, as a model layer sees it (paper §4.1, §4.3, §4.5).

One engine step runs one flat batch of tokens, with no batch dimension and no padding:
the new tokens of every scheduled sequence, packed one sequence after another.  Prefill
sequences (a whole prompt, a chunk of one, or the rest of a prompt after a prefix-cache
hit) come first, decode sequences (one new token each) last.  ``AttentionMetadata`` says
where each token's key and value go in the cache and which sequence each row belongs to;
``PagedAttention`` writes the new keys and values, then runs the prefill op on the first
part and the decode op on the rest.  ``AttentionMetadata.build`` derives all of it from
plain block tables, token counts and the KV cache manager's slot mapping, so neither
tests nor the engine repeat that logic.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass

import torch
from torch import nn

from minipaged.ops import BACKENDS, get_backend, kv_quant

__all__ = [
    "AttentionMetadata",
    "PagedAttention",
    "allocate_kv_caches",
    "bind_backends",
    "calculate_kv_scales_on_next_batch",
    "check_backend",
    "head_dim",
    "latent_dim",
    "token_positions",
]


@dataclass
class AttentionMetadata:
    """Where one step's tokens live in the paged KV cache, shared by every layer.

    Rows ``[0, num_prefill_tokens)`` of the step belong to the prefill sequences, packed
    in order; the remaining rows are decode sequences, one token each.  Index tensors
    are int32 on the model's device (``slot_mapping`` int64); the ``max_*`` fields are
    host ints, so that launching a kernel never waits for the device.
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each token's K/V; -1 skips the write
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor  # [P, W] physical block of each logical block
    prefill_query_start_loc: torch.Tensor  # [P + 1] row where each sequence's tokens start
    prefill_context_lens: torch.Tensor  # [P] cached prefix + new tokens, per sequence
    max_prefill_query_len: int  # most new tokens of any prefill sequence
    decode_block_tables: torch.Tensor  # [D, W]
    decode_context_lens: torch.Tensor  # [D] tokens in cache, the new one included
    max_decode_context_len: int

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_cached: list[int],
        num_new: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        slot_mapping: list[int],
        validate: bool = True,
    ) -> AttentionMetadata:
        """The metadata of a step that runs ``num_new[i]`` tokens of sequence ``i``,
        the ``num_cached[i]`` before them being in the cache already.

        ``slot_mapping`` is where the new tokens' keys and values go, packed in batch
        order: the slots the KV cache manager gave them (its `Allocation`s; the one
        place a slot is computed, §4.2).  The trailing run of sequences with one new
        token is the decode part; every other sequence is a prefill, which covers
        chunked prefill and prefix-cache hits (new tokens after a cached prefix).  Order
        the batch prefills first to send all decodes to the decode op.
        ``validate=False`` skips checking the sequences, for a caller whose lists are
        well formed by construction (the model runner's come from the scheduler; the
        check costs a tenth of preparing a step's inputs).
        """
        if validate:
            _check_sequences(block_tables, num_cached, num_new, block_size)
        split = len(num_new)
        while split > 0 and num_new[split - 1] == 1:
            split -= 1
        context_lens = [c + n for c, n in zip(num_cached, num_new)]
        if len(slot_mapping) != sum(num_new):
            raise ValueError(
                f"slot_mapping must have one slot per new token ({sum(num_new)}),"
                f" got {len(slot_mapping)}"
            )
        starts = [0, *itertools.accumulate(num_new[:split])]
        return cls(
            slot_mapping=int_tensor(slot_mapping, device, torch.long),
            num_prefill_tokens=starts[-1],
            prefill_block_tables=_pad(block_tables[:split], device),
            prefill_query_start_loc=int_tensor(starts, device),
            prefill_context_lens=int_tensor(context_lens[:split], device),
            max_prefill_query_len=max(num_new[:split], default=0),
            decode_block_tables=_pad(block_tables[split:], device),
            decode_context_lens=int_tensor(context_lens[split:], device),
            max_decode_context_len=max(context_lens[split:], default=0),
        )

    @classmethod
    def decode(
        cls,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
    ) -> AttentionMetadata:
        """The metadata of a step of decodes only, from its tensors as they are (the
        decode graphs' fixed buffers, `minipaged.worker.cuda_graphs`)."""
        none = context_lens[:0]
        return cls(
            slot_mapping=slot_mapping,
            num_prefill_tokens=0,
            prefill_block_tables=block_tables[:0],
            prefill_query_start_loc=none,
            prefill_context_lens=none,
            max_prefill_query_len=0,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            max_decode_context_len=max_context_len,
        )


def token_positions(
    num_cached: list[int], num_new: list[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The position of every new token of a step, packed in the order of
    ``AttentionMetadata.build``: sequence ``i`` contributes ``num_cached[i]`` onwards."""
    if min(num_new, default=1) == 1 == max(num_new, default=1):  # decodes only
        return int_tensor(num_cached, device, torch.long)
    return int_tensor(
        [p for c, n in zip(num_cached, num_new) for p in range(c, c + n)], device, torch.long
    )


def int_tensor(values: list[int], device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``torch.tensor(values)``, packed by ``struct``: ``torch.tensor`` walks a Python
    list at ~70 ns an element and ``array.array`` at ~30, a large share of a step's CPU
    time at hundreds of sequences; ``struct.pack`` takes ~10."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    code = "q" if dtype == torch.long else "i"
    buffer = bytearray(struct.pack(f"{len(values)}{code}", *values))
    return torch.frombuffer(buffer, dtype=dtype).to(device)


def _check_sequences(block_tables, num_cached, num_new, block_size):
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not len(block_tables) == len(num_cached) == len(num_new):
        raise ValueError(
            f"block_tables, num_cached and num_new must have one entry per "
            f"sequence, got lengths {len(block_tables)}, {len(num_cached)} and "
            f"{len(num_new)}"
        )
    for i, (table, cached, new) in enumerate(zip(block_tables, num_cached, num_new)):
        if new < 1 or cached < 0:
            raise ValueError(
                f"sequence {i} must have num_new >= 1 and num_cached >= 0, got "
                f"num_new[{i}] = {new}, num_cached[{i}] = {cached}"
            )
        if len(table) * block_size < cached + new:
            raise ValueError(
                f"block_tables[{i}] has {len(table)} blocks of {block_size} "
                f"slots, too few for its {cached + new} tokens"
            )


def _pad(tables: list[list[int]], device) -> torch.Tensor:
    # Entries past a sequence's last block are never read; 0 is as good as any block.
    width = max((len(t) for t in tables), default=1)
    flat = []
    for table in tables:
        flat += table
        flat += [0] * (width - len(table))
    return int_tensor(flat, device).view(len(tables), width)


class PagedAttention(nn.Module):
    """One layer's attention over the paged cache: store the new K/V, then attend.

    Calls the unchecked ops of ``get_backend(backend, device)`` directly: the metadata
    is built once per step and is well formed by construction, so the per-op checks of
    ``minipaged.ops`` would only cost host syncs in every layer.  A quantized cache
    comes with its layer's ``k_scale`` and ``v_scale`` (`allocate_kv_caches`); with
    ``calculate_kv_scales`` set, the first batch sets fp8's (vLLM's, `kv_quant`).
    """

    def __init__(self, scale: float, backend: str = "torch") -> None:
        super().__init__()
        _check_name(backend)
        self.scale, self.backend = scale, backend
        self.impl = None  # the backend's ops, resolved for the cache's device (`bind`)
        self.calculate_kv_scales = False

    def bind(self, device: torch.device):
        """Resolve this layer's backend for ``device`` (`get_backend` imports and checks
        it): once, since every step asks; torch.compile needs it resolved before it
        traces (`bind_backends`)."""
        self.impl = get_backend(self.backend, device)
        return self.impl

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """``query [T, num_heads, D]``, ``key, value [T, num_kv_heads, D]`` ->
        ``[T, num_heads, D]``; the new keys and values land in ``kv_cache`` first, so
        every token also sees itself and the tokens before it in the same step."""
        key_cache, value_cache, *scales = kv_cache
        if self.calculate_kv_scales:
            kv_quant.calculate_kv_scales(key, value, *scales)
            self.calculate_kv_scales = False
        impl = self.impl or self.bind(key_cache.device)
        impl.write_kv(key, value, key_cache, value_cache, attn.slot_mapping, *scales)
        n = attn.num_prefill_tokens
        prefill = decode = None
        if n > 0:
            prefill = impl.paged_attention_prefill(
                query[:n],
                key_cache,
                value_cache,
                attn.prefill_block_tables,
                attn.prefill_query_start_loc,
                attn.prefill_context_lens,
                self.scale,
                *scales,
                max_query_len=attn.max_prefill_query_len,
            )
        if n < query.shape[0]:
            decode = impl.paged_attention_decode(
                query[n:],
                key_cache,
                value_cache,
                attn.decode_block_tables,
                attn.decode_context_lens,
                self.scale,
                *scales,
                max_context_len=attn.max_decode_context_len,
            )
        if prefill is None:
            return torch.empty_like(query) if decode is None else decode
        # A step of one kind (every decode step) returns its op's output, uncopied.
        return prefill if decode is None else torch.cat((prefill, decode))

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4g}, backend={self.backend!r}"


def bind_backends(model: nn.Module, device: torch.device) -> None:
    """Resolve every attention layer's backend for ``device`` now (`PagedAttention.bind`)."""
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.bind(device)


def calculate_kv_scales_on_next_batch(model: nn.Module) -> None:
    """Have every attention layer of ``model`` set its fp8 ``k_scale, v_scale`` from
    the next batch it runs (vLLM's ``calculate_kv_scales``: its first real batch)."""
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.calculate_kv_scales = True


def check_backend(attention_backend: str, device: torch.device | str) -> None:
    """Raise now, not at the first step, if ``attention_backend`` cannot run on ``device``:
    ``ValueError`` for an unknown name, ``BackendUnavailableError`` for a missing one."""
    _check_name(attention_backend)
    get_backend(attention_backend, torch.device(device))


def _check_name(attention_backend):
    if attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")


def head_dim(config) -> int:
    """Per-head size: ``config.head_dim`` where given (Qwen3-0.6B's is not hidden_size /
    num_heads), else ``hidden_size // num_attention_heads``, as HF reads it."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def latent_dim(config) -> int | None:
    """Values a token caches per layer under multi-head latent attention (DeepSeek-V2:
    ``kv_lora_rank + qk_rope_head_dim``, whatever the head count), or None for a model
    that caches keys and values per KV head."""
    rank = getattr(config, "kv_lora_rank", None)
    return rank + config.qk_rope_head_dim if rank else None


def allocate_kv_caches(
    config_or_model,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, ...]]:
    """Zeroed ``(key_cache, value_cache)`` per layer, each ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` (the layout every backend uses); ``config_or_model`` is an
    HF config or a model with a ``.config``.  A quantized ``dtype`` (fp8, int8) adds the
    layer's ``k_scale, v_scale`` (`kv_quant.new_scales`).  A model with latent attention
    (`latent_dim`) gets ``(latent_cache,)`` per layer instead, ``[num_blocks,
    block_size, latent_dim]``, and fp8's one scale (`minipaged.ops.mla`)."""
    config = getattr(config_or_model, "config", config_or_model)
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if latent_dim(config):
        return _allocate_latent_caches(config, num_blocks, block_size, dtype, device)
    shape = (num_blocks, block_size, config.num_key_value_heads, head_dim(config))
    scales = kv_quant.is_quantized(dtype)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            *(kv_quant.new_scales(dtype, shape, device) if scales else ()),
        )
        for _ in range(config.num_hidden_layers)
    ]


def _allocate_latent_caches(config, num_blocks, block_size, dtype, device):
    if dtype == torch.int8:
        raise ValueError(
            "kv_cache_dtype='int8' keeps a scale per token and KV head, and a latent cache "
            "has no heads; use 'fp8' (one scale per layer) or 'auto'"
        )
    shape = (num_blocks, block_size, latent_dim(config))
    scale = kv_quant.is_quantized(dtype)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            *(kv_quant.new_scales(dtype, shape, device)[:1] if scale else ()),
        )
        for _ in range(config.num_hidden_layers)
    ]

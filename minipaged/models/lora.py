"""LoRA adapters on the Llama family: PEFT's files in, a LoRA term on every projection out.

A LoRA adapter (Hu et al. 2021) fine-tunes a frozen model by adding a low-rank term to
some of its linear layers: ``y = x W^T + s x A^T B^T``, ``A [r, in]``, ``B [out, r]``,
``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).  Here, as in vLLM, any of q, k, v,
o, gate, up and down may carry one, from a directory in PEFT's format
(``adapter_config.json``, ``adapter_model.safetensors``).

Serving many adapters (Punica, S-LoRA): each projection of the model is wrapped
(`ColumnParallelLinearWithLoRA`, `RowParallelLinearWithLoRA`) with room for
``max_loras`` adapters stacked in *slots*; a step's tokens each name their slot (-1:
the base model) and `minipaged.ops.punica` adds every token's term (SGMV).  Which
adapter sits in which slot is the scheduler's decision (`minipaged.core.memory.lora_slots`);
`LoRAModelManager` carries it out, reading adapters from disk into an LRU of
``max_cpu_loras`` in host memory first.

Two layouts make one LoRA of a merged projection: q, k and v's ``A`` are stacked by rows
(one shrink, to ``3 r``), their ``B`` block-diagonal (each part's output reads only its
own ``r`` columns); the same for gate and up.  ``s`` is folded into ``B`` on loading.
Under tensor parallelism (§4.6) each rank holds the slice its base layer holds: a
column-parallel layer its rows of ``B`` (``A`` whole), a row-parallel one its columns of
``A`` (``B`` whole), whose partial term joins the partial output before the all-reduce
(vLLM's ``ColumnParallelLinearWithLoRA`` and ``RowParallelLinearWithLoRA``).
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from minipaged.distributed.layers import ColumnParallelLinear, RowParallelLinear, linear
from minipaged.ops.punica import sgmv

__all__ = [
    "LORA_MODULES",
    "AdapterWeights",
    "ColumnParallelLinearWithLoRA",
    "LoRABatch",
    "LoRAModelManager",
    "RowParallelLinearWithLoRA",
    "read_adapter",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module name -> (the block holding it, our merged layer's name).
LORA_MODULES = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
# Settings of PEFT's LoRA that change what the weights mean: an adapter that sets one
# (to anything but the value here, where there is one) is refused rather than run wrongly.
_REFUSED = {
    "use_dora": None,
    "bias": "none",
    "modules_to_save": None,
    "fan_in_fan_out": None,
    "rank_pattern": None,
    "alpha_pattern": None,
}


@dataclass
class AdapterWeights:
    """One adapter, read from disk: per ``(layer, PEFT module)``, ``A [r, in]`` and
    ``B [out, r]`` with the scaling folded into ``B`` (float32, on the CPU)."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(path: str | Path, model_config, max_lora_rank: int) -> AdapterWeights:
    """Read a PEFT LoRA adapter for ``model_config``'s model; ``ValueError`` naming the
    file and what is wrong with it if it is missing, malformed, of a rank above
    ``max_lora_rank``, or not one minipaged can apply."""
    path = Path(path)
    config = _read_config(path / CONFIG_FILE, max_lora_rank)
    rank = config["r"]
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    file = path / WEIGHTS_FILE
    try:
        tensors = load_file(file)
    except (FileNotFoundError, SafetensorError, OSError) as error:
        raise ValueError(f"{file}: cannot read the adapter's weights ({error})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if not match or match[3] not in LORA_MODULES or LORA_MODULES[match[3]][0] != match[2]:
            raise ValueError(
                f"{file}: {key!r} is not a LoRA weight of q/k/v/o/gate/up/down_proj, "
                "the modules minipaged applies adapters to"
            )
        pairs.setdefault((int(match[1]), match[3]), {})[match[4]] = tensor
    if not pairs:
        raise ValueError(f"{file}: holds no LoRA weights")
    weights = {}
    for (layer, module), ab in pairs.items():
        a, b = ab.get("A"), ab.get("B")
        expected = lora_shapes(model_config, module, rank)
        if layer >= model_config.num_hidden_layers or a is None or b is None:
            raise ValueError(f"{file}: layer {layer}'s {module} needs lora_A and lora_B")
        if (tuple(a.shape), tuple(b.shape)) != expected:
            raise ValueError(
                f"{file}: layer {layer}'s {module} has lora_A {tuple(a.shape)}, lora_B "
                f"{tuple(b.shape)}; the model needs {expected[0]} and {expected[1]}"
            )
        weights[layer, module] = (a.float(), b.float() * scaling)
    return AdapterWeights(rank, weights)


def _read_config(file: Path, max_lora_rank: int) -> dict:
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: cannot read the adapter's config ({error})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: is not a LoRA adapter's config (peft_type 'LORA')")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_lora_rank:
        raise ValueError(
            f"{file}: r must be an int in [1, max_lora_rank={max_lora_rank}], got {rank!r}"
        )
    for name, served in _REFUSED.items():
        if config.get(name) and config[name] != served:  # absent, null, false, {}: unset
            raise ValueError(f"{file}: {name}={config[name]!r} is not supported by minipaged")
    return config


def lora_shapes(config, module: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of ``module``'s ``A`` and ``B`` in ``config``'s model at ``rank``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    in_out = {
        "q_proj": (hidden, config.num_attention_heads * head_dim),
        "k_proj": (hidden, config.num_key_value_heads * head_dim),
        "v_proj": (hidden, config.num_key_value_heads * head_dim),
        "o_proj": (config.num_attention_heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]
    return (rank, in_out[0]), (in_out[1], rank)


class LoRABatch:
    """Which adapter slot each token of the step uses, as SGMV's ``segments``:
    ``(slot, start, end)`` runs of tokens of one adapter.  Shared by every LoRA layer
    of a model; the model runner sets it each step.

    SGMV rather than BGMV: with at most ``max_loras`` adapters a step has at most twice
    as many segments (its prefills', its decodes'), while BGMV gathers an ``A`` and a
    ``B`` per token, which on a CPU costs more than the base matmul (``bench lora``)."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []

    def set(self, slots: list[int], counts: list[int]) -> None:
        """``slots[i]`` for the ``counts[i]`` tokens of the step's ``i``-th sequence."""
        self.segments, start = [], 0
        for slot, count in zip(slots, counts):
            last = self.segments[-1] if self.segments else None
            if slot >= 0 and last and last[0] == slot and last[2] == start:  # one run
                self.segments[-1] = (slot, last[1], start + count)
            elif slot >= 0:
                self.segments.append((slot, start, start + count))
            start += count

    def delta(self, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor):
        """The LoRA term of ``x`` (None when no token of the step has an adapter)."""
        return sgmv(x, lora_a, lora_b, self.segments) if self.segments else None


class _WithLoRA(nn.Module):
    """A base projection with ``num_slots`` adapters of rank up to ``rank`` per part."""

    def __init__(self, base: nn.Linear, parts: list[str], num_slots: int, rank: int, batch):
        super().__init__()
        self.base, self.batch, self.rank = base, batch, rank
        self.parts = parts  # PEFT's modules, in the order of the base layer's outputs
        total = rank * len(parts)
        dtype, device = base.weight.dtype, base.weight.device
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, total, base.in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(num_slots, base.out_features, total, dtype=dtype, device=device)
        )

    def clear(self, slot: int) -> None:
        self.lora_a[slot] = 0
        self.lora_b[slot] = 0


class ColumnParallelLinearWithLoRA(_WithLoRA):
    """A `ColumnParallelLinear` (q/k/v, gate/up) plus each token's adapter's term."""

    def __init__(self, base: ColumnParallelLinear, num_slots: int, rank: int, batch) -> None:
        super().__init__(base, list(base.parts), num_slots, rank, batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        delta = self.batch.delta(x, self.lora_a, self.lora_b)
        return out if delta is None else out + delta

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(list(self.base.parts.values()), dim=-1)

    def load(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part ``module``: ``A`` whole, this rank's rows of ``B``, in the part's block."""
        p = self.parts.index(module)
        (rows_here,), (rows_hf,) = self.base.load_targets("weight")[module]
        r = a.shape[0]
        cols = slice(p * self.rank, p * self.rank + r)
        self.lora_a[slot, cols] = a
        self.lora_b[slot, rows_here, cols] = b[rows_hf]


class RowParallelLinearWithLoRA(_WithLoRA):
    """A `RowParallelLinear` (o, down) plus each token's adapter's term, added to this
    rank's partial output before the ranks' sum (so the term is summed too)."""

    def __init__(self, base: RowParallelLinear, num_slots: int, rank: int, batch, module: str):
        super().__init__(base, [module], num_slots, rank, batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = linear(x, self.base)
        delta = self.batch.delta(x, self.lora_a, self.lora_b)
        return self.base.reduce(partial if delta is None else partial + delta)

    def load(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """This rank's columns of ``A``, ``B`` whole."""
        _, (_, cols) = self.base.load_targets("weight")[""]
        r = a.shape[0]
        self.lora_a[slot, :r] = a[:, cols]
        self.lora_b[slot, :, :r] = b


class LoRAModelManager:
    """A model's projections wrapped for ``max_loras`` adapter slots; adapters read
    from disk into an LRU of ``max_cpu_loras`` in host memory, and copied into the slot
    the scheduler names (vLLM's ``LoRAModelManager`` and ``WorkerLoRAManager``)."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        if not all(
            isinstance(getattr(layer.mlp, "gate_up_proj", None), ColumnParallelLinear)
            for layer in model.model.layers
        ):
            raise ValueError(
                f"enable_lora serves dense models; {type(model).__name__} has "
                "mixture-of-experts layers, whose experts take no adapter here"
            )
        self.model, self.max_lora_rank, self.max_cpu_loras = model, max_lora_rank, max_cpu_loras
        self.batch = LoRABatch()
        self.layers: list[dict[str, _WithLoRA]] = []  # per decoder layer: PEFT module -> wrapper
        for layer in model.model.layers:
            wrapped = {}
            for block_name, name, module in (
                ("self_attn", "qkv_proj", None),
                ("self_attn", "o_proj", "o_proj"),
                ("mlp", "gate_up_proj", None),
                ("mlp", "down_proj", "down_proj"),
            ):
                block = getattr(layer, block_name)
                base = getattr(block, name)
                if module is None:
                    wrapper = ColumnParallelLinearWithLoRA(
                        base, max_loras, max_lora_rank, self.batch
                    )
                else:
                    wrapper = RowParallelLinearWithLoRA(
                        base, max_loras, max_lora_rank, self.batch, module
                    )
                setattr(block, name, wrapper)
                wrapped.update(dict.fromkeys(wrapper.parts, wrapper))
            self.layers.append(wrapped)
        self.host: OrderedDict[object, AdapterWeights] = OrderedDict()  # LRU first
        self.num_disk_reads = 0

    def read(self, lora_request) -> AdapterWeights:
        """The adapter's weights from the host LRU, or from disk (evicting the least
        recently used beyond ``max_cpu_loras``)."""
        # Keyed by the whole request: an id given to another directory after its adapter
        # was removed is another adapter (the worker ranks never hear of the removal).
        if lora_request in self.host:
            self.host.move_to_end(lora_request)
            return self.host[lora_request]
        weights = read_adapter(lora_request.lora_path, self.model.config, self.max_lora_rank)
        self.num_disk_reads += 1
        self.host[lora_request] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    def forget(self, lora_request) -> None:
        """Drop an adapter from host memory (it was removed)."""
        self.host.pop(lora_request, None)

    @torch.no_grad()
    def activate(self, loads: list[tuple[int, object]]) -> None:
        """Copy each ``(slot, lora_request)``'s adapter into its slot, over what was there."""
        for slot, lora_request in loads:
            weights = self.read(lora_request)
            for wrapped in self.layers:
                for wrapper in set(wrapped.values()):
                    wrapper.clear(slot)
            for (layer, module), (a, b) in weights.weights.items():
                self.layers[layer][module].load(slot, module, a, b)

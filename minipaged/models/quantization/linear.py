"""Quantized projections: each linear layer of the decoder gets a ``quant_method`` (vLLM's
``LinearMethodBase``) that owns its weight from the checkpoint to the matmul.

1. ``create_weights``: the tensors the checkpoint holds for the layer, in the
   checkpoint's layout, as the layer's parameters (``qweight``, ``qzeros``, ``scales``,
   ``g_idx`` for GPTQ; the dense ``weight`` as it is for the online methods), with
   ``load_targets`` saying where each HF tensor goes (q/k/v into one merged layer);
2. the loader fills them (`minipaged.models.loader.load_weights`, shapes checked
   against the file's, naming the tensor);
3. ``process_weights_after_loading``: the checkpoint's form becomes the kernel's
   (`minipaged.ops.quant_linear`): unpacked and checked, or quantized online, then
   repacked for the device; the checkpoint's tensors are dropped;
4. ``apply``: the layer's forward (`minipaged.distributed.layers.linear`).

The embedding, the norms and the LM head stay in the model's dtype, as in vLLM's
defaults and in GPTQ and AWQ checkpoints.

The online INT8 method is named ``"int8"``.  vLLM runs the same scheme (int8 weights, a
scale per output channel, activations unquantized) under two names tied to where it
runs, ``experts_int8`` (MoE experts) and ``tpu_int8`` (TPU); the scheme without a
prefix is what a vLLM user types first.  ``bitsandbytes``, vLLM's other online 8-bit
path, is a different algorithm (LLM.int8()'s outlier columns), so its name would
mislead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.distributed.layers import ALL, ColumnParallelLinear, LoadTargets, RowParallelLinear
from minipaged.models.quantization import formats
from minipaged.models.quantization.config import QuantizationConfig
from minipaged.ops.quant_linear import CpuInt4Linear, CpuInt8Linear, IntWeight, reference

__all__ = [
    "QUANTIZED_LAYERS",
    "make_quant_method",
    "prepare_model",
    "process_model",
    "quantize_int8",
    "quantize_fp8",
    "weight_bytes",
]

QUANTIZED_LAYERS = (ColumnParallelLinear, RowParallelLinear)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize_int8(weight: torch.Tensor) -> IntWeight:
    """Symmetric INT8, one scale per output row: ``scale = max|w| / 127``."""
    scales = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    q = torch.round(weight.float() / scales).clamp(-128, 127).to(torch.int8)
    g_idx = torch.zeros(weight.shape[1], dtype=torch.int64, device=weight.device)
    return IntWeight(q, scales, None, g_idx, 8)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3, one scale per output row (``max|w|`` maps to E4M3's largest, 448):
    ``(weight [N, K] float8_e4m3fn, scales [N, 1] float32)``."""
    scales = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (weight.float() / scales).to(FP8), scales


class QuantMethod:
    """The online methods' base: the layer keeps its dense ``weight`` parameter for the
    loader, and `process` replaces it."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        layer.quant_prefix = prefix

    def load_targets(self, layer: nn.Module, kind: str) -> LoadTargets:
        return type(layer).load_targets(layer, kind)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = layer.weight.dtype
        self.process(layer, layer.weight.detach(), dtype)
        layer.weight = None  # the dense copy goes: that is the point
        layer.quant_dtype = dtype

    def process(self, layer, weight: torch.Tensor, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Fp8Method(QuantMethod):
    """Online FP8 (vLLM's ``fp8`` without a checkpoint scale): E4M3 weights, a scale per
    output channel.  Weight-only, as vLLM's Marlin fallback runs it where the hardware
    has no FP8 matmul (a CPU among them): each call widens the weight to the
    activations' dtype, then multiplies."""

    def process(self, layer, weight, dtype) -> None:
        fp8, scales = quantize_fp8(weight)
        layer.register_buffer("fp8_weight", fp8, persistent=False)
        layer.register_buffer("fp8_scales", scales.to(dtype), persistent=False)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.fp8_weight.to(x.dtype) * layer.fp8_scales, bias)


class IntMethod(QuantMethod):
    """The integer methods' forward: the CPU's packed op where the weight fits one, the
    Triton GEMM on a GPU, the reference (dequantize, then ``F.linear``) otherwise."""

    def process(self, layer, weight, dtype) -> None:
        self.set_kernel(layer, self.int_weight(layer, weight), dtype)

    def int_weight(self, layer, weight) -> IntWeight:
        raise NotImplementedError

    @staticmethod
    def set_kernel(layer, weight: IntWeight, dtype: torch.dtype) -> None:
        layer.int_weight, layer.kernel = weight, None
        if weight.q.device.type == "cpu":
            if weight.bits == 8 and weight.zeros is None and weight.scales.shape[1] == 1:
                layer.kernel = CpuInt8Linear(weight, dtype)
            elif CpuInt4Linear.supports(weight):
                layer.kernel = CpuInt4Linear(weight, dtype)
        elif weight.q.device.type == "cuda":
            from minipaged.ops import triton_quant

            layer.kernel = triton_quant.TritonQuantLinear(weight, dtype)
        if layer.kernel is not None:
            layer.int_weight = None  # the kernel's own form replaces it

    def apply(self, layer, x, bias):
        if layer.kernel is None:
            return reference(x, layer.int_weight, bias)
        return layer.kernel(x, bias)


class Int8Method(IntMethod):
    """Online INT8 weight-only, a scale per output channel (module docstring)."""

    def int_weight(self, layer, weight) -> IntWeight:
        return quantize_int8(weight)


class CheckpointMethod(IntMethod):
    """GPTQ's and AWQ's: the layer's dense weight is replaced, before loading, by the
    checkpoint's packed tensors (``TENSORS``: name -> which dimension is the output
    and how many values an element packs along it)."""

    TENSORS: dict[str, tuple[int | None, int]] = {}

    def create_weights(self, layer, prefix) -> None:
        super().create_weights(layer, prefix)
        n, k = layer.weight.shape
        self._check_divisible(layer, prefix, k)
        del layer.weight  # built dense by the model; never filled
        layer.quant_dtype = torch.get_default_dtype()
        for name, shape, dtype in self.shapes(layer, n, k):
            layer.register_parameter(
                name, nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            )

    def _check_divisible(self, layer, prefix, k: int) -> None:
        for part, rows in self._parts(layer).items():
            name = f"{prefix}.{part}" if part else prefix
            if rows % formats.PACK:
                raise ValueError(
                    f"{name} has {rows} output features; {self.config.method} packs "
                    f"{formats.PACK} to an int32, so it must divide them"
                )
        if k % formats.PACK:
            raise ValueError(f"{prefix} has {k} input features, not a multiple of {formats.PACK}")

    def groups(self, layer, k: int) -> int:
        """How many groups the checkpoint has for ``layer``: a row-parallel rank's
        ``k`` inputs are a slice of the tensor's, whose groups it loads whole."""
        size = self.config.group_size
        return 1 if size == -1 else -(-_full_inputs(layer, k) // size)

    @staticmethod
    def _parts(layer) -> dict[str, int]:
        return getattr(layer, "parts", {"": layer.out_features})

    def load_targets(self, layer, kind) -> LoadTargets:
        """Where each tensor's slice goes (the HF tensors are ``[in, out]``): a
        column-parallel layer's output columns of each part, as its dense weight's
        rows; a row-parallel layer's input rows, and every group's scales and zero
        points (``int_weight`` keeps the groups its rows use)."""
        if kind not in self.TENSORS:
            return type(layer).load_targets(layer, kind)
        out_dim, per = self.TENSORS[kind]
        if isinstance(layer, RowParallelLinear):
            return {"": self._row_target(layer, kind)}
        targets = {}
        dense = type(layer).load_targets(layer, "weight")  # each part's rows, ours and theirs
        for index, (part, ((ours,), (theirs,))) in enumerate(dense.items()):
            if out_dim is None:  # one row per part (g_idx), whole
                targets[part] = ((index,), ALL)
            else:
                lead = (slice(None),) * out_dim
                targets[part] = (lead + (_divided(ours, per),), lead + (_divided(theirs, per),))
        return targets

    def _row_target(self, layer, kind) -> tuple[tuple, tuple]:
        """This rank's input rows of ``kind`` (``ROW_PACK``: how many inputs a row of
        it packs; None: it is per group, and loaded whole)."""
        start, k = _first_input(layer), layer.in_features
        per = self.ROW_PACK[kind]
        if per is None:
            return ALL, ALL
        rows = slice(start // per, (start + k) // per)
        return ((0,), (rows,)) if kind == "g_idx" else (ALL, (rows, slice(None)))

    def process_weights_after_loading(self, layer) -> None:
        weight = self.int_weight(layer, None)
        for name in self.TENSORS:
            delattr(layer, name)
        self.check(layer, weight)
        self.set_kernel(layer, _used_groups(weight), layer.quant_dtype)

    def check(self, layer, weight: IntWeight) -> None:
        """Refuse values the config rules out (naming the tensor)."""
        groups = weight.scales.shape[1]
        if bool((weight.g_idx < 0).any() or (weight.g_idx >= groups).any()):
            raise ValueError(f"{layer.quant_prefix}.g_idx names groups outside [0, {groups})")


class GPTQMethod(CheckpointMethod):
    """GPTQ's checkpoint (`formats`): ``qweight [K/8, N]``, ``qzeros [G, N/8]``,
    ``scales [G, N]``, ``g_idx [K]`` (one per part of a merged layer: q/k/v must agree,
    as they do when one quantizer saw one input)."""

    TENSORS = {"qweight": (1, 1), "qzeros": (1, formats.PACK), "scales": (1, 1), "g_idx": (None, 1)}
    ROW_PACK = {"qweight": formats.PACK, "qzeros": None, "scales": None, "g_idx": 1}

    def shapes(self, layer, n, k):
        g, parts = self.groups(layer, k), len(self._parts(layer))
        return [
            ("qweight", (k // formats.PACK, n), torch.int32),
            ("qzeros", (g, n // formats.PACK), torch.int32),
            ("scales", (g, n), layer.quant_dtype),
            ("g_idx", (parts, k), torch.int32),
        ]

    def int_weight(self, layer, weight) -> IntWeight:
        g_idx = layer.g_idx
        for index, part in enumerate(self._parts(layer)):
            if not torch.equal(g_idx[index], g_idx[0]):
                raise ValueError(
                    f"{layer.quant_prefix}.{part}.g_idx differs from its first part's; "
                    "minipaged runs the merged projections as one matmul with one order"
                )
        return formats.unpack_gptq(layer.qweight, layer.qzeros, layer.scales, g_idx[0])

    def check(self, layer, weight) -> None:
        super().check(layer, weight)
        k, start = weight.shape[1], _first_input(layer)
        if not self.config.desc_act and self.config.group_size != -1:
            expected = (
                start + torch.arange(k, device=weight.g_idx.device)
            ) // self.config.group_size
            if not torch.equal(weight.g_idx, expected):
                raise ValueError(
                    f"{layer.quant_prefix}.g_idx is not k // group_size, and the config "
                    "has desc_act false"
                )


class AWQMethod(CheckpointMethod):
    """AWQ's GEMM checkpoint (`formats`): ``qweight [K, N/8]``, ``qzeros [G, N/8]``,
    ``scales [G, N]``; AWQ's groups divide the input evenly."""

    TENSORS = {"qweight": (1, formats.PACK), "qzeros": (1, formats.PACK), "scales": (1, 1)}
    ROW_PACK = {"qweight": 1, "qzeros": None, "scales": None}

    def _check_divisible(self, layer, prefix, k) -> None:
        super()._check_divisible(layer, prefix, k)
        k = _full_inputs(layer, k)
        if k % self.config.group_size:
            raise ValueError(
                f"{prefix} has {k} input features, which AWQ's group_size "
                f"{self.config.group_size} must divide"
            )

    def shapes(self, layer, n, k):
        g = self.groups(layer, k)
        return [
            ("qweight", (k, n // formats.PACK), torch.int32),
            ("qzeros", (g, n // formats.PACK), torch.int32),
            ("scales", (g, n), layer.quant_dtype),
        ]

    def int_weight(self, layer, weight) -> IntWeight:
        size = self.config.group_size
        weight = formats.unpack_awq(layer.qweight, layer.qzeros, layer.scales, size)
        columns = torch.arange(weight.shape[1], device=weight.q.device)
        weight.g_idx = (_first_input(layer) + columns) // size
        return weight


def _first_input(layer) -> int:
    """The first of the checkpoint tensor's input columns that ``layer`` holds (a
    row-parallel rank's slice starts at ``rank * in_features``)."""
    return layer.tp.rank * layer.in_features if isinstance(layer, RowParallelLinear) else 0


def _full_inputs(layer, k: int) -> int:
    """The checkpoint tensor's input columns, of which ``layer`` holds ``k``."""
    return k * layer.tp.size if isinstance(layer, RowParallelLinear) else k


def _divided(rows: slice, per: int) -> slice:
    """``rows`` of a dense weight as columns of a tensor packing ``per`` of them."""
    return slice(rows.start // per, rows.stop // per)


def _used_groups(weight: IntWeight) -> IntWeight:
    """``weight`` with only the groups its columns use (a row-parallel rank's slice
    loaded every group's scales), ``g_idx`` renumbered to them."""
    used = torch.unique(weight.g_idx)
    if len(used) == weight.scales.shape[1]:
        return weight
    zeros = None if weight.zeros is None else weight.zeros[:, used]
    g_idx = torch.searchsorted(used, weight.g_idx)
    return IntWeight(weight.q, weight.scales[:, used], zeros, g_idx, weight.bits)


METHODS = {"fp8": Fp8Method, "int8": Int8Method, "gptq": GPTQMethod, "awq": AWQMethod}


def make_quant_method(config: QuantizationConfig) -> QuantMethod:
    return METHODS[config.method](config)


def prepare_model(model: nn.Module, config: QuantizationConfig) -> int:
    """Give each projection of ``model``'s decoder (not the LM head) ``config``'s method
    and the parameters its checkpoint holds; returns how many."""
    method = make_quant_method(config)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QUANTIZED_LAYERS)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no projections {config.method} quantizes")
    for name, layer in layers:
        layer.quant_method = method
        method.create_weights(layer, name.rsplit(".", 1)[0] if hasattr(layer, "parts") else name)
    return len(layers)


@torch.no_grad()
def process_model(model: nn.Module) -> None:
    """Turn every prepared layer's loaded tensors into its kernel's form."""
    for layer in model.modules():
        if getattr(layer, "quant_method", None) is not None:
            layer.quant_method.process_weights_after_loading(layer)


def weight_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s weights as they run: parameters and buffers (a tied
    tensor once) and the quantized layers' kernel forms."""
    tensors = {t.data_ptr(): t.nbytes for t in (*model.parameters(), *model.buffers())}
    total = sum(tensors.values())
    for layer in model.modules():
        if getattr(layer, "kernel", None) is not None:
            total += layer.kernel.nbytes()
        elif getattr(layer, "int_weight", None) is not None:
            w = layer.int_weight
            total += sum(t.nbytes for t in (w.q, w.scales, w.g_idx) if t is not None)
            total += 0 if w.zeros is None else w.zeros.nbytes
    return total

"""Which quantization a model loads with: ``LLM(quantization=...)`` and the checkpoint's
``quantization_config``, checked against what minipaged runs.

- ``"fp8"`` and ``"int8"`` quantize a 16/32-bit checkpoint's projections *online*, as
  the weights load, with one scale per output channel;
- ``"awq"`` and ``"gptq"`` load a checkpoint already quantized in Hugging Face's
  format (`minipaged.models.quantization.formats`), which ``config.json`` says in its
  ``quantization_config``; with ``quantization`` None they are taken from there, as
  vLLM does.

Anything else the checkpoint asks for (another method, bit width, group size, packing
version, a quantized LM head, per-module overrides) is refused, naming the key: a
checkpoint loaded with the wrong rules would run, and produce noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipaged.config import QUANTIZATION_METHODS

__all__ = ["CHECKPOINT_METHODS", "ONLINE_METHODS", "QuantizationConfig", "resolve_quantization"]

ONLINE_METHODS = ("fp8", "int8")
CHECKPOINT_METHODS = ("awq", "gptq")
# The group sizes every kernel takes (-1: one group of the whole input, GPTQ's).
GROUP_SIZES = {"gptq": (-1, 32, 64, 128), "awq": (32, 64, 128)}


@dataclass(frozen=True)
class QuantizationConfig:
    """What the loader needs: the method, and for a checkpoint its bits, group size,
    whether GPTQ's act-order may reorder the groups (``desc_act``) and whether the zero
    points are all the middle value (``sym``)."""

    method: str
    bits: int = 8
    group_size: int = -1
    desc_act: bool = False
    sym: bool = True


def resolve_quantization(quantization: str | None, hf_config) -> QuantizationConfig | None:
    """The `QuantizationConfig` for ``LLM(quantization=...)`` and the checkpoint's
    ``hf_config``; None for a model that is not quantized."""
    found = getattr(hf_config, "quantization_config", None)
    if found is not None and not isinstance(found, dict):
        found = found.to_dict()
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_METHODS} or None, got {quantization!r}"
        )
    method = found and found.get("quant_method")
    if found is not None and method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"the checkpoint's quantization_config has quant_method {method!r}; minipaged "
            f"loads {CHECKPOINT_METHODS}"
        )
    quantization = quantization or method
    if quantization is None:
        return None
    if quantization in ONLINE_METHODS:
        if found is not None:
            raise ValueError(
                f"quantization={quantization!r} quantizes a 16/32-bit checkpoint as it loads, "
                f"and this checkpoint is already quantized ({method!r})"
            )
        return QuantizationConfig(quantization, bits=8)
    if found is None:
        raise ValueError(
            f"quantization={quantization!r} loads a checkpoint quantized with it, and "
            "config.json has no quantization_config"
        )
    if method != quantization:
        raise ValueError(
            f"quantization={quantization!r}, but the checkpoint is quantized with {method!r}"
        )
    return _checkpoint_config(method, found)


def _checkpoint_config(method: str, found: dict) -> QuantizationConfig:
    # AutoAWQ's own configs name two keys differently.
    bits = found.get("bits", found.get("w_bit"))
    group_size = found.get("group_size", found.get("q_group_size"))
    _require(bits == 4, "bits", bits, "4")
    _require(group_size in GROUP_SIZES[method], "group_size", group_size, GROUP_SIZES[method])
    if method == "gptq":
        fmt = found.get("checkpoint_format", "gptq")
        _require(fmt == "gptq", "checkpoint_format", fmt, "'gptq'")
        _require(not found.get("lm_head", False), "lm_head", found.get("lm_head"), "false")
        _require(not found.get("dynamic"), "dynamic", found.get("dynamic"), "none")
        return QuantizationConfig(
            method,
            bits=4,
            group_size=group_size,
            desc_act=bool(found.get("desc_act", False)),
            sym=bool(found.get("sym", True)),
        )
    version = str(found.get("version", "gemm")).lower()
    _require(version == "gemm", "version", version, "'gemm'")
    zero_point = found.get("zero_point", True)
    _require(zero_point is True, "zero_point", zero_point, "true")
    skipped = found.get("modules_to_not_convert")
    _require(not skipped, "modules_to_not_convert", skipped, "none")
    return QuantizationConfig(method, bits=4, group_size=group_size, sym=False)


def _require(ok: bool, key: str, value, expected) -> None:
    if not ok:
        raise ValueError(
            f"the checkpoint's quantization_config {key!r} is {value!r}; minipaged "
            f"supports {expected}"
        )

"""Quantized weights: FP8 and INT8 online, AWQ and GPTQ INT4 checkpoints
(`minipaged.models.quantization.config` says which), the projections' quantized
forward (`linear`), the checkpoint formats (`formats`) and the quantizers that write
them (`quantize`: RTN, GPTQ, AWQ)."""

from minipaged.models.quantization.config import QuantizationConfig, resolve_quantization
from minipaged.models.quantization.linear import prepare_model, process_model, weight_bytes

__all__ = [
    "QuantizationConfig",
    "prepare_model",
    "process_model",
    "resolve_quantization",
    "weight_bytes",
]

"""The settings `EngineConfig` leaves to the checkpoint and the machine.

``EngineConfig`` checks what it can alone; what ``"auto"`` or None mean depends on where
the engine runs (the device, the fastest attention backend there) and on the checkpoint
(how long a sequence may be, which tokens end one).  The engine resolves them here, once,
when it loads the model; the benchmarks that size a workload before building an engine
resolve them the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig

from minipaged.models.llama import sliding_window
from minipaged.ops import BackendUnavailableError, get_backend

__all__ = ["resolve_device", "resolve_backend", "resolve_max_model_len", "eos_token_ids"]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(device)


def resolve_backend(name: str, device: torch.device) -> str:
    """``"auto"``: the fastest backend that runs on ``device``: Triton on a GPU; on a CPU
    the C++ kernel where it builds (Triton would only be interpreted), else the torch
    reference."""
    if name != "auto":
        return name
    candidates = ("triton", "cuda", "torch") if device.type == "cuda" else ("cpu", "torch")
    for candidate in candidates:
        try:
            get_backend(candidate, device)
        except BackendUnavailableError:
            continue
        return candidate
    return "torch"


def resolve_max_model_len(max_model_len: int | None, config) -> int:
    """The longest sequence: the model's positions, or its sliding window (which
    minipaged does not implement), or less if asked."""
    limit = config.max_position_embeddings
    window = sliding_window(config)
    limit = min(limit, window) if window else limit
    if max_model_len is None:
        return limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the model's {limit} positions"
        )
    return max_model_len


def eos_token_ids(path: Path, config, tokenizer) -> set[int]:
    """The ids that end a sequence, where Hugging Face ``generate`` finds them:
    ``generation_config.json``, else ``config.json``, else the tokenizer."""
    eos = None
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}

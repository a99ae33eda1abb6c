"""Presets and workloads: what every benchmark that runs a model starts from.

A benchmark's *preset* (``--preset cpu`` or ``gpu``, its module's ``PRESETS``) fixes the
device, a synthetic model and the workload's size; each of its values can be
overridden by a flag (`with_overrides`).  The workload is ShareGPT-like: lengths drawn
for a 2048-token context (the paper's OPT models, `PAPER_CONTEXT`, §6.1), then
multiplied by ``length_scale * min(1, max_model_len / 2048)`` (rounded, at least 1
token), so a model with a shorter context keeps the distribution's shape and its
longest request still fits; ``length_scale`` < 1 shrinks the workload for a CPU run.
Prompts are random token ids of the drawn lengths (`make_prompts`).

torch is imported by the functions that use it, as in `common`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from minipaged.core.memory.workloads import RequestSpec, synthetic_requests

if TYPE_CHECKING:
    import torch

PAPER_CONTEXT = 2048  # the context ShareGPT lengths are drawn for (OPT's, paper §6.1)

# The gpu preset's synthetic model when no --model is given: Llama-3.2-1B's shape
# (16 layers, hidden 2048, GQA 32/8 heads of 64, 32 KB of KV per token) without its
# 128k vocabulary, about 1B parameters, run in bfloat16.  At 256 sequences of ShareGPT
# length a decode step reads gigabytes of KV, so the attention kernels matter as they
# do in the paper; it is written once (4 GB of float32) to the cache.
GPU_MODEL = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)


# -- presets ------------------------------------------------------------------------
def default_preset() -> str:
    """``"gpu"`` where torch sees a CUDA GPU, else ``"cpu"``."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def preset_device(preset: str, presets: dict, device: str = "auto") -> torch.device:
    """``device`` unless ``"auto"``, else that of ``preset`` (of ``presets``, the
    benchmark's own), checked to exist."""
    import torch

    if preset not in presets:
        raise ValueError(f"preset must be one of {list(presets)}, got {preset!r}")
    device = torch.device(presets[preset].device if device == "auto" else device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"preset {preset!r} needs a CUDA GPU, and torch sees none "
            "(pass --device cpu or --preset cpu)"
        )
    return device


def with_overrides(preset, names: Sequence[str], overrides: Mapping) -> dict:
    """The values of ``preset``'s fields ``names``, each replaced by ``overrides[name]``
    unless that is missing or None: a flag left out takes the preset's value."""
    return {
        name: getattr(preset, name) if overrides.get(name) is None else overrides[name]
        for name in names
    }


def preset_model(preset: str, presets: dict) -> Path:
    """The synthetic checkpoint of ``preset`` (of ``presets``), written to the cache on
    first use; presets of the same name in other benchmarks share it."""
    from minipaged.models.tiny import cached_checkpoint

    return cached_checkpoint(f"bench-{preset}", **presets[preset].model)


# -- the workload ---------------------------------------------------------------------
def length_factor(length_scale: float, max_model_len: int) -> float:
    """What the drawn ShareGPT lengths are multiplied by (see the module docstring)."""
    return length_scale * min(1.0, max_model_len / PAPER_CONTEXT)


def make_requests(
    num_requests: int, max_model_len: int, length_scale: float = 1.0, seed: int = 0
) -> list[RequestSpec]:
    """ShareGPT-like lengths scaled to fit ``max_model_len`` (see the module docstring)."""
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    scale = length_factor(length_scale, max_model_len)
    requests = []
    for r in synthetic_requests("sharegpt", num_requests, seed=seed, max_len=PAPER_CONTEXT):
        prompt = min(max(1, round(r.prompt_len * scale)), max_model_len - 1)
        output = min(max(1, round(r.output_len * scale)), max_model_len - prompt)
        requests.append(RequestSpec(prompt, output))
    return requests


@dataclass
class Workload:
    config: object  # the checkpoint's HF config
    requests: list[RequestSpec]
    prompts: list[list[int]]
    max_model_len: int
    scale: float  # what the drawn ShareGPT lengths were multiplied by


def make_workload(
    path,
    num_requests: int,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    seed: int = 0,
) -> Workload:
    """The requests and their prompt token ids for the checkpoint at ``path`` (a
    directory, a ``.gguf`` file or a model name such as ``smollm2``: `resolve_model`)."""
    from transformers import AutoTokenizer

    from minipaged.models.hub import resolve_model
    from minipaged.models.loader import read_config
    from minipaged.models.resolve import resolve_max_model_len

    path = resolve_model(path)
    config = read_config(path)
    max_model_len = resolve_max_model_len(max_model_len, config)
    requests = make_requests(num_requests, max_model_len, length_scale, seed)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Workload(
        config,
        requests,
        make_prompts(requests, tokenizer, config.vocab_size, seed),
        max_model_len,
        length_factor(length_scale, max_model_len),
    )


def model_dtype(config, dtype: str = "auto") -> str:
    """The dtype both minipaged and HF run the checkpoint in, e.g. ``"bfloat16"``."""
    from minipaged.models.loader import resolve_dtype

    return str(resolve_dtype(dtype, config)).removeprefix("torch.")


def make_prompts(
    requests: Sequence[RequestSpec], tokenizer, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Random prompts of the requested lengths, from the tokenizer's ordinary tokens
    (no special tokens, no padding rows of the embedding)."""
    special = set(tokenizer.all_special_ids)
    usable = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(usable, k=r.prompt_len) for r in requests]

"""Load a Hugging Face checkpoint from a local directory into a minipaged model.

A checkpoint is a directory as the Hub serves it: ``config.json`` (read with
transformers' ``AutoConfig``, never touching the network) and the weights in
``model.safetensors``, or sharded over several files that
``model.safetensors.index.json`` lists.  ``config.architectures`` picks the class.
Every tensor is matched by its HF name; a weight the model needs and the checkpoint
lacks, or one the checkpoint has and the model would not use, is an error rather than
a silent random init or a silently ignored tensor.

Under tensor parallelism (paper §4.6) each rank builds its slice of the model and reads
only its slice of each tensor from the files (safetensors reads a slice without the
rest); each parallel layer says which slice (``load_targets``).  Under pipeline
parallelism each stage reads the tensors of its own layers only (``held_elsewhere``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from minipaged.distributed.parallel_state import (
    NO_PIPELINE,
    SINGLE,
    PipelineStage,
    TensorParallelGroup,
)
from minipaged.models import deepseek_v2, llama, llava, moe_models, qwen2_vl
from minipaged.models.attention import check_backend
from minipaged.models.cpu_linear import pack_linear_weights
from minipaged.models.quantization import prepare_model, process_model, resolve_quantization

__all__ = [
    "DTYPES",
    "load_model",
    "read_config",
    "resolve_dtype",
    "checkpoint_files",
    "load_weights",
]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors some real checkpoints carry that no model needs: RoPE frequencies saved by old
# Llama conversions (they are computed, not learned; vLLM skips them too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.architectures[0] -> class.
MODELS = {
    **llama.MODELS,
    **moe_models.MODELS,
    **deepseek_v2.MODELS,
    **llava.MODELS,
    **qwen2_vl.MODELS,
}


def load_model(
    path,
    dtype="auto",
    device="cpu",
    attention_backend: str = "torch",
    tp: TensorParallelGroup = SINGLE,
    pp: PipelineStage = NO_PIPELINE,
    pack_weights: bool = True,
    quantization: str | None = None,
):
    """The model in directory ``path``, its weights loaded, in eval mode, no grads.

    ``dtype`` is ``"auto"`` (the config's ``dtype``), a name in :data:`DTYPES` or one
    of those torch dtypes.  ``attention_backend`` is checked against ``device`` before
    anything is built.  ``tp``: build and load this rank's slice only; ``pp``: this
    pipeline stage's layers only.  On a CPU the projections' weights are then packed
    for oneDNN (`cpu_linear`) unless ``pack_weights`` is False, which keeps
    ``F.linear``.  ``quantization``: `EngineConfig.quantization` (None: the
    checkpoint's, if any), whose projections `minipaged.models.quantization` sets up
    before the weights load and converts after.  The model's HF config is
    ``model.config``.
    """
    path = Path(path)
    config = read_config(path)
    cls = model_class(config)
    dtype = resolve_dtype(dtype, config)
    check_backend(attention_backend, device)
    files = checkpoint_files(path)
    quant_config = resolve_quantization(quantization, config)
    with _default_dtype(dtype), torch.device(device):
        model = cls(config, attention_backend=attention_backend, tp=tp, pp=pp)
        if quant_config is not None:
            prepare_model(model, quant_config)
    load_weights(model, files)
    if quant_config is not None:
        process_model(model)
    if pack_weights:
        pack_linear_weights(model)
    return model.requires_grad_(False).eval()


def read_config(path: Path):
    """The HF config in ``path/config.json``; a local directory only, never the Hub."""
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} has no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def model_class(config):
    """The minipaged class for ``config.architectures[0]``."""
    architectures = getattr(config, "architectures", None) or []
    if not architectures or architectures[0] not in MODELS:
        raise ValueError(
            f"config.architectures must name one of {sorted(MODELS)}, got {architectures}"
        )
    return MODELS[architectures[0]]


def resolve_dtype(dtype, config) -> torch.dtype:
    """``dtype`` as a torch dtype; ``"auto"`` takes the config's (float32 if it has none)."""
    if isinstance(dtype, str) and dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES.values():
        raise ValueError(
            f"dtype must be 'auto', one of {sorted(DTYPES)} or the torch dtype "
            f"of one, got {dtype!r}"
        )
    return dtype


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint in ``path``: the shards the index names,
    else the single file."""
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"model path {str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_weights(model, files: list[Path]) -> None:
    """Copy every tensor of ``files`` into ``model``, by HF name.

    Names and shapes are all checked, from the files' headers, before any data is read:
    missing or unexpected weights raise ``ValueError`` listing them, so does a shape
    that does not fit (under tensor parallelism: the model's slice against the file's).
    A model's ``checkpoint_renames`` (old -> new substrings) map the files' names to
    the HF names it uses.
    """
    targets = _targets(model)
    shapes = {}  # by the model's name for each tensor
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[_renamed(model, name)] = tuple(f.get_slice(name).get_shape())
    _check_names(model, targets.keys(), shapes.keys())
    for name, target in targets.items():
        if target is None:  # another rank's (an expert it holds)
            continue
        param, ours, theirs = target
        full = torch.empty(shapes[name], device="meta")
        if full[theirs].shape != param[ours].shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {shapes[name]}, the "
                f"model expects {tuple(param[ours].shape)}"
                + (f" (of {theirs})" if theirs != (slice(None),) else "")
            )
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if (target := targets.get(_renamed(model, name))) is None:
                        continue
                    param, ours, theirs = target
                    # Reads only the slice; copy_ casts to the model's dtype and device.
                    param[ours].copy_(f.get_slice(name)[theirs])


def _renamed(model, name: str) -> str:
    for old, new in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(old, new)
    return name


def _targets(model) -> dict[str, tuple[torch.Tensor, tuple, tuple] | None]:
    """HF tensor name -> (parameter, the index of it that tensor fills, the index of
    the tensor this rank reads), or None for a tensor this rank does not read at all."""
    targets = {}
    # named_parameters() lists a tied parameter once, under its first name (the embedding).
    for name, param in model.named_parameters():
        module_name, kind = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if not hasattr(module, "load_targets"):  # replicated: every rank reads it whole
            targets[name] = (param, (slice(None),), (slice(None),))
            continue
        parent = module_name.rsplit(".", 1)[0]
        method = getattr(module, "quant_method", None)  # it knows its tensors' layout
        parts = method.load_targets(module, kind) if method else module.load_targets(kind)
        for part, target in parts.items():
            targets[f"{parent}.{part}.{kind}" if part else name] = target and (param, *target)
    return targets


def _check_names(model, expected, found) -> None:
    tied = model.config.tie_word_embeddings
    unexpected = sorted(
        name
        for name in found - expected
        if not name.endswith(IGNORED_SUFFIXES)
        # Some tied checkpoints store a copy of the head too.  The config
        # says tied, so (like vLLM) the copy is ignored; transformers 5
        # would untie the two if they differed.
        and not (tied and name == "lm_head.weight")
        and not model.held_elsewhere(name)
    )
    missing = sorted(expected - found)
    kind = type(model).__name__
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} weights {kind} needs: {_sample(missing)}"
        )
    if unexpected:
        raise ValueError(
            f"the checkpoint has {len(unexpected)} weights {kind} does not "
            f"use: {_sample(unexpected)}"
        )


def _sample(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters directly in ``dtype`` (as vLLM does): no float32 copy first.
    RoPE frequencies ask for float32 explicitly, so they stay exact."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

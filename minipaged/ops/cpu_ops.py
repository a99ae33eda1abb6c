"""The CPU backend: PagedAttention as a C++ kernel, reading the cache in place (§4.1).

The torch reference backend gathers each sequence's keys and values into a dense copy
before it attends; on a CPU that copy, and reading it again, is most of the attention
time.  ``kernels/cpu/paged_attention.cpp`` instead walks each sequence's block table and
reads every key and value once, where it lies, in the cache's own dtype (bf16, fp16,
fp8 and int8 widened to float32 in registers): one task per KV head, tile of query rows
and partition of a long context, the GQA group's query heads together.  It is built on
first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) for the best
instruction set the CPU has (`ISA_FLAGS`: AVX-512, AVX2, or plain C++), and cached like
the CUDA kernels (`cuda_build.cached_build_dir`), one build per instruction set.

Decode and prefill are the same kernel: each sequence's query rows are its last
positions.  ``write_kv`` copies each token's keys and values to its slot in C++ too
(vLLM's ``reshape_and_cache``), quantizing them for an fp8 or int8 cache (`kv_quant`'s
rules).  Arguments are checked in ``minipaged.ops``; these functions assume well-formed
input.  Every op is registered with torch's dispatcher, with a shape-only version for
torch.compile (`register_fakes`), as vLLM's C++ ops are.

The same build compiles ``kernels/cpu/fused_ops.cpp``, the small ops around a layer's
projections fused as vLLM's CPU backend has them (`rms_norm`, `fused_add_rms_norm`,
`silu_and_mul`, `rotary_embedding`), which `minipaged.ops.fused` runs for a model on the
CPU.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from minipaged.ops import cuda_build, kv_quant

__all__ = [
    "ISA_ENV",
    "available",
    "check_available",
    "fused_add_rms_norm",
    "isa",
    "machine_isas",
    "mark_constant_for_compile",
    "mla_decode",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]

SOURCE = cuda_build.KERNELS_DIR / "cpu" / "paged_attention.cpp"
# The kernel's inner loop as one scalar function (lesson 07's exercise), declared here
# and defined in attend_tile.cpp or the learner's file (`build_with_attend_tile`).
ATTEND_TILE_HEADER = SOURCE.parent / "attend_tile.h"
# One extension: paged_attention.cpp holds its Python module, fused_ops.cpp and
# mla_decode.cpp register their ops with torch's dispatcher under the extension's name.
SOURCES = [
    SOURCE,
    cuda_build.KERNELS_DIR / "cpu" / "fused_ops.cpp",
    cuda_build.KERNELS_DIR / "cpu" / "mla_decode.cpp",
]
# The instruction sets the kernel is built for, best first, with their compiler flags:
# AVX-512's 16 floats an instruction, AVX2's 8 (both with fused multiply-adds and F16C's
# half-precision conversions), or the compiler's default (one float at a time).
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
# The kernels split their work with at::parallel_for, OpenMP code inlined from ATen's
# headers: compiled without -fopenmp it runs on the calling thread alone.  Linked with
# -fopenmp, the extension asks for libgomp.so.1, which the process has already loaded
# from torch's own lib folder, so its threads are torch's (torch.set_num_threads).
OPENMP_FLAGS = (
    ("-fopenmp",) if sys.platform == "linux" and torch.backends.openmp.is_available() else ()
)
# Set to one of ISA_FLAGS to build and run that one instead of the machine's best (the
# tests run every one the CPU can).
ISA_ENV = "MINIPAGED_CPU_ISA"


def compile_flags(name: str, *defines: str) -> list[str]:
    """The compiler flags of a build for instruction set ``name``, with ``defines``."""
    return ["-O3", *defines, *ISA_FLAGS[name], *OPENMP_FLAGS]


def check_available(device: torch.device) -> None:
    """Raise ``RuntimeError`` saying why the C++ kernel cannot run on ``device``; the
    first call on a CPU builds it (about half a minute, then cached on disk)."""
    if device.type != "cpu":
        raise RuntimeError(f"the 'cpu' attention backend runs on the CPU, not {device.type}")
    reason = _unavailable()
    if reason:
        raise RuntimeError(reason)


def available() -> bool:
    """Whether the C++ extension runs here (built on the first call, as
    `check_available`)."""
    return _unavailable() is None


@functools.cache  # asked once per layer per step: the answer does not change
def _unavailable() -> str | None:
    for source in SOURCES:
        if not source.is_file():
            return (
                f"the 'cpu' attention backend compiles {source}, which is not there: install "
                "minipaged from a source checkout (pip install -e .)"
            )
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "the 'cpu' attention backend builds its kernel with ninja: pip install ninja"
    if not cuda_build.has_cxx():
        return "the 'cpu' attention backend needs a C++ compiler (c++ on PATH, or CXX)"
    try:
        _kernel()
    except (RuntimeError, OSError) as error:
        return f"the 'cpu' attention backend's kernel did not build: {error}"
    return None


@functools.cache  # torch reads the CPU's flags once; asked by every kernel call
def machine_isas() -> tuple[str, ...]:
    """The instruction sets of `ISA_FLAGS` this CPU runs, best first, as torch detects
    its flags (the capability its own kernels dispatch on)."""
    capability = torch.backends.cpu.get_cpu_capability()
    best = {"AVX512": 0, "AVX2": 1}.get(capability, 2)
    return tuple(ISA_FLAGS)[best:]


def isa() -> str:
    """The instruction set the kernel runs with: ``MINIPAGED_CPU_ISA`` if set, else the
    machine's best."""
    chosen = os.environ.get(ISA_ENV)
    if chosen is None:
        return machine_isas()[0]
    if chosen not in machine_isas():
        raise RuntimeError(
            f"{ISA_ENV}={chosen!r}: this CPU runs the kernel built for one of {machine_isas()}"
        )
    return chosen


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    """Store the new keys and values at their slots (slot -1: skip), one pass in C++:
    copied into a cache of the model's dtype, quantized by `kv_quant`'s rules into fp8
    or int8."""
    if not kv_quant.is_quantized(key_cache.dtype):
        _ops().write_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    _ops().write_kv_quantized(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    k_scale=None,
    v_scale=None,
    max_context_len=None,
):
    """One new token per sequence attends to its ``context_lens[b]`` cached tokens."""
    return _ops().paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables.int(),
        None,
        context_lens.int(),
        scale,
        *kv_quant.kernel_scales(key_cache, k_scale, v_scale),
    )


def mla_decode(query, cache, block_tables, context_lens, rank, scale, kv_scale=None):
    """Absorbed MLA decode (`minipaged.ops.mla`): ``query [B, H, rank + rope]`` over the
    latent ``cache`` -> each head's weighted ``c_kv`` ``[B, H, rank]`` in float32, every
    latent row read once for a task's heads (``kernels/cpu/mla_decode.cpp``)."""
    return _ops().mla_decode(
        query, cache, block_tables.int(), context_lens.int(), rank, scale, kv_scale
    )


def paged_attention_prefill(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale,
    k_scale=None,
    v_scale=None,
    max_query_len=None,
):
    """Sequence ``b``'s new tokens are rows ``query_start_loc[b]:query_start_loc[b+1]``,
    its last ``n_new`` positions: new token ``j`` sees ``context_lens[b] - n_new + j + 1``
    of them (the cached prefix, the new tokens before it, itself)."""
    return _ops().paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables.int(),
        query_start_loc.int(),
        context_lens.int(),
        scale,
        *kv_quant.kernel_scales(key_cache, k_scale, v_scale),
    )


def rms_norm(x, weight, eps):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, a new tensor."""
    return _ops().rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """``residual += x``, then ``x = rms_norm(residual)``, in place (on contiguous
    copies if they are not); returns ``(x, residual)``."""
    x, residual = x.contiguous(), residual.contiguous()
    _ops().fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def silu_and_mul(gate_up):
    """``silu(gate) * up`` of ``gate_up [..., 2 * d]``, a new ``[..., d]``."""
    return _ops().silu_and_mul(gate_up)


def rotary_embedding(query, key, cos, sin):
    """Rotate ``query [T, heads, head_dim]`` and ``key [T, kv_heads, head_dim]`` in place
    by ``cos, sin [T, head_dim / 2]``; returns them."""
    _ops().rotary_embedding(query, key, cos, sin)
    return query, key


def _kernel():
    # `build` caches each instruction set's module: `MINIPAGED_CPU_ISA` set later (as the
    # tests do, one ISA after another) takes effect at the next call.
    return build(isa())


def _ops():
    """The ops of `_kernel`'s build (torch.ops under the extension's name)."""
    return getattr(torch.ops, _namespace())


def _namespace() -> str:
    return _kernel().name


def mark_constant_for_compile() -> None:
    """Tell torch.compile that `available` and `_namespace` answer the same every time,
    so a trace asks each once.  Marked here, before a compile, not where they are
    defined: the mark imports TorchDynamo, a second or two of every process's start,
    and only a compiled engine needs it (the mark is set on the functions themselves,
    so every caller sees it)."""
    for fn in (available, _namespace):
        torch.compiler.assume_constant_result(fn)


def register_fakes(namespace: str) -> None:
    """Tell torch the shape of each op's output without running it (its "fake"
    kernel), so that torch.compile traces a model through them on shape-only tensors
    and keeps each one as a single call in its graph (vLLM registers its C++ ops so).
    The ops that write in place return nothing: their schemas say what they write."""
    fakes = {
        "paged_attention": lambda query, *rest: torch.empty_like(query),
        "write_kv": lambda *args: None,
        "write_kv_quantized": lambda *args: None,
        "rms_norm": lambda x, weight, eps: torch.empty_like(x),
        "fused_add_rms_norm": lambda *args: None,
        "silu_and_mul": lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // 2),
        "rotary_embedding": lambda *args: None,
        "mla_decode": lambda query, cache, tables, lens, rank, scale, kv_scale: query.new_empty(
            *query.shape[:2], rank, dtype=torch.float32
        ),
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"{namespace}::{name}")(fake)


@functools.cache
def build(name: str):
    """The kernel built for instruction set ``name`` of `ISA_FLAGS` (compiled on the
    first call, then cached on disk under a name that includes the instruction set, so
    a cache shared with another CPU never loads it there): its ops, registered with
    torch's dispatcher, as the ``torch.ops`` namespace of the build's name.  The build
    is a plain shared library, not a Python module: no pybind11 to compile."""
    from torch.utils import cpp_extension

    module = f"minipaged_cpu_{name}"
    flags = compile_flags(name)
    build_dir = cuda_build.cached_build_dir(module, SOURCES, flags)
    if not (build_dir / f"{module}.so").exists():
        print(
            f"minipaged: compiling the CPU attention kernel for {name} (once; cached in "
            f"{build_dir})",
            file=sys.stderr,
        )
    with cuda_build.build_lock(build_dir):
        cpp_extension.load(
            module,
            [str(source) for source in SOURCES],
            build_directory=str(build_dir),
            extra_cflags=flags,
            extra_ldflags=[*OPENMP_FLAGS],  # a list of its own: load() appends to it
            is_python_module=False,
        )
    register_fakes(module)
    return getattr(torch.ops, module)


def build_with_attend_tile(path: Path):
    """The kernel with its inner loop done by ``attend_tile`` of the C++ file ``path``
    (``kernels/cpu/attend_tile.cpp``, or lesson 07's ``exercises/cpu_attend_tile.cpp``),
    one query row and one position at a time, in place of the vectorized passes.

    Built with ``-DMINIPAGED_ATTEND_TILE`` (the only build that sets it) under a name
    and folder of its own, so the package's build is never touched.  ``path`` is a
    translation unit of its own, over c10's headers alone: after the first build, which
    compiles the kernel, a changed ``path`` alone is compiled again, in seconds.  Raises
    ``RuntimeError`` with the compiler's output if it does not build."""
    from torch.utils import cpp_extension

    name = f"minipaged_cpu_attend_tile_{isa()}"
    flags = compile_flags(isa(), "-DMINIPAGED_ATTEND_TILE")
    build_dir = cuda_build.cached_build_dir(name, [SOURCE, ATTEND_TILE_HEADER], flags)
    unit = build_dir / "attend_tile_instances.cpp"
    # The learner's file, then its function for each cache dtype the kernel reads.
    dtypes = ("float", "double", "c10::Half", "c10::BFloat16")
    lines = [f'#include "{path.resolve()}"', *(f"ATTEND_TILE_INSTANCE({t})" for t in dtypes)]
    code = "\n".join(lines) + "\n"
    with cuda_build.build_lock(build_dir):
        if not unit.exists() or unit.read_text() != code:  # unchanged: ninja keeps the .o
            unit.write_text(code)
        cpp_extension.load(
            name,
            [str(SOURCE), str(unit)],
            build_directory=str(build_dir),
            extra_cflags=flags,
            extra_ldflags=[*OPENMP_FLAGS],  # a list of its own: load() appends to it
            extra_include_paths=[str(SOURCE.parent)],
            is_python_module=False,
        )
    return getattr(torch.ops, name)

"""The CPU backend: PagedAttention as a C++ kernel, reading the cache in place (§4.1).

The torch reference backend gathers each sequence's keys and values into a dense copy
before it attends; on a CPU that copy, and reading it again, is most of the attention
time.  ``kernels/cpu/paged_attention.cpp`` instead walks each sequence's block table and
reads every key and value once, where it lies: one task per (query row, KV head), the
GQA group's query heads together.  It is built on first use with
``torch.utils.cpp_extension`` (a C++ compiler and ninja), and cached like the CUDA
kernels (`cuda_build.cached_build_dir`).

Decode and prefill are the same kernel: each query row names its sequence's block
table and how many of its positions it sees.  ``write_kv`` is the torch backend's
(one ``index_copy_`` per tensor, already in place; it quantizes for an fp8 or int8
cache, which the kernel widens back element by element, `kv_quant`).  Arguments are checked in
``minipaged.ops``; these functions assume well-formed input.
"""

from __future__ import annotations

import functools
import sys

import torch

from minipaged.ops import cuda_build, kv_quant
from minipaged.ops.torch_ref import write_kv

__all__ = ["check_available", "paged_attention_decode", "paged_attention_prefill", "write_kv"]

SOURCE = cuda_build.KERNELS_DIR / "cpu" / "paged_attention.cpp"


def check_available(device: torch.device) -> None:
    """Raise ``RuntimeError`` saying why the C++ kernel cannot run on ``device``; the
    first call on a CPU builds it (about half a minute, then cached on disk)."""
    if device.type != "cpu":
        raise RuntimeError(f"the 'cpu' attention backend runs on the CPU, not {device.type}")
    reason = _unavailable()
    if reason:
        raise RuntimeError(reason)


@functools.cache  # asked once per layer per step: the answer does not change
def _unavailable() -> str | None:
    if not SOURCE.is_file():
        return (
            f"the 'cpu' attention backend compiles {SOURCE}, which is not there: install "
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
    rows = torch.arange(query.shape[0], dtype=torch.int32)
    return _kernel().paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables.int(),
        rows,
        context_lens.int(),
        scale,
        *kv_quant.kernel_scales(key_cache, k_scale, v_scale),
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
    num_new = query_start_loc.diff()
    seq = torch.repeat_interleave(torch.arange(len(num_new), dtype=torch.int32), num_new)
    j = torch.arange(query.shape[0]) - query_start_loc[:-1].repeat_interleave(num_new)
    visible = (context_lens - num_new)[seq] + j + 1
    return _kernel().paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables.int(),
        seq,
        visible.int(),
        scale,
        *kv_quant.kernel_scales(key_cache, k_scale, v_scale),
    )


@functools.cache
def _kernel():
    from torch.utils import cpp_extension

    # Vectorize the dot products' sums (-fopenmp-simd: the pragma, without OpenMP's
    # runtime) over several partial sums at once (unrolled: a third faster).
    flags = ["-O3", "-fopenmp-simd", "-funroll-loops", "-fvariable-expansion-in-unroller"]
    name = "minipaged_cpu"
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        # 8 floats an instruction instead of SSE2's 4, and fused multiply-adds; named in
        # the build so that a cache shared with an older CPU does not load it there.
        flags += ["-mavx2", "-mfma"]
        name += "_avx2"
    build_dir = cuda_build.cached_build_dir(name, [SOURCE])
    if not (build_dir / f"{name}.so").exists():
        print(
            f"minipaged: compiling the CPU attention kernel (once; cached in {build_dir})",
            file=sys.stderr,
        )
    return cpp_extension.load(
        name, [str(SOURCE)], build_directory=str(build_dir), extra_cflags=flags
    )

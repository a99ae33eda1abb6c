"""``minipaged bench attention``: how close the attention ops come to the memory wall
(paper §5.1, §7.1 and Fig. 18a).

Decode reads each sequence's whole K/V once to produce one token, about one multiply-add
per element read, so it is bound by memory bandwidth, not arithmetic.  The fair measure
of a decode kernel is therefore the bandwidth it achieves (bytes of K/V, query and
output divided by time) as a fraction of what the device can stream at all, measured in
the same run by summing a buffer far larger than its caches (on a CPU with every thread
torch uses, as the kernels run; the ``cpu-serving`` preset is SmolLM2's layer at the
batch sizes `bench throughput` serves).

Every shape lays the same K/V out three ways:

- paged, with physical blocks in shuffled order as a real allocator leaves them: the
  backends ``torch``, ``triton``, and ``cuda-v0`` to ``cuda-v3``, the four versions of
  the CUDA decode kernel (lesson 08: v0 the plain one-thread-per-head algorithm, v1 the
  paper's, v2 partitioned, v3 flash-decoding, the engine's; the CUDA backend prefills
  with Triton's kernel, so these time decode only);
- paged with an identity block table, sequence ``b`` owning consecutive blocks, which is
  byte for byte a contiguous cache: ``triton-contiguous``.  ``triton`` over
  ``triton-contiguous`` is the price of paging; the paper's kernel paid 20-26% (§7.1);
- paged and shuffled too, through another library's kernels where it is installed:
  ``flash_attn`` (FlashAttention-2, whose paged kernels want blocks of 256 tokens, so it
  is skipped at the presets' 16) and ``flashinfer`` (FlashInfer);
- dense ``[B, num_kv_heads, L, head_dim]``: ``sdpa-contiguous``, torch's
  ``scaled_dot_product_attention`` (FlashAttention on a GPU), the speed with no paging.

Every output is checked against the torch reference backend before it is timed: a
wrong kernel gets a note, not a number.  Prefill is compute-bound (each key meets many
queries), so its rows report arithmetic instead: the causal attention's FLOPs over the
time in TFLOP/s (`Shape.flops`), and on a GPU whose dense 16-bit tensor-core peak is
known (`PEAK_TFLOPS`, from the vendors' datasheets) the share of it.

Beside them, latent attention's decode (DeepSeek-V2's MLA, lesson 21): one
DeepSeek-V2-Lite layer at each decode shape's batch, context length, block size and
dtype, absorbed against unabsorbed, on the backends with MLA kernels (torch and the C++
one on a CPU; torch and Triton on a GPU), as ``bench mla`` times it
(`minipaged.bench.mla.decode_rows`): what each one's kernel reads, and its time per
step (``--ops mla-decode``; ``mla_decode`` in the JSON, a panel of the PNG).

The CUDA kernels are built before anything is timed, the versions asked for in one
build per shape's configuration; how long each cold build took is printed and saved
(``cuda_builds`` in the JSON, from `cuda_build.builds`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minipaged.bench import common, mla
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, time_us
from minipaged.ops import (
    LIBRARY_BACKENDS,
    BackendUnavailableError,
    check_supported,
    cuda_build,
    cuda_ops,
    get_backend,
    paged_attention_decode,
    paged_attention_prefill,
)
from minipaged.ops.testing import assert_close

NAME = "attention"
HELP = "attention ops per backend vs the device's read bandwidth"
DESCRIPTION = (
    "Time paged decode and prefill for each backend, the same kernel over "
    "a contiguous cache, and torch's scaled_dot_product_attention, and "
    "report each as a fraction of the measured streaming-read bandwidth; then "
    "DeepSeek-V2-Lite's latent attention decode, absorbed against unabsorbed."
)
OPS = ("decode", "prefill")
# Latent attention's decode (`_mla_decode_rows`), at the preset's decode shapes: an op of
# ``--ops`` too.
MLA_OP = "mla-decode"
BACKENDS = (
    "torch",
    "cpu",
    "triton",
    "triton-contiguous",
    "cuda-v0",
    "cuda-v1",
    "cuda-v2",
    "flash_attn",
    "flashinfer",
    "cuda-v3",
    "sdpa-contiguous",
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The decode goal as a fraction of the read bandwidth: 85% on an H100 or H200 (the CUDA
# v3 kernel's at batched shapes), half on a CPU's cores (a benchmark figure, never a
# test assert).
GOAL_FRACTION = {"cuda": 0.85, "cpu": 0.5}
# Dense (not 2:4 sparse) bf16 / fp16 tensor-core peaks in TFLOP/s, from NVIDIA's
# datasheets, by a piece of the name torch reports; the first match wins, so the more
# specific names come first ("NVIDIA H100 PCIe" before "H100", "L40S" before "L4").
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.4),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", 989.4),  # "NVIDIA H200", "NVIDIA GH200 480GB"
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
# Before torch 2.5, sdpa cannot broadcast K/V heads over query groups by itself.
_SDPA_HAS_GQA = torch.__version__ >= (2, 5)  # TorchVersion compares as a version


@dataclass(frozen=True)
class Shape:
    """One benchmarked batch: every sequence holds ``context_len`` tokens in the cache,
    the last ``num_new_tokens`` of them new (1 for decode)."""

    op: str
    batch: int
    context_len: int
    num_new_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        for name in (
            "batch",
            "context_len",
            "num_new_tokens",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.op == "decode" and self.num_new_tokens != 1:
            raise ValueError(f"num_new_tokens must be 1 for decode, got {self.num_new_tokens}")
        if self.num_new_tokens > self.context_len:
            raise ValueError(
                f"num_new_tokens {self.num_new_tokens} must be at most "
                f"context_len {self.context_len}"
            )

    @property
    def bytes_moved(self) -> int:
        """Bytes every backend must move at the least: each sequence's K and V once,
        the query and the output.  The same for every backend, so bandwidths compare."""
        kv = self.batch * self.context_len * self.num_kv_heads * self.head_dim * 2
        q_out = self.batch * self.num_new_tokens * self.num_heads * self.head_dim * 2
        return (kv + q_out) * DTYPES[self.dtype].itemsize

    @property
    def flops(self) -> int:
        """The floating-point operations of causal attention: query ``j`` of the
        ``n`` new ones sits at position ``L - n + j`` and meets ``L - n + j + 1`` keys,
        each once in ``q k^T`` and once in ``p v``, a multiply and an add per element of
        ``head_dim`` in every query head."""
        n, length = self.num_new_tokens, self.context_len
        pairs = n * (length - n) + n * (n + 1) // 2
        return 4 * self.batch * self.num_heads * self.head_dim * pairs

    def fields(self) -> dict:
        """The contract's shape fields of a result row (``num_new_tokens`` for prefill)."""
        fields = dataclasses.asdict(self)
        if self.op == "decode":
            del fields["num_new_tokens"]
        return fields


_GPU = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
_CPU = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
# SmolLM2-135M's attention layer: 9 query heads over 3 KV heads of 64.
_SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")

# The gpu preset holds the goal shapes (a Llama-3-8B-like layer: 32 query heads over 8 KV
# heads); the cpu preset is tiny, so the command runs in seconds where no GPU is; the
# cpu-serving preset is one SmolLM2 layer's attention as `bench throughput` serves it
# (96 sequences of about 250 tokens: the CPU's goal shape), one long context that only
# partitions spread over the cores, and a prompt's prefill.
PRESETS = {
    "gpu": (
        "cuda",
        [
            Shape("decode", 64, 2048, 1, **_GPU),
            Shape("decode", 64, 8192, 1, **_GPU),
            Shape("decode", 1, 32768, 1, **_GPU),  # long context: only split-KV fills the GPU
            Shape("decode", 4, 32768, 1, **_GPU),
            Shape("prefill", 4, 2048, 2048, **_GPU),  # prompts from scratch
            Shape("prefill", 4, 4096, 512, **_GPU),  # a chunk of a chunked prefill (§4.5)
        ],
    ),
    "cpu": (
        "cpu",
        [
            Shape("decode", 4, 256, 1, **_CPU),
            Shape("decode", 1, 1024, 1, **_CPU),
            Shape("prefill", 2, 128, 128, **_CPU),
            Shape("prefill", 2, 256, 32, **_CPU),
        ],
    ),
    "cpu-serving": (
        "cpu",
        [
            Shape("decode", 96, 256, 1, **_SMOLLM2),
            Shape("decode", 32, 512, 1, **_SMOLLM2),
            Shape("decode", 1, 4096, 1, **_SMOLLM2),
            Shape("prefill", 1, 512, 512, **_SMOLLM2),
        ],
    ),
}


def default_preset() -> str:
    """``"gpu"`` where torch sees a CUDA device, else ``"cpu"``."""
    return "gpu" if torch.cuda.is_available() else "cpu"


def preset_device(preset: str) -> torch.device:
    """The device ``preset`` runs on."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {list(PRESETS)}, got {preset!r}")
    device = torch.device(PRESETS[preset][0])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"preset {preset!r} needs a CUDA GPU, and torch sees none")
    return device


def make_shapes(preset: str, ops: Sequence[str] = OPS, **overrides) -> list[Shape]:
    """The shapes of ``preset`` for ``ops``, with every field given in ``overrides``
    (``batch=2``, ``dtype="float16"``, ...; ``None`` keeps the preset's) replaced.
    Shapes that the overrides make equal are kept once."""
    preset_device(preset)
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"ops must be a non-empty subset of {OPS}, got {list(ops)}")
    changes = {name: value for name, value in overrides.items() if value is not None}
    shapes = [_override(shape, changes) for shape in PRESETS[preset][1] if shape.op in ops]
    return list(dict.fromkeys(shapes))


def _override(shape: Shape, changes: dict) -> Shape:
    if shape.op == "prefill" and "context_len" in changes:
        # A prefill from scratch stays one; a chunk keeps its size while the context holds it.
        new, length = shape.num_new_tokens, changes["context_len"]
        changes = {
            **changes,
            "num_new_tokens": length if new == shape.context_len else min(new, length),
        }
    return dataclasses.replace(shape, **changes)


def sdpa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` as the paged ops define attention:
    ``query [B, num_heads, n, D]`` holds the *last* ``n`` of the ``L`` positions in
    ``key, value [B, num_kv_heads, L, D]``, so the causal mask is aligned bottom-right
    (query ``j`` sees keys up to ``L - n + j``).  Returns ``[B, num_heads, n, D]``."""
    # Imported here: it imports torch._dynamo, a second of start-up for every CLI command.
    from torch.nn.attention.bias import causal_lower_right

    n, length = query.shape[2], key.shape[2]
    # One query (decode) sees every key; sdpa's own is_causal would align top-left.
    mask = causal_lower_right(n, length) if n > 1 else None
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, **gqa)


def peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 / fp16 tensor-core peak of ``device`` (`PEAK_TFLOPS`), None for
    a CPU or a GPU not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_TFLOPS if part in name), None)


def read_bandwidth_gbs(device: torch.device, nbytes: int | None = None) -> float:
    """The streaming-read bandwidth of ``device`` in GB/s: ``sum()`` over a float32
    buffer of ``nbytes`` (default 1 GiB on a GPU, 256 MiB on a CPU), far larger than any
    cache, so that every byte comes from memory.  A reduction reads each byte once and
    writes nothing: the best case any attention kernel could hope for."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 256 << 20)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return buffer.numel() * 4 / time_us(buffer.sum, device) / 1e3


@dataclass
class AttentionBench:
    """What one run measured: contract rows, the read bandwidth the decode rows are a
    fraction of, the tensor-core peak the prefill rows are (None: unknown), and one line
    for each backend that was skipped and why."""

    rows: list[dict]
    read_bandwidth_gbs: float
    notes: list[str]
    peak_tflops: float | None = None
    cuda_builds: list[dict] = dataclasses.field(default_factory=list)
    mla_rows: list[dict] = dataclasses.field(default_factory=list)


def bench_attention(
    shapes: Sequence[Shape],
    backends: Sequence[str] = BACKENDS,
    device: torch.device | str = "cpu",
    progress: bool = True,
    mla_shapes: Sequence[Shape] = (),
) -> AttentionBench:
    """Time each of ``backends`` on each of ``shapes`` on ``device``, every one only
    after its output matched the torch reference's; then latent attention's decode at
    each of the decode shapes ``mla_shapes`` (`_mla_decode_rows`).  Raises
    ``ValueError`` when not one backend could be timed."""
    device = torch.device(device)
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise ValueError(f"backends must be a non-empty subset of {BACKENDS}, got {list(backends)}")
    read_bw, peak = read_bandwidth_gbs(device), peak_tflops(device)
    rows, notes = [], []
    _build_cuda_kernels(shapes, backends, device)

    def note(text):
        if text not in notes:
            notes.append(text)
            tqdm.write(text)

    with tqdm(
        total=len(shapes) * len(backends), desc="bench attention", unit="run", disable=not progress
    ) as bar:
        for shape in shapes:
            inputs = _make_inputs(shape, device)
            expected = _runner("torch", inputs, checked=True)()
            for backend in backends:
                bar.set_postfix_str(f"{shape.op} {_label(shape.fields())} {backend}")
                row = _measure(backend, inputs, expected, read_bw, peak, note)
                if row is not None:
                    rows.append(row)
                bar.update()
    mla_rows = _mla_decode_rows(mla_shapes, backends, device, note)
    if not rows and not mla_rows:
        raise ValueError(f"backends {list(backends)} could not run here: " + "; ".join(notes))
    builds = cuda_build.builds() if device.type == "cuda" else []  # none timed on a CPU
    return AttentionBench(rows, read_bw, notes, peak, builds, mla_rows)


def _mla_decode_rows(shapes: Sequence[Shape], backends: Sequence[str], device, note) -> list[dict]:
    """DeepSeek-V2-Lite's attention layer decoding over its latent cache, absorbed
    against unabsorbed (`minipaged.bench.mla.decode_rows`, as ``bench mla`` times it), at
    each decode shape's batch, context length, block size and dtype (its heads are the
    layer's own), on each of ``backends`` that latent attention has kernels for
    (`mla.DECODE_BACKENDS`)."""
    if any(s.op != "decode" for s in shapes):
        raise ValueError(f"latent attention is timed at decode shapes, got {list(shapes)}")
    rows = []
    for backend in (b for b in backends if b in mla.DECODE_BACKENDS and shapes):
        if skipped := _cpu_skip(backend, device):
            note(skipped)
            continue
        try:
            get_backend(backend, device)
        except BackendUnavailableError as error:
            note(f"skipped {backend}: {error}")
            continue
        for shape in tqdm(shapes, desc=f"bench attention: MLA decode, {backend}", leave=False):
            try:
                rows += mla.decode_rows(
                    shape.batch,
                    [shape.context_len],
                    DTYPES[shape.dtype],
                    shape.block_size,
                    device,
                    backend,
                )
            except AssertionError as error:  # the two forms disagree: no number
                note(
                    f"skipped {backend} MLA decode {_label(shape.fields())}: absorbed and "
                    f"unabsorbed outputs differ: {str(error).splitlines()[0]}"
                )
            except Exception as error:  # noqa: BLE001 (a row never run on a GPU yet that
                # fails, out of memory or in a kernel's compile, costs a note, not the run)
                note(
                    f"skipped {backend} MLA decode {_label(shape.fields())}: "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                )
    return rows


def _cpu_skip(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` is not timed on ``device``, or None: on a CPU, Triton runs only in
    its interpreter and the CUDA kernels only in an emulator."""
    if device.type != "cpu" or not backend.startswith(("triton", "cuda")):
        return None
    runs_in = "Triton's interpreter" if backend.startswith("triton") else "an emulator"
    return f"skipped {backend}: on a CPU it runs only in {runs_in}, whose timings mean nothing"


def _build_cuda_kernels(shapes: Sequence[Shape], backends: Sequence[str], device) -> None:
    """Build, before any timing, the CUDA decode versions among ``backends`` for every
    configuration of ``shapes``: one build each, its versions compiled in parallel."""
    versions = sorted({int(b[-1]) for b in backends if b.startswith("cuda-")})
    if device.type != "cuda" or not versions or cuda_build.missing(device):
        return
    for shape in dict.fromkeys(
        dataclasses.replace(s, batch=1, context_len=1) for s in shapes if s.op == "decode"
    ):
        dtype = DTYPES[shape.dtype]
        kernels = cuda_build.KernelSet(
            versions[0] if len(versions) == 1 else None,
            dtype,
            dtype,
            shape.head_dim,
            shape.block_size,
        )
        cuda_build.load(device, kernels)


@dataclass
class _Inputs:
    shape: Shape
    scale: float
    query: torch.Tensor  # [B * n, num_heads, D], packed as the ops take it
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    key_cache: torch.Tensor  # blocks in shuffled physical order ...
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # ... and the tables that find them
    contiguous_key_cache: torch.Tensor  # sequence b owns blocks b * per_seq, b * per_seq + 1, ...
    contiguous_value_cache: torch.Tensor
    identity_tables: torch.Tensor


def _make_inputs(shape: Shape, device: torch.device) -> _Inputs:
    """Random K/V for ``shape``, stored both paged-and-shuffled and contiguously."""
    g = torch.Generator(device=device).manual_seed(0)
    dtype, bs = DTYPES[shape.dtype], shape.block_size
    batch, n = shape.batch, shape.num_new_tokens
    per_seq = math.ceil(shape.context_len / bs)
    num_blocks = batch * per_seq
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    dense_k = torch.randn(cache_shape, generator=g, device=device, dtype=dtype)
    dense_v = torch.randn(cache_shape, generator=g, device=device, dtype=dtype)
    # Logical block i of sequence b goes to physical block perm[b * per_seq + i]: the
    # order an allocator leaves after many requests came and went.
    perm = torch.randperm(num_blocks, generator=g, device=device)
    key_cache, value_cache = torch.empty_like(dense_k), torch.empty_like(dense_v)
    key_cache[perm], value_cache[perm] = dense_k, dense_v
    query = torch.randn(
        batch * n, shape.num_heads, shape.head_dim, generator=g, device=device, dtype=dtype
    )
    return _Inputs(
        shape=shape,
        scale=1 / math.sqrt(shape.head_dim),
        query=query,
        context_lens=torch.full((batch,), shape.context_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=perm.view(batch, per_seq).int(),
        contiguous_key_cache=dense_k,
        contiguous_value_cache=dense_v,
        identity_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).view(
            batch, per_seq
        ),
    )


def _runner(backend: str, x: _Inputs, checked: bool = False) -> Callable[[], torch.Tensor]:
    """A call of ``backend`` on ``x``, all set-up done: only the op itself is timed.

    ``checked`` goes through the public ops, which validate every argument (and so wait
    for the GPU once per call); timed calls go straight to the backend, as a model's
    layers do once the engine has validated a step's metadata.
    """
    if backend == "sdpa-contiguous":
        return _sdpa_runner(x)
    if backend == "triton-contiguous":
        caches, tables, backend = (
            (x.contiguous_key_cache, x.contiguous_value_cache),
            x.identity_tables,
            "triton",
        )
    else:
        caches, tables = (x.key_cache, x.value_cache), x.block_tables
    if backend.startswith("cuda-"):
        get_backend("cuda", x.query.device)  # raises if it cannot run here
        decode = functools.partial(cuda_ops.paged_attention_decode, version=int(backend[-1]))
        return lambda: decode(x.query, *caches, tables, x.context_lens, x.scale)
    if checked:
        decode = functools.partial(paged_attention_decode, backend=backend)
        prefill = functools.partial(paged_attention_prefill, backend=backend)
    else:
        impl = get_backend(backend, x.query.device)
        decode, prefill = impl.paged_attention_decode, impl.paged_attention_prefill
    if x.shape.op == "decode":
        return lambda: decode(x.query, *caches, tables, x.context_lens, x.scale)
    return lambda: prefill(x.query, *caches, tables, x.query_start_loc, x.context_lens, x.scale)


def _sdpa_runner(x: _Inputs) -> Callable[[], torch.Tensor]:
    s = x.shape
    n, group = s.num_new_tokens, s.num_heads // s.num_kv_heads
    query = x.query.view(s.batch, n, s.num_heads, s.head_dim).transpose(1, 2)
    # The contiguous cache seen as [B, num_kv_heads, L, D]: the very bytes
    # triton-contiguous reads, in the [B, L, H, D] order FlashAttention reads natively.
    kv = [
        cache.view(s.batch, -1, s.num_kv_heads, s.head_dim)[:, : s.context_len].transpose(1, 2)
        for cache in (x.contiguous_key_cache, x.contiguous_value_cache)
    ]
    if not _SDPA_HAS_GQA:
        kv = [t.repeat_interleave(group, dim=1) for t in kv]
    return lambda: sdpa_attention(query, *kv, x.scale)


def _measure(backend, inputs, expected, read_bw, peak, note) -> dict | None:
    """One result row, or ``None`` (and a note) when ``backend`` cannot run or is wrong."""
    shape = inputs.shape
    if skipped := _cpu_skip(backend, inputs.query.device):
        note(skipped)
        return None
    if shape.op == "prefill" and backend.startswith("cuda"):
        note(
            f"skipped {backend} prefill: the CUDA backend prefills with Triton's kernel "
            "(the triton rows)"
        )
        return None
    try:
        if backend in LIBRARY_BACKENDS:
            get_backend(backend, inputs.query.device)  # unavailable before unsupported
            check_supported(backend, DTYPES[shape.dtype], shape.head_dim, shape.block_size, None)
        out = _runner(backend, inputs, checked=True)()
    except BackendUnavailableError as error:
        note(f"skipped {backend}: {error}")
        return None
    except ValueError as error:  # a shape this backend is not built for (v1's long contexts)
        note(f"skipped {backend} {shape.op} {_label(shape.fields())}: {error}")
        return None
    if backend == "sdpa-contiguous":
        out = out.transpose(1, 2).reshape(expected.shape)  # [B, H, n, D] -> packed
    try:
        assert_close(out, expected)
    except AssertionError as error:
        note(
            f"skipped {backend} {shape.op} {_label(shape.fields())}: output differs from "
            f"the torch reference, so it was not timed: {str(error).splitlines()[0]}"
        )
        return None
    time = time_us(_runner(backend, inputs), out.device)
    row = {"backend": backend, **shape.fields(), "time_us": time}
    if shape.op == "decode":
        bandwidth = shape.bytes_moved / time / 1e3
        return {**row, "bandwidth_gbs": bandwidth, "fraction_of_read_bw": bandwidth / read_bw}
    tflops = shape.flops / time / 1e6
    # The peak is a 16-bit tensor-core one: a float32 prefill is not measured against it.
    of_peak = tflops / peak if peak and shape.dtype != "float32" else None
    return {**row, "tflops": tflops, "fraction_of_peak": of_peak}


def _label(fields: dict) -> str:
    label = f"B={fields['batch']} L={fields['context_len']}"
    if fields["op"] == "prefill":
        label += f" new={fields['num_new_tokens']}"
    return label


def format_table(bench: AttentionBench) -> str:
    """The rows as a table, then, per decode shape, the price of paging."""
    rows = common.format_table(
        bench.rows,
        [
            Column("op", "op"),
            Column("shape", _label),
            Column("backend", "backend"),
            Column("time us", "time_us", "{:.1f}"),
            Column("GB/s", lambda r: r.get("bandwidth_gbs"), "{:.1f}"),
            Column("of read", lambda r: r.get("fraction_of_read_bw"), "{:.1%}"),
            Column("TFLOP/s", lambda r: r.get("tflops"), "{:.1f}"),
            Column("of peak", lambda r: r.get("fraction_of_peak"), "{:.1%}"),
        ],
    )
    # Paging overhead: the same kernel on the same bytes, through shuffled blocks or not,
    # and each paged kernel's share of the read bandwidth, side by side.
    kernels = ("triton", "cuda-v0", "cuda-v1", "cuda-v2", "cuda-v3")
    decode = [row for row in bench.rows if row["op"] == "decode"]
    paging = []
    for label in dict.fromkeys(map(_label, decode)):
        by_backend = {row["backend"]: row for row in decode if _label(row) == label}
        paged, contiguous = by_backend.get("triton"), by_backend.get("triton-contiguous")
        paging.append(
            {
                "shape": label,
                "overhead": paged["time_us"] / contiguous["time_us"]
                if paged and contiguous
                else None,
                **{
                    k: by_backend[k]["fraction_of_read_bw"] if k in by_backend else None
                    for k in kernels
                },
            }
        )
    overheads = common.format_table(
        paging,
        [
            Column("decode shape", "shape"),
            Column("triton / triton-contiguous", "overhead", "{:.3f}x"),
            *(Column(f"{k} of read", k, "{:.1%}") for k in kernels),
        ],
    )
    peak = (
        f"dense bf16 peak: {bench.peak_tflops:.0f} TFLOP/s"
        if bench.peak_tflops
        else "dense bf16 peak: unknown here (prefill in TFLOP/s only)"
    )
    builds = [
        f"CUDA build {b['module']} ({b['arch']}): {b['build_s']:.1f} s cold with {b['jobs']} jobs"
        f"{'' if b['built_here'] else ' (cached, built earlier)'}"
        for b in bench.cuda_builds
        if b["build_s"] is not None
    ]
    return "\n".join(
        [
            f"streaming read bandwidth: {bench.read_bandwidth_gbs:.1f} GB/s; {peak}",
            *(["", rows] if bench.rows else []),
            *(["", overheads] if paging else []),
            *(["", _format_mla(bench.mla_rows)] if bench.mla_rows else []),
            *(["", *builds] if builds else []),
        ]
    )


def _format_mla(mla_rows: list[dict]) -> str:
    lite = mla.DEEPSEEK_V2_LITE
    title = (
        f"MLA decode, one DeepSeek-V2-Lite layer ({lite['num_attention_heads']} heads, "
        f"latent {lite['kv_lora_rank']} + {lite['qk_rope_head_dim']}): absorbed against "
        "unabsorbed"
    )
    columns = [Column("backend", "backend"), Column("batch", "batch"), *mla.DECODE_COLUMNS]
    return f"{title}\n{common.format_table(mla_rows, columns)}"


def plot_fractions(
    rows: list[dict], goal: float = GOAL_FRACTION["cuda"], mla_rows: Sequence[dict] = ()
):
    """One panel per op: bars per shape and backend of decode's ``fraction_of_read_bw``,
    with the ``goal`` dashed, and of prefill's ``fraction_of_peak`` (``tflops`` where
    the peak is unknown); then, given ``mla_rows``, latent attention's time per decode
    step, absorbed and unabsorbed (`mla.draw_decode`).  Returns a matplotlib
    ``Figure``, drawn without pyplot so that no GUI backend is needed."""
    from matplotlib.figure import Figure  # imported here, like causal_lower_right

    ops = [op for op in OPS if any(row["op"] == op for row in rows)]
    panels = len(ops) + bool(mla_rows)
    fig = Figure(figsize=(6.5 * panels, 4.2), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    if mla_rows:
        mla.draw_decode(axes[-1], list(mla_rows), "MLA decode, one DeepSeek-V2-Lite layer")
    for ax, op in zip(axes, ops):
        op_rows = [row for row in rows if row["op"] == op]
        key, ylabel = _plotted(op_rows)
        shapes = list(dict.fromkeys(map(_label, op_rows)))
        backends = list(dict.fromkeys(row["backend"] for row in op_rows))
        width = 0.8 / len(backends)
        for i, backend in enumerate(backends):
            mine = [row for row in op_rows if row["backend"] == backend]
            offset = (i - (len(backends) - 1) / 2) * width
            ax.bar(
                [shapes.index(_label(row)) + offset for row in mine],
                [row[key] for row in mine],
                width,
                label=backend,
            )
        if op == "decode":
            ax.axhline(goal, color="black", linestyle="--", linewidth=1, label=f"goal {goal:.0%}")
        ax.set_xticks(range(len(shapes)), [s.replace(" ", "\n") for s in shapes])
        ax.set_title(
            f"{op}: {op_rows[0]['num_heads']}/{op_rows[0]['num_kv_heads']} heads, "
            f"head_dim {op_rows[0]['head_dim']}, {op_rows[0]['dtype']}"
        )
        ax.set_ylabel(ylabel)
        # Below the panel: bars may reach the top anywhere.
        ax.legend(
            fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, frameon=False
        )
    return fig


def _plotted(op_rows: list[dict]) -> tuple[str, str]:
    """The field an op's panel plots, and its axis label."""
    if op_rows[0]["op"] == "decode":
        return "fraction_of_read_bw", "fraction of streaming read bandwidth"
    if all(row["fraction_of_peak"] is not None for row in op_rows):
        return "fraction_of_peak", "fraction of the dense bf16 tensor-core peak"
    return "tflops", "TFLOP/s"


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default_preset(),
        help="gpu: the goal shapes on CUDA; cpu: tiny shapes on the CPU; cpu-serving: "
        "SmolLM2's layer at serving batch sizes on the CPU (default: gpu if CUDA is available)",
    )
    parser.add_argument(
        "--ops",
        nargs="+",
        choices=(*OPS, MLA_OP),
        metavar="OP",
        default=[*OPS, MLA_OP],
        help=f"any of {', '.join(OPS)} and {MLA_OP} (DeepSeek-V2-Lite's latent attention, "
        "absorbed and unabsorbed, at the decode shapes) (default: all)",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        metavar="BACKEND",
        default=list(BACKENDS),
        help=f"any of {', '.join(BACKENDS)} (default: all)",
    )
    for flag in (
        "--batch",
        "--context-len",
        "--num-heads",
        "--num-kv-heads",
        "--head-dim",
        "--block-size",
    ):
        parser.add_argument(
            flag, type=int, metavar="N", help="override it in every shape of the preset"
        )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="override it in every shape of the preset"
    )
    add_output_flags(parser, NAME)


def main(args) -> None:
    overrides = dict(
        batch=args.batch,
        context_len=args.context_len,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=args.dtype,
    )
    ops = [op for op in args.ops if op in OPS]
    shapes = make_shapes(args.preset, ops, **overrides) if ops else []
    mla_shapes = make_shapes(args.preset, ["decode"], **overrides) if MLA_OP in args.ops else []
    device = preset_device(args.preset)
    bench = bench_attention(shapes, args.backends, device, mla_shapes=mla_shapes)
    print(format_table(bench))
    write(
        args,
        NAME,
        device,
        bench.rows,
        plot_fractions(bench.rows, GOAL_FRACTION[device.type], bench.mla_rows),
        preset=args.preset,
        read_bandwidth_gbs=bench.read_bandwidth_gbs,
        peak_tflops=bench.peak_tflops,
        notes=bench.notes,
        cuda_builds=bench.cuda_builds,
        mla_decode=bench.mla_rows,
    )

"""The CUDA backend against the oracle: the whole adversarial suite, the four decode
versions, every compiled (dtype, head_dim, block_size) and v3's (dtype, head_dim, GQA
group), v3's splits, GQA groups split over several thread blocks, a build of one
configuration, and the errors for what the kernels are not built for.

Without a GPU the kernels run in minipaged's CPU emulator (conftest sets
MINIPAGED_CUDA_EMULATE): each CUDA thread a fiber, barriers and warp shuffles real, so
a kernel that reads shared memory before it is written fails here.  The ``gpu`` tests
repeat the suite on CUDA and add real sizes.

One version's tests alone, as each kernel file's header says: ``pytest -k v1`` (the
decode versions are the ids ``v0`` to ``v3``).
"""

import dataclasses
import itertools
import math
import re
import subprocess
import sysconfig

import pytest
import torch

from attention_cases import (
    DECODE_CASES,
    NUM_HEADS,
    AttentionSuite,
    Case,
    make_paged_kv,
    real_paged_kv,
    refusal_on_cpu,
)
from minipaged.ops import cuda_build, cuda_ops, decode_oracle, paged_attention_decode
from minipaged.ops.testing import assert_close

pytestmark = pytest.mark.spread  # independent cases (emulated where there is no GPU)

# Every test of a decode version, once per version, selectable by id: `pytest -k v2`.
each_version = pytest.mark.parametrize("version", cuda_ops.VERSIONS, ids=lambda v: f"v{v}")


def _compiled_for(case: Case) -> bool:
    return (
        case.dtype in cuda_ops.DTYPES
        and case.head_dim in cuda_ops.HEAD_DIMS
        and case.block_size in cuda_ops.BLOCK_SIZES
    )


class TestCudaOps(AttentionSuite):
    backend = "cuda"

    def decodes(self, case):
        return _compiled_for(case)


@pytest.mark.gpu
class TestCudaOpsCuda(TestCudaOps):
    device = "cuda"


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _decode(case, version, num_heads=NUM_HEADS, **kwargs):
    """Run ``case`` through one decode version; return (output, oracle's)."""
    g = torch.Generator().manual_seed(2)
    kv = make_paged_kv(case, g, _device())
    query = torch.randn(len(case.context_lens), num_heads, case.head_dim, generator=g)
    query = query.to(case.dtype).to(_device())
    out = cuda_ops.paged_attention_decode(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.context_lens,
        case.scale,
        version=version,
        **kwargs,
    )
    return out, decode_oracle(query, kv.keys, kv.values, case.scale)


@each_version
@pytest.mark.parametrize("case", [c for c in DECODE_CASES if _compiled_for(c)], ids=str)
def test_every_version_matches_oracle(case, version):
    assert_close(*_decode(case, version))


# Every compiled kernel instance of v0-v2, across partition boundaries (512 tokens): a
# context of one token, one just short of a partition, exactly one, one just past, and three.
EVERY_INSTANCE = [
    Case((1, 511, 512, 513, 1100), block_size=bs, num_kv_heads=2, head_dim=d, dtype=dtype)
    for dtype, d, bs in itertools.product(cuda_ops.DTYPES, cuda_ops.HEAD_DIMS, cuda_ops.BLOCK_SIZES)
]


@pytest.mark.parametrize("version", [0, 1, 2], ids=lambda v: f"v{v}")
@pytest.mark.parametrize("case", EVERY_INSTANCE, ids=str)
def test_every_compiled_shape_and_dtype(case, version):
    """bf16 included: unlike Triton's interpreter, the emulator computes in real floats."""
    out, expected = _decode(case, version)
    assert_close(out, expected, dtype=case.dtype)


# v3 reads the block size at run time and is compiled per (dtype, head_dim, GQA group of
# 1, 2, 4 or 8 query heads): every one, the block sizes in turn, with contexts of one
# token, one tile (32), just past it, and three splits (of 128 tokens when 3 are asked
# for); half of them in one split (stored by the main kernel), half in three (merged by
# the reduce kernel), so that each (dtype, head_dim) takes both ways.
V3_INSTANCES = [
    (Case((1, 32, 33, 290), block_size=bs, num_kv_heads=kv, head_dim=d, dtype=dtype), splits)
    for (dtype, d, (kv, splits)), bs in zip(
        itertools.product(
            cuda_ops.DTYPES, cuda_ops.HEAD_DIMS, [(8, None), (4, 3), (2, None), (1, 3)]
        ),
        itertools.cycle(cuda_ops.BLOCK_SIZES),
    )
]


@pytest.mark.parametrize(
    "case, num_splits", V3_INSTANCES, ids=[f"{c}-splits{n}-v3" for c, n in V3_INSTANCES]
)
def test_every_v3_instance(case, num_splits):
    out, expected = _decode(case, 3, num_splits=num_splits)
    assert_close(out, expected, dtype=case.dtype)


# A context cut into 1 to 40 splits (past one per tile: as many as there are tiles), the
# batch's sequences of very different lengths, so that some have fewer splits than others.
@pytest.mark.parametrize("num_splits", [1, 2, 5, 40], ids=lambda n: f"splits{n}-v3")
def test_v3_splits_merge_to_the_oracle(num_splits):
    case = Case((1, 100, 1030), block_size=16, num_kv_heads=2, dtype=torch.float16)
    assert_close(*_decode(case, 3, num_splits=num_splits))


# A group that is not a power of two is padded to one: the padding heads are computed
# from a zero query and never stored.  9/3 is SmolLM2's; 12 takes two thread blocks.
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (5, 1), (6, 2), (12, 1)])
def test_v3_pads_groups_to_a_power_of_two(num_heads, num_kv_heads):
    case = Case((5, 70), block_size=16, num_kv_heads=num_kv_heads)
    assert_close(*_decode(case, 3, num_heads=num_heads, num_splits=2))


def test_v3_split_kv_follows_the_sms_and_the_batch():
    """The gpu preset's shapes on an H100's 132 SMs (32/8 heads): a batch of 64 fills the
    GPU alone; a few long sequences are cut until about 4 thread blocks per SM."""
    sms = H100_SMS
    assert cuda_ops.split_kv(64, 32, 8, 2048, sms) == (1, 2048)
    assert cuda_ops.split_kv(64, 32, 8, 8192, sms) == (1, 8192)
    for batch in (1, 4):
        splits, size = cuda_ops.split_kv(batch, 32, 8, 32768, sms)
        blocks = batch * 8 * splits
        assert 3 * sms <= blocks <= 5 * sms, (batch, splits)
        assert size % cuda_ops.V3_TILE_SIZE == 0 and splits * size >= 32768 > (splits - 1) * size
    # Never a split of fewer than V3_MIN_SPLIT_TILES tiles, nor none.
    splits, size = cuda_ops.split_kv(1, 8, 8, 600, sms)
    assert size >= cuda_ops.V3_MIN_SPLIT_TILES * cuda_ops.V3_TILE_SIZE and splits * size >= 600
    assert cuda_ops.split_kv(1, 8, 8, 1, sms) == (1, cuda_ops.V3_TILE_SIZE)
    assert cuda_ops.v3_queries_per_block(3) == 4 and cuda_ops.v3_queries_per_block(16) == 8


# GQA groups wider than a thread block's 8 query heads are split across thread blocks.
@each_version
@pytest.mark.parametrize("num_heads, num_kv_heads", [(12, 1), (24, 2), (32, 2)])
def test_wide_gqa_groups_are_sliced(num_heads, num_kv_heads, version):
    case = Case((5, 600), block_size=16, num_kv_heads=num_kv_heads)
    assert math.ceil(num_heads / num_kv_heads / cuda_ops.MAX_QUERIES_PER_BLOCK) > 1
    assert_close(*_decode(case, version, num_heads=num_heads))


def test_v1_refuses_contexts_whose_logits_overflow_shared_memory():
    """v1 keeps a float per token per query head in shared memory: 8 heads x 8192 tokens
    is 256 KiB, over an H100's 227 KiB.  Forced, it says so; by default v2 takes over."""
    case = Case((40, 3), block_size=16, num_kv_heads=1)
    with pytest.raises(ValueError, match="shared memory.*use version 2"):
        _decode(case, version=1, max_context_len=8192)
    assert_close(*_decode(case, version=None, max_context_len=8192))


def test_strided_query_and_int64_tables():
    """Q sliced out of a fused projection, and int64 tables, as a caller may pass them."""
    case = DECODE_CASES[7]
    g = torch.Generator().manual_seed(3)
    kv = make_paged_kv(case, g, _device())
    fused = torch.randn(len(case.context_lens), NUM_HEADS, 3 * case.head_dim, generator=g)
    query = fused.to(_device())[..., case.head_dim : 2 * case.head_dim]
    assert not query.is_contiguous()
    out = paged_attention_decode(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables.long(),
        kv.context_lens.long(),
        case.scale,
        backend="cuda",
    )
    assert_close(out, decode_oracle(query, kv.keys, kv.values, case.scale))


def test_unsupported_dtype_is_refused_by_name():
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.float64, device=_device())
    with pytest.raises(ValueError, match="dtype must be one of"):
        cuda_ops.write_kv(
            cache[0], cache[0], cache, cache.clone(), torch.arange(16, device=_device())
        )
    with pytest.raises(ValueError, match=r"version must be one of \(0, 1, 2, 3\)"):
        _decode(DECODE_CASES[0], version=4)


@each_version
def test_an_empty_batch_launches_nothing(version):
    cache = torch.zeros(4, 16, 2, 64, device=_device())
    tables = torch.zeros(0, 2, dtype=torch.int32, device=_device())
    out = cuda_ops.paged_attention_decode(
        torch.zeros(0, 8, 64, device=_device()),
        cache,
        cache.clone(),
        tables,
        torch.zeros(0, dtype=torch.int32, device=_device()),
        0.125,
        version=version,
    )
    assert out.shape == (0, 8, 64)


def test_python_mirrors_the_kernel_constants():
    ext = cuda_build.load(torch.device(_device()))
    assert cuda_ops.PARTITION_SIZE == ext.PARTITION_SIZE
    assert cuda_ops.MAX_QUERIES_PER_BLOCK == ext.MAX_QUERIES_PER_BLOCK
    assert cuda_ops.V3_TILE_SIZE == ext.V3_TILE_SIZE
    assert cuda_ops.V3_MAX_QUERIES_PER_BLOCK == ext.V3_MAX_QUERIES_PER_BLOCK


def test_the_engines_build_holds_its_configuration_alone(monkeypatch):
    """On a GPU a launch builds (or finds) the cache write and its decode version for
    its configuration alone; here the emulator is made to do the same.  The module runs
    that configuration, exports no other version, and refuses another dtype by name."""
    monkeypatch.setattr(cuda_build, "_LOADED", {})  # no module of everything to reuse
    monkeypatch.setattr(
        cuda_build, "kernels_for", lambda device, *config: cuda_build.KernelSet(*config)
    )
    assert_close(*_decode(Case((5, 70), block_size=16, num_kv_heads=2), version=None))
    ((kernels, ext),) = cuda_build._LOADED[(True, None)]
    assert kernels == cuda_build.KernelSet(3, torch.float32, torch.float32, 64, 16)
    assert hasattr(ext, "paged_attention_v3") and not hasattr(ext, "paged_attention_v2")
    record = cuda_build.builds()[-1]
    assert record["module"] == "minipaged_cuda_emulated_v3_float32_float32_d64_b16"
    assert record["build_s"] > 0
    monkeypatch.setattr(cuda_build, "kernels_for", lambda *args: kernels)
    half = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype code must be .* built into this module, got 1"):
        cuda_ops.write_kv(half[0], half[0], half, half.clone(), torch.arange(16))


def test_kernel_sets_name_their_kernels():
    """The DType codes mirror kernels/minipaged_kernels.h's enum; a set of one
    configuration compiles two files and says which instances; a wider set covers it."""
    header = (cuda_build.KERNELS_DIR / "minipaged_kernels.h").read_text()
    codes = dict(re.findall(r"\bk([A-Z]\w*) = (\d)", header))
    names = {
        "Float32": torch.float32,
        "Float16": torch.float16,
        "BFloat16": torch.bfloat16,
        "Float8E4M3": torch.float8_e4m3fn,
        "Float8E5M2": torch.float8_e5m2,
        "Int8": torch.int8,
    }
    assert {names[k]: int(v) for k, v in codes.items()} == cuda_build.DTYPE_CODES
    one = cuda_build.KernelSet(3, torch.bfloat16, torch.float8_e4m3fn, 128, 16)
    assert one.sources == ["write_kv.cu", "paged_attention_v3.cu"]
    assert one.macros() == [
        "-DMINIPAGED_DECODE_VERSION=3",
        "-DMINIPAGED_ONLY_DTYPE=2",
        "-DMINIPAGED_ONLY_CACHE_DTYPE=3",
        "-DMINIPAGED_ONLY_HEAD_DIM=128",
        "-DMINIPAGED_ONLY_BLOCK_SIZE=16",
    ]
    assert one.tag() == "v3_bfloat16_float8_e4m3fn_d128_b16"
    every_version = cuda_build.KernelSet(None, torch.bfloat16, torch.float8_e4m3fn, 128, 16)
    assert len(every_version.sources) == 5 and cuda_build.ALL.macros() == []
    assert cuda_build.ALL.covers(one) and every_version.covers(one)
    assert not one.covers(every_version) and not one.covers(dataclasses.replace(one, version=1))
    config = (3, torch.bfloat16, torch.bfloat16, 128, 16)
    assert cuda_build.kernels_for(torch.device("cuda"), *config) == cuda_build.KernelSet(*config)
    assert cuda_build.kernels_for(torch.device("cpu"), *config) == cuda_build.ALL
    with pytest.raises(ValueError, match="version must be one of"):
        cuda_build.KernelSet(version=4)


def test_num_splits_is_version_3s():
    with pytest.raises(ValueError, match="num_splits must be a positive int, for version 3"):
        _decode(DECODE_CASES[0], version=2, num_splits=2)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        _decode(DECODE_CASES[0], version=3, num_splits=0)


# Which version: v1 while the batch fills the GPU, v2 for a few long sequences.
H100_SMS = 132


def test_a_big_batch_runs_v1():
    assert cuda_ops.choose_version(64, 32, 8, 2048, H100_SMS) == 1


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_few_long_sequences_run_v2(batch):
    assert cuda_ops.choose_version(batch, 32, 8, 32768, H100_SMS) == 2


def test_one_partition_never_runs_v2():
    assert cuda_ops.choose_version(1, 32, 8, cuda_ops.PARTITION_SIZE, H100_SMS) == 1


def test_v2_when_v1_does_not_fit():
    assert cuda_ops.choose_version(64, 32, 8, 2048, H100_SMS, v1_fits=False) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the real build covers it")
def test_binding_compiles_for_a_cuda_torch(tmp_path):
    """The emulated build compiles the binding without its CUDA branch; here that branch
    meets the CUDA torch headers (the CPU wheel ships them, all but one generated file,
    stubbed) in a syntax-only pass, so a typo there does not wait for a GPU to show."""
    from torch.utils import cpp_extension

    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("")
    includes = [
        *cpp_extension.include_paths(),
        str(tmp_path),
        sysconfig.get_paths()["include"],
        str(cuda_build._cuda_include()),
        str(cuda_build.KERNELS_DIR),
    ]
    command = [
        "c++",
        "-fsyntax-only",
        "-std=c++20",
        "-w",
        "-DTORCH_EXTENSION_NAME=check",
        *(f"-I{path}" for path in includes),
        str(cuda_build.KERNELS_DIR / cuda_build.BINDING),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_cpu_tensors_without_the_emulator_are_refused():
    message = refusal_on_cpu("cuda", without="MINIPAGED_CUDA_EMULATE")
    assert "MINIPAGED_CUDA_EMULATE=1" in message


# v1 at 32k tokens would need 512 KiB of shared memory for its logits: v2's and v3's.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "batch, context_len, version",
    [
        pytest.param(batch, context_len, version, id=f"{batch}x{context_len}-v{version}")
        for batch, context_len, version in [
            (64, 2048, 1),
            (64, 2048, 2),
            (64, 8192, 1),
            (64, 8192, 2),
            (1, 32768, 2),
            (4, 40000, 2),
            (64, 2048, 3),
            (64, 8192, 3),
            (1, 32768, 3),
            (4, 40000, 3),
        ]
    ],
)
def test_decode_at_real_sizes(batch, context_len, version, dtype):
    query, key_cache, value_cache, tables, lens, keys, values = real_paged_kv(
        batch, context_len, dtype
    )
    out = cuda_ops.paged_attention_decode(
        query, key_cache, value_cache, tables, lens, 128**-0.5, version=version
    )
    assert_close(out, decode_oracle(query, keys, values, 128**-0.5))


def test_a_cached_build_loads_without_saying_it_compiles(capfd):
    cuda_build.load(torch.device("cpu"))  # built here, or found in the cache
    capfd.readouterr()
    cuda_build._build.__wrapped__(emulated=True)  # the cache now holds it
    assert "compiling" not in capfd.readouterr().err

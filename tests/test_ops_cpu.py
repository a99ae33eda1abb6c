"""The CPU backend's C++ kernel (``kernels/cpu/paged_attention.cpp``) against the oracle,
built for each instruction set this machine runs (`attention_cases.CPU_ISAS`: AVX-512
and AVX2 on an AVX-512 CPU): the whole adversarial suite (NaN in every slot it must not
read), bf16 caches read natively, contexts past its 256-position partitions and
prefills past its 16-row tiles, thread-count independence, and ``"auto"`` choosing it
on a CPU, or the torch reference without it.

Tolerances (`minipaged.ops.testing`): the kernel widens every element of its dtype to
float32 exactly and does all its arithmetic in float32, against the oracle's float64
on the same rounded inputs, so the float32 error (~1e-6 relative over a few hundred
terms) is far inside float32's 1e-5.  A bf16 output is rounded once at the end, at
most half a unit in the last place: 2^-8 of itself (8 significant bits), the bound bf16
outputs are held to against the float64 oracle, plus 1e-5 for the float32 part.
"""

import dataclasses
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_cases import (
    CPU_ISAS,
    DECODE_CASES,
    LONG_DECODE_CASES,
    LONG_PREFILL_CASES,
    NUM_HEADS,
    PREFILL_CASES,
    AttentionSuite,
    Case,
    make_paged_kv,
)
from minipaged.models.resolve import resolve_backend
from minipaged.ops import (
    BackendUnavailableError,
    cpu_ops,
    cuda_build,
    decode_oracle,
    get_backend,
    paged_attention_decode,
    paged_attention_prefill,
    prefill_oracle,
)
from minipaged.ops.testing import assert_close

pytestmark = pytest.mark.spread  # independent cases; each ISA is a build of its own

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def bf16(cases):
    return [dataclasses.replace(case, dtype=BF16) for case in cases]


@pytest.fixture(params=CPU_ISAS)
def isa(request, monkeypatch):
    """The kernel built for one instruction set (the default: the machine's best)."""
    monkeypatch.setenv(cpu_ops.ISA_ENV, request.param)
    return request.param


class TestCpuOps(AttentionSuite):
    backend = "cpu"

    @pytest.fixture(autouse=True)
    def each_isa(self, isa):
        pass


def exact(kv):
    """The oracle's keys and values: the cache's own, in float64."""
    return [k.double() for k in kv.keys], [v.double() for v in kv.values]


def assert_matches(out, expected):
    if out.dtype != BF16:
        assert_close(out, expected)
        return
    # One rounding to bf16 (unit roundoff 2^-8) over float32 arithmetic's error.
    torch.testing.assert_close(out.double(), expected, rtol=2**-8 * 1.01, atol=1e-5)


@pytest.mark.parametrize(
    "case", LONG_DECODE_CASES + bf16(DECODE_CASES + LONG_DECODE_CASES), ids=str
)
def test_decode_long_contexts_and_bf16(case, isa):
    g = torch.Generator().manual_seed(0)
    kv = make_paged_kv(case, g, "cpu")
    query = torch.randn(len(case.context_lens), NUM_HEADS, case.head_dim, generator=g)
    query = query.to(case.dtype)
    out = paged_attention_decode(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, case.scale, "cpu"
    )
    assert out.dtype == case.dtype
    expected = decode_oracle(query.double(), *exact(kv), case.scale)
    assert_matches(out, expected)


@pytest.mark.parametrize(
    "case", LONG_PREFILL_CASES + bf16(PREFILL_CASES + LONG_PREFILL_CASES), ids=str
)
def test_prefill_long_contexts_and_bf16(case, isa):
    g = torch.Generator().manual_seed(0)
    kv = make_paged_kv(case, g, "cpu")
    query = torch.randn(sum(case.new_lens), NUM_HEADS, case.head_dim, generator=g)
    query = query.to(case.dtype)
    starts = torch.tensor([0, *case.new_lens]).cumsum(0).to(torch.int32)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.context_lens)
    out = paged_attention_prefill(*args, case.scale, "cpu")
    expected = prefill_oracle(query.double(), starts, *exact(kv), case.scale)
    assert_matches(out, expected)


@pytest.mark.parametrize("head_dim", [32, 72, 100])
def test_head_sizes_other_than_64_and_128(head_dim, isa):
    # Their loops are counted at run time, and 72 and 100 are no multiple of the vector
    # width (a scalar tail on each dot product); a long context, and a prefill's causal
    # tiles, in bf16 and fp32.
    for dtype in (torch.float32, BF16):
        case = Case((1, 37, 300), block_size=16, num_kv_heads=4, head_dim=head_dim, dtype=dtype)
        g = torch.Generator().manual_seed(0)
        kv = make_paged_kv(case, g, "cpu")
        query = torch.randn(3, NUM_HEADS, head_dim, generator=g).to(dtype)
        cache = (kv.key_cache, kv.value_cache, kv.block_tables)
        out = paged_attention_decode(query, *cache, kv.context_lens, case.scale, "cpu")
        assert_matches(out, decode_oracle(query.double(), *exact(kv), case.scale))
        query = torch.randn(61, NUM_HEADS, head_dim, generator=g).to(dtype)
        starts = torch.tensor([0, 1, 21, 61], dtype=torch.int32)
        out = paged_attention_prefill(query, *cache, starts, kv.context_lens, case.scale, "cpu")
        assert_matches(out, prefill_oracle(query.double(), starts, *exact(kv), case.scale))


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", [DECODE_CASES[7], LONG_DECODE_CASES[0]], ids=str)
def test_output_does_not_depend_on_the_thread_count(threads, case):
    # Each output is summed by one thread in order, and the split into tasks depends on
    # the shapes only, so a seeded request samples the same tokens however many cores
    # serve it.
    g = torch.Generator().manual_seed(0)
    kv = make_paged_kv(case, g, "cpu")
    query = torch.randn(len(case.context_lens), 8, case.head_dim, generator=g).to(case.dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, case.scale)
    threads(1)
    one = paged_attention_decode(*args, backend="cpu")
    threads(2)
    two = paged_attention_decode(*args, backend="cpu")
    assert torch.equal(one, two)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_tasks_run_on_as_many_threads_as_torch_uses(threads, num_threads):
    # at::parallel_for is OpenMP code inlined into the build: compiled without OpenMP
    # it runs every task on the calling thread, whatever torch is set to.
    threads(num_threads)
    assert cpu_ops.build(cpu_ops.isa()).task_threads() == num_threads


def test_each_instruction_set_is_its_own_build(isa):
    """The build cache's key names the instruction set: a cache shared with another CPU
    never loads a build this one cannot run."""
    ops = cpu_ops.build(isa)
    assert ops.name == f"minipaged_cpu_{isa}"
    assert ops.vector_width() == {"avx512": 16, "avx2": 8, "scalar": 1}[isa]


def test_an_instruction_set_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_ops.ISA_ENV, "sse9")
    with pytest.raises(RuntimeError, match="MINIPAGED_CPU_ISA='sse9'"):
        cpu_ops.isa()


def test_auto_picks_the_kernel_on_a_cpu():
    assert resolve_backend("auto", CPU) == "cpu"


def test_without_the_kernel_auto_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_unavailable", lambda: "no C++ compiler")
    with pytest.raises(BackendUnavailableError, match="no C\\+\\+ compiler"):
        get_backend("cpu", CPU)
    assert resolve_backend("auto", CPU) == "torch"


def test_refuses_cuda_tensors():
    with pytest.raises(BackendUnavailableError, match="runs on the CPU, not cuda"):
        get_backend("cpu", torch.device("cuda"))


def test_a_killed_builds_lock_file_does_not_stop_the_next_load():
    """A build killed mid-way leaves torch's ``lock`` file in its folder; the next load
    (of the cached kernel, here) removes it and goes on, where torch alone would wait
    for it forever."""
    isa = cpu_ops.isa()
    build_dir = cuda_build.cached_build_dir(
        f"minipaged_cpu_{isa}", cpu_ops.SOURCES, cpu_ops.compile_flags(isa)
    )
    with cuda_build.build_lock(build_dir):  # so that no live build holds torch's lock
        (build_dir / "lock").touch()
    code = f"from minipaged.ops import cpu_ops; cpu_ops.build({isa!r}); print('loaded')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout == "loaded\n", done.stderr
    assert not (build_dir / "lock").exists()


def test_the_build_lock_excludes_others_and_dies_with_its_holder(tmp_path):
    code = (
        "import sys, time; from pathlib import Path; from minipaged.ops import cuda_build\n"
        "with cuda_build.build_lock(Path(sys.argv[1])):\n"
        "    print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with open(tmp_path / "build.lock") as handle:
            with pytest.raises(BlockingIOError):
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
    with open(tmp_path / "build.lock") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: no error


def test_checkouts_keep_their_own_builds_and_drop_their_edited_ones(tmp_path, monkeypatch):
    """Two checkouts of the same sources never share a build folder (``build.ninja``
    holds absolute paths), nor remove each other's; editing a source replaces only that
    checkout's build, and a removed checkout's build goes at the next build."""
    monkeypatch.setattr(cuda_build, "CACHE_DIR", tmp_path / "cache")
    one, two, gone = (tmp_path / name for name in ("one", "two", "gone"))
    for checkout in (one, two, gone):
        checkout.mkdir()
        (checkout / "k.cpp").write_text("int k;")
    build = {c: cuda_build.cached_build_dir("ext", [c / "k.cpp"]) for c in (one, two, gone)}
    assert len(set(build.values())) == 3 and all(d.is_dir() for d in build.values())
    (gone / "k.cpp").unlink()
    gone.rmdir()
    (one / "k.cpp").write_text("int k = 1;")
    edited = cuda_build.cached_build_dir("ext", [one / "k.cpp"])
    assert edited != build[one]
    assert sorted((tmp_path / "cache").iterdir()) == sorted([edited, build[two]])


def test_a_build_runs_the_ninja_beside_the_interpreter(tmp_path, monkeypatch):
    """Another ninja first on PATH (the system's: another version, whose build log the
    two discard in turn) would rebuild every cached object; a build runs the venv's."""
    own = Path(sys.executable).parent
    if not (own / "ninja").exists():
        pytest.skip("no ninja installed beside this interpreter")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "ninja").write_text("#!/bin/sh\n")
    (tmp_path / "ninja").chmod(0o755)
    with cuda_build.build_lock(tmp_path):
        found = shutil.which("ninja")
    assert Path(found).parent == own

"""``minipaged bench attention``: the results contract, the byte count behind every
bandwidth, the contiguous baselines, and clear errors for bad flags."""

import contextlib
import io
import json
import math

import pytest
import torch

from cli_helpers import run_main
from minipaged.bench import attention as bench
from minipaged.bench.results import COMMITTED_DIR, committed_path, device_slug
from minipaged.cli import main
from minipaged.ops import mla as mla_ops
from minipaged.ops import paged_attention_decode, prefill_oracle
from minipaged.ops.testing import assert_close

ROW_FIELDS = {
    "backend",
    "op",
    "batch",
    "context_len",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "block_size",
    "dtype",
    "time_us",
}
# Decode is reported against the read bandwidth, prefill against the tensor-core peak.
OP_FIELDS = {
    "decode": {"bandwidth_gbs", "fraction_of_read_bw"},
    "prefill": {"tflops", "fraction_of_peak"},
}
TOP_FIELDS = {"device", "torch", "triton", "date", "command", "results", "read_bandwidth_gbs"}
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Small enough for a few seconds on a CPU; prefill keeps a chunk with a cached prefix.
CPU_ARGV = ["bench", "attention", "--preset", "cpu", "--batch", "2", "--context-len", "64"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU run of the command, shared: its JSON document, stdout and JSON path."""
    path = tmp_path_factory.mktemp("bench") / "attention.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main([*CPU_ARGV, "--json", str(path)]) == 0
    return json.loads(path.read_text()), stdout.getvalue(), path


def test_json_has_every_contract_field(cpu_run):
    doc, _, path = cpu_run
    assert TOP_FIELDS <= doc.keys()
    assert doc["device"] and doc["torch"] == torch.__version__
    assert (
        doc["command"] == "minipaged bench attention --preset cpu --batch 2 "
        f"--context-len 64 --json {path}"
    )
    assert doc["results"]
    for row in doc["results"]:
        assert ROW_FIELDS | OP_FIELDS[row["op"]] == row.keys() - {"num_new_tokens"}
        assert ("num_new_tokens" in row) == (row["op"] == "prefill")
    shapes = {
        (r["op"], r["batch"], r["context_len"], r.get("num_new_tokens")) for r in doc["results"]
    }
    assert shapes == {("decode", 2, 64, None), ("prefill", 2, 64, 64), ("prefill", 2, 64, 32)}


def test_decode_bandwidth_is_bytes_moved_over_time(cpu_run):
    doc, _, _ = cpu_run
    for row in (r for r in doc["results"] if r["op"] == "decode"):
        kv = row["batch"] * row["context_len"] * row["num_kv_heads"] * row["head_dim"] * 2
        q_out = row["batch"] * row.get("num_new_tokens", 1) * row["num_heads"] * row["head_dim"] * 2
        nbytes = (kv + q_out) * ELEMENT_BYTES[row["dtype"]]
        assert row["bandwidth_gbs"] == pytest.approx(nbytes / (row["time_us"] * 1e-6) / 1e9)
        assert row["fraction_of_read_bw"] == pytest.approx(
            row["bandwidth_gbs"] / doc["read_bandwidth_gbs"]
        )


def test_prefill_tflops_are_the_causal_masks_flops_over_time(cpu_run):
    doc, stdout, _ = cpu_run
    assert doc["peak_tflops"] is None  # a CPU has no tensor-core peak in the table
    for row in (r for r in doc["results"] if r["op"] == "prefill"):
        n, length = row["num_new_tokens"], row["context_len"]
        # The pairs a query meets, counted on the mask itself: the last n of L positions.
        visible = torch.ones(length, length).tril()[length - n :].sum().item()
        flops = 4 * row["batch"] * row["num_heads"] * row["head_dim"] * visible
        assert row["tflops"] == pytest.approx(flops / (row["time_us"] * 1e-6) / 1e12)
        assert row["fraction_of_peak"] is None
    assert "TFLOP/s" in stdout and "dense bf16 peak: unknown here" in stdout


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_peak_is_looked_up_by_the_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert bench.peak_tflops(torch.device("cuda")) == peak
    assert bench.peak_tflops(torch.device("cpu")) is None


def test_cpu_times_torch_cpp_and_sdpa_and_notes_the_rest(cpu_run):
    doc, stdout, _ = cpu_run
    for op in bench.OPS:
        timed = {r["backend"] for r in doc["results"] if r["op"] == op}
        assert timed == {"torch", "cpu", "sdpa-contiguous"}
    notes = "\n".join(doc["notes"])
    assert "skipped triton: on a CPU it runs only in Triton's interpreter" in notes
    assert "skipped triton-contiguous:" in notes
    assert "skipped cuda-v1: on a CPU it runs only in an emulator" in notes
    assert "skipped cuda-v2:" in notes
    assert "skipped cuda-v3:" in notes
    assert doc["cuda_builds"] == []  # nothing CUDA was built for it
    assert "differs" not in notes
    assert "streaming read bandwidth" in stdout and "triton / triton-contiguous" in stdout


def test_latent_attention_decode_absorbed_against_unabsorbed(cpu_run):
    """DeepSeek-V2-Lite's layer at the decode shape (B=2, L=64), on the two backends
    with latent attention kernels that time on a CPU; what each kernel reads worked
    out by hand from config.json's numbers (16 heads, latent 512 + 64, keys of 128 +
    64, values of 128 padded to the keys' width)."""
    doc, stdout, _ = cpu_run
    rows = doc["mla_decode"]
    assert [(r["backend"], r["form"]) for r in rows] == [
        ("torch", "absorbed"),
        ("torch", "unabsorbed"),
        ("cpu", "absorbed"),
        ("cpu", "unabsorbed"),
    ]
    assert all((r["batch"], r["context_len"], r["dtype"]) == (2, 64, "float32") for r in rows)
    for absorbed, unabsorbed in zip(rows[::2], rows[1::2]):
        assert absorbed["kernel_bytes"] == 2 * 64 * (512 + 64) * 4
        assert unabsorbed["kernel_bytes"] == 2 * 64 * 16 * 2 * (128 + 64) * 4
        assert absorbed["speedup"] == unabsorbed["us_per_step"] / absorbed["us_per_step"]
        assert "speedup" not in unabsorbed
    assert "MLA decode, one DeepSeek-V2-Lite layer" in stdout and "absorbed speedup" in stdout


def test_png_is_saved_beside_the_json(cpu_run):
    _, stdout, path = cpu_run
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path} and {png}" in stdout


@pytest.mark.parametrize("new, length", [(5, 20), (1, 20), (20, 20)])
def test_sdpa_aligns_the_causal_mask_bottom_right(new, length):
    """The new tokens are the last ones of their sequence, as the paged ops define."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim = 2, 8, 2, 64
    q = torch.randn(batch, heads, new, dim, generator=g)
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dim, generator=g)
    out = bench.sdpa_attention(q, k, v, scale=0.125)
    packed = q.transpose(1, 2).reshape(batch * new, heads, dim)
    starts = [0, new, 2 * new]
    expected = prefill_oracle(
        packed, starts, list(k.transpose(1, 2)), list(v.transpose(1, 2)), scale=0.125
    )
    assert_close(out.transpose(1, 2).reshape(batch * new, heads, dim), expected)


def test_identity_tables_read_the_same_kv_as_shuffled_ones():
    shape = bench.Shape("decode", 3, 40, 1, 4, 2, 64, 8, "float32")
    x = bench._make_inputs(shape, torch.device("cpu"))
    assert not torch.equal(x.block_tables, x.identity_tables)
    shuffled = paged_attention_decode(
        x.query, x.key_cache, x.value_cache, x.block_tables, x.context_lens, x.scale
    )
    contiguous = paged_attention_decode(
        x.query,
        x.contiguous_key_cache,
        x.contiguous_value_cache,
        x.identity_tables,
        x.context_lens,
        x.scale,
    )
    assert torch.equal(shuffled, contiguous)


def test_a_wrong_output_gets_a_note_not_a_number(monkeypatch):
    monkeypatch.setattr(bench, "sdpa_attention", lambda q, k, v, scale: torch.zeros_like(q))
    shape = bench.Shape("decode", 2, 32, 1, 4, 2, 64, 16, "float32")
    result = bench.bench_attention([shape], ["torch", "sdpa-contiguous"], "cpu", progress=False)
    assert [row["backend"] for row in result.rows] == ["torch"]
    assert "sdpa-contiguous decode B=2 L=32: output differs" in result.notes[0]


def test_latent_attention_forms_that_disagree_get_a_note_not_a_number(monkeypatch):
    """A wrong absorbed kernel (zeros) is caught against the unabsorbed form before
    either is timed."""
    monkeypatch.setattr(
        mla_ops, "decode_absorbed", lambda q_latent, *args, **kwargs: torch.zeros_like(q_latent)
    )
    shape = bench.Shape("decode", 2, 32, 1, 4, 2, 64, 16, "float32")
    message = "skipped cpu MLA decode B=2 L=32: absorbed and unabsorbed outputs differ"
    with pytest.raises(ValueError, match=message):  # and so nothing could be timed
        bench.bench_attention([], ["cpu"], "cpu", progress=False, mla_shapes=[shape])


def test_overrides_keep_prefill_from_scratch_and_shrink_chunks():
    shapes = bench.make_shapes("cpu", ["prefill"], context_len=16, batch=1)
    assert [(s.context_len, s.num_new_tokens) for s in shapes] == [(16, 16)]
    shapes = bench.make_shapes("cpu", ["prefill"], context_len=100)
    assert [(s.context_len, s.num_new_tokens) for s in shapes] == [(100, 100), (100, 32)]
    shape = bench.make_shapes("cpu", ["decode"], dtype="float16", head_dim=128)[0]
    assert shape.bytes_moved == (4 * 256 * 2 * 128 * 2 + 4 * 8 * 128 * 2) * 2


def test_device_slug_is_the_first_two_words_of_the_gpu_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert device_slug("cuda") == "nvidia-h100"
    assert device_slug("cpu") == "cpu"
    assert committed_path("attention", "cuda") == COMMITTED_DIR / "nvidia-h100" / "attention.json"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--batch", "0"], "minipaged bench attention: error: batch must be a positive int, got 0"),
        (["--context-len", "-5"], "context_len must be a positive int, got -5"),
        (["--num-kv-heads", "3"], "num_heads 8 must be a multiple of num_kv_heads 3"),
        (["--backends", "tpu"], "argument --backends: invalid choice: 'tpu'"),
        (["--ops", "train"], "argument --ops: invalid choice: 'train'"),
    ],
)
def test_bad_flags_exit_2_naming_them(argv, message, tmp_path, capsys):
    out = tmp_path / "attention.json"
    assert run_main(["bench", "attention", "--preset", "cpu", *argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_no_backend_that_can_run_is_an_error(tmp_path, capsys):
    out = tmp_path / "attention.json"
    assert (
        run_main(
            [*CPU_ARGV, "--ops", "decode", "--backends", "cuda-v1", "triton", "--json", str(out)]
        )
        == 2
    )
    assert (
        "backends ['cuda-v1', 'triton'] could not run here: skipped cuda-v1:"
        in capsys.readouterr().err
    )
    assert not out.exists()


def test_bench_needs_a_benchmark_name(capsys):
    assert run_main(["bench"]) == 2
    assert "the following arguments are required: BENCH" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu preset runs here")
def test_gpu_preset_without_cuda_says_so(capsys):
    assert run_main(["bench", "attention", "--preset", "gpu"]) == 2
    assert "preset 'gpu' needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_run_times_every_backend(tmp_path):
    path = tmp_path / "attention.json"
    assert (
        main(
            [
                "bench",
                "attention",
                "--preset",
                "gpu",
                "--batch",
                "2",
                "--context-len",
                "512",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    doc = json.loads(path.read_text())
    assert doc["device"] == torch.cuda.get_device_name()
    assert doc["read_bandwidth_gbs"] > 100
    for op in bench.OPS:
        timed = {r["backend"] for r in doc["results"] if r["op"] == op}
        assert {"torch", "triton", "triton-contiguous", "sdpa-contiguous"} <= timed
    decode = {r["backend"] for r in doc["results"] if r["op"] == "decode"}
    assert {"cuda-v1", "cuda-v2", "cuda-v3"} <= decode
    mla = {(r["backend"], r["form"]) for r in doc["mla_decode"]}
    assert mla == {(b, f) for b in ("torch", "triton") for f in ("absorbed", "unabsorbed")}
    # The four versions' kernels for bf16, head_dim 128, blocks of 16: one build, timed.
    (build,) = [b for b in doc["cuda_builds"] if b["kernels"] == "vall_bfloat16_bfloat16_d128_b16"]
    assert build["build_s"] > 0 and build["arch"].startswith("sm_")
    assert all(math.isfinite(r["time_us"]) and r["time_us"] > 0 for r in doc["results"])
    assert all(r["tflops"] > 0 for r in doc["results"] if r["op"] == "prefill")
    assert not any("differs" in note for note in doc["notes"])
    assert path.with_suffix(".png").exists()

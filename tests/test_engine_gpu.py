"""The engine on CUDA: the pool sized by profiling, and every attention backend giving
Hugging Face's greedy tokens.  All ``gpu``-marked: they skip on a CPU-only machine and
run with ``make gpu-test`` on a GPU one."""

from pathlib import Path

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.models import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = (1, 5, 17, 40, 64)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """head_dim 64: one the CUDA kernels are compiled for, so every backend runs it."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0, head_dim=64
    )


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(path, prompts, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=MAX_TOKENS
        )
        outs.append(ids[0, len(prompt) :].tolist())
    return outs


def greedy(llm, prompts):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm):
    stats = llm.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_greedy_equals_hugging_face_on_the_gpu(checkpoint, prompts, backend):
    """fp32 on CUDA, every backend, with preemption forced by a small pool."""
    llm = LLM(
        checkpoint,
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        num_gpu_blocks=24,
        block_size=8,
    )
    assert greedy(llm, prompts) == hf_greedy(checkpoint, prompts, torch.float32)
    assert llm.stats()["num_preemptions"] > 0
    assert_all_free(llm)


def test_cuda_backend_equals_torch_backend(checkpoint, prompts):
    """Greedy tokens with the CUDA kernels equal the torch reference's, with the engine's
    default block size.  (fp32: in bf16 a near-tie may round either way.)"""
    outs = {}
    for backend in ("torch", "cuda"):
        llm = LLM(
            checkpoint,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            num_gpu_blocks=64,
            block_size=16,
        )
        outs[backend] = greedy(llm, prompts)
        assert_all_free(llm)
    assert outs["cuda"] == outs["torch"]


def test_pool_sized_by_profiling_fits_the_memory_share(checkpoint, prompts):
    """Without ``num_gpu_blocks`` the pool takes what ``gpu_memory_utilization`` leaves:
    some blocks, and no more than the share allows."""
    share = 0.3
    llm = LLM(checkpoint, device="cuda", gpu_memory_utilization=share)
    free, total = torch.cuda.mem_get_info()
    assert llm.stats()["num_gpu_blocks"] > 0
    assert torch.cuda.memory_allocated() <= share * total
    assert len(greedy(llm, prompts)) == len(prompts)
    assert_all_free(llm)


def test_auto_backend_picks_a_gpu_kernel(checkpoint):
    llm = LLM(checkpoint, device="cuda", num_gpu_blocks=64)
    assert llm.engine.attention_backend in ("triton", "cuda")


def _outputs(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_async_scheduling_on_the_gpu_gives_the_same_tokens(checkpoint, prompts, backend):
    """With ``async_scheduling`` a worker thread replays the decode graphs while this
    one schedules the next step: greedy tokens are Hugging Face's, and greedy and
    seeded sampling equal the synchronous engine's."""
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS),
    ]
    outs = {}
    for on in (False, True):
        llm = LLM(
            checkpoint,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            num_gpu_blocks=64,
            async_scheduling=on,
        )
        assert llm.engine.runner.graphs is not None
        outs[on] = [_outputs(llm, prompts, p) for p in params]
        assert_all_free(llm)
    assert outs[True][0] == hf_greedy(checkpoint, prompts, torch.float32)
    assert outs[True] == outs[False]


@pytest.mark.parametrize("method", ["gptq", "awq", "int8", "fp8"])
def test_quantized_weights_on_the_gpu_equal_hf_on_what_they_stand_for(
    checkpoint, prompts, tmp_path, method
):
    """INT4 checkpoints that ``minipaged quantize`` writes, read by the CPU tests' own
    reading of each format, and int8/fp8 online, whose weights the CPU tests round by
    the rule: Hugging Face's greedy tokens on those weights, float32 on the GPU.  The
    integer ones run the Triton GEMM (in IEEE precision) inside the decode graphs."""
    from minipaged.cli import main as cli
    from test_quantization import dequantized_checkpoint, rounded_checkpoint

    if method in ("int8", "fp8"):
        path, quantization = checkpoint, method
        dense = rounded_checkpoint(Path(checkpoint), tmp_path / "rounded", method)
    else:
        path, quantization = tmp_path / method, None  # detected from config.json
        flags = ["--desc-act", "--no-sym"] if method == "gptq" else []
        quantize = ["--group-size", "32", "--num-samples", "4", "--seq-len", "64"]
        cli(["quantize", str(checkpoint), str(path), "--method", method, *flags, *quantize])
        dense = dequantized_checkpoint(path, tmp_path / "dense")
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        num_gpu_blocks=64,
        quantization=quantization,
    )
    assert llm.engine.runner.graphs is not None
    assert greedy(llm, prompts) == hf_greedy(dense, prompts, torch.float32)
    assert_all_free(llm)

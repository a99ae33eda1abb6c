"""The engine on CUDA: the pool sized by profiling, and every attention backend giving
Hugging Face's greedy tokens.  All ``gpu``-marked: they skip on a CPU-only machine and
run with ``make gpu-test`` on a GPU one."""

import warnings
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
    """With ``async_scheduling`` the next step is scheduled while the GPU replays this
    one's decode graph, and launched before this one is updated: greedy tokens are
    Hugging Face's, and greedy and seeded sampling equal the synchronous engine's."""
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


def test_async_scheduling_is_on_by_default_on_the_gpu(checkpoint, prompts):
    """No ``async_scheduling`` given: on a GPU it is on (vLLM 0.14's default), steps run
    ahead, and the greedy tokens are Hugging Face's."""
    llm = LLM(checkpoint, device="cuda", dtype="float32", num_gpu_blocks=64)
    assert llm.engine.config.async_scheduling is True
    assert greedy(llm, prompts) == hf_greedy(checkpoint, prompts, torch.float32)
    assert llm.engine.num_steps_ahead > 0
    assert_all_free(llm)


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


def _sampled_ids_copy() -> tuple[Path, int]:
    """The sampler's line that copies the sampled ids to the host: the one wait for the
    device a step needs (found by its text, not by its number)."""
    from minipaged.sample import sampler

    path = Path(sampler.__file__).resolve()
    lines = [
        i for i, line in enumerate(path.read_text().splitlines(), 1) if "next_ids.tolist()" in line
    ]
    assert len(lines) == 1, lines
    return path, lines[0]


def _waits(step) -> tuple[list, list[tuple[Path, int]]]:
    """``step()``'s result and the lines where it made the host wait for the device:
    torch's sync debug mode warns at each synchronizing call, from its Python line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = [
        (Path(w.filename).resolve(), w.lineno) for w in caught if "synchroniz" in str(w.message)
    ]
    return result, sites


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_decode_step_waits_for_the_gpu_only_for_the_sampled_ids(
    checkpoint, prompts, async_scheduling
):
    """Each decode step's host waits for the device once, for the sampled ids (vLLM V1's
    one sync a step): the inputs, the sampling parameters, the rows and the condensed
    block table rows cross from pinned buffers.  Greedy and random rows mixed, requests
    finishing at different steps (rows freed and condensed, the sampling rows changed);
    then requests joining (their parameters copied), whose steps also run a prefill and
    may wait there, but never in the code that stages the inputs.  The greedy rows give
    Hugging Face's tokens."""
    from minipaged.sample import metadata
    from minipaged.worker import cpu_gpu_buffer, input_batch

    llm = LLM(
        checkpoint,
        device="cuda",
        dtype="float32",
        num_gpu_blocks=128,
        async_scheduling=async_scheduling,
    )
    engine, sampled_ids = llm.engine, _sampled_ids_copy()
    hf = hf_greedy(checkpoint, prompts, torch.float32)
    greedy_max = {}
    for i, prompt in enumerate(prompts):
        n = MAX_TOKENS - 3 * i  # each finishes at its own step
        greedy_max[f"greedy-{i}"] = i, n
        engine.add_request(f"greedy-{i}", prompt, SamplingParams(temperature=0, max_tokens=n))
        random = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=n - 1)
        engine.add_request(f"random-{i}", prompt, random)
    outputs = []
    for _ in range(3):  # the prompts in, and a first decode step
        outputs += engine.step()
    decode_waits = []
    while engine.has_unfinished_requests():
        out, sites = _waits(engine.step)
        outputs += out
        decode_waits.append(sites)
    assert len(decode_waits) > 10
    unexpected = [
        (step, sites) for step, sites in enumerate(decode_waits) if sites != [sampled_ids]
    ]
    assert not unexpected, "\n".join(f"decode step {step}: {sites}" for step, sites in unexpected)

    staging = {Path(m.__file__).resolve() for m in (metadata, input_batch, cpu_gpu_buffer)}
    for i, prompt in enumerate(prompts[:3]):  # joining one at a time, while others decode
        engine.add_request(f"late-{i}", prompt, SamplingParams(temperature=0.5, max_tokens=8))
        engine.add_request(f"late-greedy-{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
    joined_waits = []
    while engine.has_unfinished_requests():
        out, sites = _waits(engine.step)
        outputs += out
        joined_waits += sites
    assert not [site for site in joined_waits if site[0] in staging], joined_waits

    tokens = {o.request_id: o.outputs[0].token_ids for o in outputs}
    for request_id, (i, n) in greedy_max.items():
        assert tokens[request_id] == hf[i][:n], request_id
    for i in range(3):
        assert tokens[f"late-greedy-{i}"] == hf[i][:8]
    # The parameters on the device are the host's (the float32 table's top-k exact).
    batch = engine.parallel_sampling.input_batch
    for name, on_device in batch._on_device().items():
        host = getattr(batch, name)
        assert torch.equal(on_device.cpu(), host), name
    assert set(batch._on_device()) == set(metadata.PARAMS)
    assert_all_free(llm)

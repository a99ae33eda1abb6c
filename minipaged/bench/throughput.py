"""``minipaged bench throughput``: offline serving throughput, minipaged vs Hugging Face
``generate`` (paper §6.2, Fig. 12-13, at our scale).

Every system completes the same synthetic ShareGPT-like requests (`workloads`): random
prompt token ids of the drawn prompt lengths, each request generating exactly its drawn
output length (``ignore_eos``, as vLLM's ``benchmark_throughput`` does), sampled at
temperature 1.  Systems:

- ``minipaged-<backend>``: ``LLM.generate`` on all requests at once, one row per
  attention backend (continuous batching and paged KV, §4.5);
- ``hf-generate``: transformers' ``generate``, one request at a time, on the same
  weights in the same dtype: what a naive server does;
- ``hf-generate-batch``: ``generate`` over fixed-size batches in arrival order, left
  padded; a batch runs until its longest request is done (``max_new_tokens`` = the
  longest wanted output), so its shorter requests' extra tokens are wasted work: only
  each request's wanted tokens count as output (static batching, the paper's §3
  complaint about reserving for the maximum).

Lengths.  ShareGPT lengths are drawn for a 2048-token context (the paper's OPT models,
`PAPER_CONTEXT`), then multiplied by ``length_scale * min(1, max_model_len / 2048)``
(rounded, at least 1 token), so a model with a shorter context keeps the distribution's
shape and its longest request still fits; ``length_scale`` < 1 shrinks the workload for
a CPU run.  The timings are wall-clock after a warm-up run of each system (Triton
compiles its kernels, caches are allocated), with the GPU synchronised around them.
On a CPU every system runs on one thread (`one_cpu_thread`).  One request at a time
is slow, so a preset may run the HF baselines on the first requests only; every row
records how many it ran, and its rates are over those.

The engine's own overhead.  A serving step is also Python: scheduling, block-table
bookkeeping, building the attention metadata, sampling and the update phase.
`measure_engine_overhead` runs the engine at 256 running sequences with the model's
forward replaced by a stub returning zero hidden states, so that everything but the
model runs, and reports milliseconds per decode step and where they go (a batch that
spends longer in Python than on the GPU leaves the GPU idle; our goal is 2 ms).  On a
CPU the sampler's random draws over 256 x vocab probabilities are a large part of it,
so the bookkeeping alone (schedule, block operations, inputs, update: `BOOKKEEPING`)
is reported beside the total.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from tqdm.auto import tqdm

from minipaged.bench import common
from minipaged.bench.args import (
    SYNTHETIC_MODEL_HELP,
    add_engine_flags,
    add_model_flag,
    add_output_flags,
    bench_model,
    engine_kwargs,
    model_record,
    write,
)
from minipaged.bench.common import Column, free_memory, one_cpu_thread, sync, timed
from minipaged.bench.results import device_name
from minipaged.models.tiny import cached_checkpoint
from minipaged.ops import BackendUnavailableError, get_backend
from minipaged.workloads import RequestSpec, synthetic_requests

NAME = "throughput"
HELP = "offline throughput: minipaged vs Hugging Face generate"
DESCRIPTION = (
    "Complete the same synthetic ShareGPT-like requests (ignore_eos) with "
    "minipaged on each attention backend, transformers' generate one "
    "request at a time and in padded batches; report requests/s and output "
    "tokens/s, and the engine's own CPU time per step with the model stubbed."
)
SYSTEMS = (
    "minipaged-torch",
    "minipaged-cpu",
    "minipaged-triton",
    "minipaged-cuda",
    "hf-generate",
    "hf-generate-batch",
    "hf-continuous-batching",
)
# hf-generate-batch is generate() on static, left-padded batches (the paper's "HF"
# baseline); hf-continuous-batching is transformers 5's own continuous batching over
# paged attention (what `model.generate_batch` runs), every request queued at once.
HF_SYSTEMS = ("hf-generate", "hf-generate-batch", "hf-continuous-batching")
PAPER_CONTEXT = 2048  # the context ShareGPT lengths are drawn for (OPT's, paper §6.1)
OVERHEAD_GOAL_MS = 2.0
# A decode step's phases, in step order (`measure_engine_overhead`).
PHASES = (
    "schedule",
    "block_ops",
    "prepare_inputs",
    "model_stub",
    "logits",
    "sample",
    "update",
    "other",
)
# The engine's own Python, which a GPU would wait on: all but the model and the
# sampler's tensor math (on a GPU that runs on the device; on a CPU its random draws
# over 256 x vocab probabilities cost more than all the bookkeeping).
BOOKKEEPING = ("schedule", "block_ops", "prepare_inputs", "update", "other")

# The gpu preset's synthetic model when no --model is given: Llama-3.2-1B's shape
# (16 layers, hidden 2048, GQA 32/8 heads of 64, 32 KB of KV per token) without its
# 128k vocabulary, about 1B parameters, run in bfloat16.  At 256 sequences of ShareGPT
# length a decode step reads gigabytes of KV, so the attention kernels matter as they
# do in the paper; it is written once (4 GB of float32) to the cache.
GPU_MODEL = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)
# The qwen2.5-0.5b preset's model: Qwen2.5-0.5B's public config.json (24 layers, hidden
# 896, GQA 14/2 heads of 64, q/k/v biases, a tied 151,936-row embedding), random bf16
# weights; the shape of the end-to-end comparison with Hugging Face on a GPU.
QWEN_MODEL = dict(
    arch="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    torch_dtype="bfloat16",
)


@dataclass(frozen=True)
class Preset:
    """One benchmark setting.  ``hf_num_requests`` and ``hf_batch_num_requests`` cap
    the requests the Hugging Face baselines run (the first ones of the same list; None:
    all), because one request at a time takes minutes where the engine takes seconds;
    each row says how many requests it ran."""

    device: str
    num_requests: int
    length_scale: float
    hf_num_requests: int | None
    hf_batch_num_requests: int | None
    hf_batch_size: int
    model: dict = field(default_factory=dict)  # make_tiny_model overrides


PRESETS = {
    # The tiny checkpoint (1024 positions: lengths / 2), halved again: seconds on one core.
    "cpu": Preset(
        "cpu",
        num_requests=48,
        length_scale=0.5,
        hf_num_requests=None,
        hf_batch_num_requests=None,
        hf_batch_size=8,
    ),
    # Full ShareGPT lengths; half of vLLM's benchmark_throughput default of 1000
    # requests, so that every system, the slow torch backend included, fits in minutes.
    "gpu": Preset(
        "cuda",
        num_requests=500,
        length_scale=1.0,
        hf_num_requests=8,
        hf_batch_num_requests=64,
        hf_batch_size=32,
        model=GPU_MODEL,
    ),
    # vLLM's benchmark_throughput default of 1000 requests, on Qwen2.5-0.5B's shape.
    "qwen2.5-0.5b": Preset(
        "cuda",
        num_requests=1000,
        length_scale=1.0,
        hf_num_requests=8,
        hf_batch_num_requests=64,
        hf_batch_size=32,
        model=QWEN_MODEL,
    ),
}


def default_preset() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def preset_device(preset: str, device: str = "auto", presets: dict | None = None) -> torch.device:
    """``device`` unless ``"auto"``, else ``preset``'s, checked to exist.  ``presets``:
    another benchmark's (block size, preemption, latency), default this module's."""
    presets = PRESETS if presets is None else presets
    if preset not in presets:
        raise ValueError(f"preset must be one of {list(presets)}, got {preset!r}")
    device = torch.device(presets[preset].device if device == "auto" else device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"preset {preset!r} needs a CUDA GPU, and torch sees none "
            "(pass --device cpu or --preset cpu)"
        )
    return device


def check_setting(
    num_requests: int,
    length_scale: float,
    hf_num_requests: int | None,
    hf_batch_num_requests: int | None,
    hf_batch_size: int,
) -> None:
    """Raise ``ValueError`` naming the first bad value, before anything runs."""
    for name, value in (
        ("num_requests", num_requests),
        ("hf_num_requests", hf_num_requests),
        ("hf_batch_num_requests", hf_batch_num_requests),
        ("hf_batch_size", hf_batch_size),
    ):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale!r}")


def preset_model(preset: str, presets: dict | None = None) -> Path:
    """The preset's synthetic checkpoint, written to the cache on first use; presets of
    the same name in other benchmarks share it."""
    presets = PRESETS if presets is None else presets
    return cached_checkpoint(f"bench-{preset}", **presets[preset].model)


def available_systems(device: torch.device) -> list[str]:
    """``minipaged-<backend>`` for every backend that really runs on ``device`` (on a
    CPU Triton would only be interpreted, so not there), then both HF baselines."""
    backends = ["triton", "cuda", "torch"] if device.type == "cuda" else ["cpu", "torch"]
    return [f"minipaged-{b}" for b in backends if _backend_error(b, device) is None] + list(
        HF_SYSTEMS
    )


def _backend_error(backend: str, device: torch.device) -> str | None:
    if device.type == "cpu" and backend == "triton":
        return "on a CPU Triton runs only in its interpreter, whose timings mean nothing"
    try:
        get_backend(backend, device)
    except BackendUnavailableError as error:
        return str(error)
    return None


# -- the workload ---------------------------------------------------------------------
def make_requests(
    num_requests: int, max_model_len: int, length_scale: float = 1.0, seed: int = 0
) -> list[RequestSpec]:
    """ShareGPT-like lengths scaled to fit ``max_model_len`` (see the module docstring)."""
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    scale = length_scale * min(1.0, max_model_len / PAPER_CONTEXT)
    requests = []
    for r in synthetic_requests("sharegpt", num_requests, seed=seed, max_len=PAPER_CONTEXT):
        prompt = min(max(1, round(r.prompt_len * scale)), max_model_len - 1)
        output = min(max(1, round(r.output_len * scale)), max_model_len - prompt)
        requests.append(RequestSpec(prompt, output))
    return requests


@dataclass
class Workload:
    config: object  # the checkpoint's HF config
    requests: list[RequestSpec]
    prompts: list[list[int]]
    max_model_len: int
    scale: float  # what the drawn ShareGPT lengths were multiplied by


def make_workload(
    path,
    num_requests: int,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    seed: int = 0,
) -> Workload:
    """The requests and their prompt token ids for the checkpoint at ``path`` (a
    directory, a ``.gguf`` file or a model name such as ``smollm2``: `resolve_model`)."""
    from transformers import AutoTokenizer

    from minipaged.models.hub import resolve_model
    from minipaged.models.loader import read_config
    from minipaged.models.resolve import resolve_max_model_len

    path = resolve_model(path)
    config = read_config(path)
    max_model_len = resolve_max_model_len(max_model_len, config)
    requests = make_requests(num_requests, max_model_len, length_scale, seed)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Workload(
        config,
        requests,
        make_prompts(requests, tokenizer, config.vocab_size, seed),
        max_model_len,
        length_scale * min(1.0, max_model_len / PAPER_CONTEXT),
    )


def model_dtype(config, dtype: str = "auto") -> str:
    """The dtype both minipaged and HF run the checkpoint in, e.g. ``"bfloat16"``."""
    from minipaged.models.loader import resolve_dtype

    return str(resolve_dtype(dtype, config)).removeprefix("torch.")


def make_prompts(
    requests: Sequence[RequestSpec], tokenizer, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Random prompts of the requested lengths, from the tokenizer's ordinary tokens
    (no special tokens, no padding rows of the embedding)."""
    special = set(tokenizer.all_special_ids)
    usable = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(usable, k=r.prompt_len) for r in requests]


@dataclass
class SystemRun:
    """One system's result row, and how many tokens it made for each request it ran:
    ``generated`` what it computed, ``output`` what counts (the wanted tokens)."""

    row: dict
    generated: list[int]
    output: list[int]


def _row(
    system: str, requests: Sequence[RequestSpec], output: list[int], elapsed: float, **extra
) -> dict:
    prompt_tokens = sum(r.prompt_len for r in requests)
    return {
        "system": system,
        "num_requests": len(requests),
        "output_tokens_per_s": sum(output) / elapsed,
        "requests_per_s": len(requests) / elapsed,
        "elapsed_s": elapsed,
        "output_tokens": sum(output),
        "prompt_tokens": prompt_tokens,
        "total_tokens_per_s": (prompt_tokens + sum(output)) / elapsed,
        **extra,
    }


# -- minipaged ------------------------------------------------------------------------
def run_minipaged(
    path,
    backend: str,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    progress: bool = True,
) -> SystemRun:
    """All requests through ``LLM.generate`` at once, after a warm-up."""
    from minipaged.distributed.parallel_state import COMM
    from minipaged.llm import LLM
    from minipaged.sampling_params import SamplingParams

    llm = LLM(str(path), **{**engine_kwargs, "attention_backend": backend})
    device, tp = llm.engine.device, llm.engine.config.tensor_parallel_size
    system = f"minipaged-{backend}" + (f"-tp{tp}" if tp > 1 else "")
    try:
        # Warm-up: a lone request, then a full batch, so the kernels the timed run
        # launches (one and many sequences, prefill and decode) are compiled.
        for count in (1, min(len(prompts), llm.engine.config.max_num_seqs)):
            llm.generate(
                [{"prompt_token_ids": p} for p in prompts[:count]],
                SamplingParams(max_tokens=4, ignore_eos=True),
                use_tqdm=False,
            )
        before, comm_before = llm.stats(), dict(COMM.seconds)
        params = [
            SamplingParams(temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=True)
            for r in requests
        ]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs, elapsed = timed(
            functools.partial(llm.generate, inputs, params, use_tqdm=progress), device
        )
        after = llm.stats()
        steps = after["num_steps"] - before["num_steps"]
        # The driver's time in collectives (waiting for the slowest rank included).
        comm_ms = {
            kind: 1e3 * (s - comm_before.get(kind, 0.0)) / steps for kind, s in COMM.seconds.items()
        }
    finally:
        del llm
        free_memory(device)
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    _check_lengths(system, generated, requests)
    return SystemRun(
        _row(
            system,
            requests,
            generated,
            elapsed,
            attention_backend=backend,
            num_steps=steps,
            num_preemptions=after["num_preemptions"] - before["num_preemptions"],
            tensor_parallel_size=tp,
            comm_ms_per_step=comm_ms,
        ),
        generated,
        generated,
    )


def _check_lengths(system: str, generated: list[int], requests: Sequence[RequestSpec]) -> None:
    # ignore_eos: anything else is a bug, and its tokens/s would be a lie.
    wrong = [
        (i, g, r.output_len)
        for i, (g, r) in enumerate(zip(generated, requests))
        if g != r.output_len
    ]
    if wrong:
        i, got, wanted = wrong[0]
        raise RuntimeError(
            f"{system}: request {i} generated {got} tokens, wanted {wanted} "
            f"({len(wrong)} requests wrong)"
        )


# -- Hugging Face ---------------------------------------------------------------------
def load_hf_model(path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.to(device).eval()


@contextlib.contextmanager
def _quiet_transformers():
    """generate() warns about every sampling default it overrides; once per batch is noise."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def _hf_batch(
    model, prompts: Sequence[list[int]], max_new_tokens: int, pad_id: int, device: torch.device
) -> int:
    """One left-padded ``generate`` call; returns the new tokens per row, checked.

    ``min_new_tokens`` masks EOS until ``max_new_tokens``: HF's ``ignore_eos``."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
        )
    new = out.shape[1] - width
    if new != max_new_tokens:
        raise RuntimeError(f"HF generate made {new} tokens per row, wanted {max_new_tokens}")
    return new


def run_hf(
    model,
    system: str,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    batch_size: int,
    pad_id: int,
    progress: bool = True,
) -> SystemRun:
    """``hf-generate`` (``batch_size`` 1) or ``hf-generate-batch``: requests in arrival
    order, ``batch_size`` at a time, after a warm-up."""
    if batch_size < 1:
        raise ValueError(f"hf_batch_size must be >= 1, got {batch_size!r}")
    device = next(model.parameters()).device
    batches = [
        range(i, min(i + batch_size, len(requests))) for i in range(0, len(requests), batch_size)
    ]
    generated = [0] * len(requests)

    def run():
        for batch in tqdm(batches, desc=system, unit="batch", disable=not progress, leave=False):
            new = _hf_batch(
                model,
                [prompts[i] for i in batch],
                max(requests[i].output_len for i in batch),
                pad_id,
                device,
            )
            for i in batch:
                generated[i] = new

    with _quiet_transformers():
        _hf_batch(model, [prompts[i] for i in batches[0]], 4, pad_id, device)  # warm-up
        _, elapsed = timed(run, device)
    output = [r.output_len for r in requests]  # the wanted ones; the rest is padding work
    extra = {"batch_size": batch_size, "generated_tokens": sum(generated)}
    return SystemRun(_row(system, requests, output, elapsed, **extra), generated, output)


def run_hf_continuous(
    path,
    dtype: torch.dtype,
    device: torch.device,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    progress: bool = True,
) -> SystemRun:
    """``hf-continuous-batching``: transformers' continuous batching manager (the engine
    behind ``generate_batch``) over SDPA; each request added with its own
    ``max_new_tokens`` and no EOS, after a warm-up, all at once."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # Older transformers name the paged SDPA "paged|sdpa"; newer ones page plain "sdpa"
    # under continuous batching and warn about the prefix.
    sdpa = "paged|sdpa" if "paged|sdpa" in ALL_ATTENTION_FUNCTIONS else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype, attn_implementation=sdpa
    )
    model = model.to(device).eval()
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=-1, pad_token_id=0
    )  # -1: no token ends a request
    generated = [0] * len(requests)

    def run(manager, todo: Sequence[int], lengths: Sequence[int]) -> None:
        for i in todo:
            manager.add_request(list(prompts[i]), request_id=str(i), max_new_tokens=lengths[i])
        for _ in tqdm(
            todo, desc="hf-continuous-batching", unit="req", disable=not progress, leave=False
        ):
            result = manager.get_result(timeout=600)
            if result is None or result.error:
                raise RuntimeError(f"hf-continuous-batching: {result and result.error}")
            generated[int(result.request_id)] = len(result.generated_tokens)

    with _quiet_transformers(), torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            run(manager, range(min(8, len(requests))), [4] * len(requests))  # warm-up
            output = [r.output_len for r in requests]
            _, elapsed = timed(lambda: run(manager, range(len(requests)), output), device)
        finally:
            manager.stop(block=True)
            del model
            free_memory(device)
    _check_lengths("hf-continuous-batching", generated, requests)
    return SystemRun(_row("hf-continuous-batching", requests, output, elapsed), generated, output)


# -- the whole benchmark --------------------------------------------------------------
@dataclass
class ThroughputBench:
    rows: list[dict]
    runs: dict[str, SystemRun]
    notes: list[str]


def bench_throughput(
    path,
    systems: Sequence[str],
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    hf_num_requests: int | None = None,
    hf_batch_num_requests: int | None = None,
    hf_batch_size: int = 8,
    progress: bool = True,
) -> ThroughputBench:
    """Run each of ``systems`` on ``requests`` (the HF ones on the first
    ``hf_num_requests`` / ``hf_batch_num_requests`` of them).  ``engine_kwargs`` are
    ``LLM``'s, less ``attention_backend``; their ``device`` and ``dtype`` apply to HF too.
    A system that cannot run here gets a note; none at all is a ``ValueError``.
    ``path`` is resolved as ``LLM``'s ``model`` is (`resolve_model`), for HF too."""
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"systems must be a non-empty subset of {SYSTEMS}, got {list(systems)}")
    from minipaged.models.hub import resolve_model
    from minipaged.models.resolve import resolve_device

    path = resolve_model(path)

    device = resolve_device(engine_kwargs.get("device", "auto"))
    load = _load_note("before")
    with one_cpu_thread(device):
        runs, notes = _run_systems(
            path,
            systems,
            requests,
            prompts,
            engine_kwargs,
            device,
            hf_num_requests,
            hf_batch_num_requests,
            hf_batch_size,
            progress,
        )
    notes += [load, _load_note("after")]
    if not runs:
        raise ValueError(f"systems {list(systems)} could not run here: " + "; ".join(notes))
    return ThroughputBench([runs[s].row for s in systems if s in runs], runs, notes)


def _load_note(when: str) -> str:
    """The machine's load, for the record: on a shared CPU other processes slow every
    system, so compare the systems of one run, not runs of different days."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"load average (1, 5, 15 min) {when} the runs: {load} on {os.cpu_count()} CPUs"


def _run_systems(
    path,
    systems,
    requests,
    prompts,
    engine_kwargs,
    device,
    hf_num_requests,
    hf_batch_num_requests,
    hf_batch_size,
    progress,
):
    runs, notes = {}, []
    for system in systems:
        if system.startswith("minipaged-"):
            backend = system.removeprefix("minipaged-")
            if error := _backend_error(backend, device):
                notes.append(f"skipped {system}: {error}")
                tqdm.write(notes[-1])
                continue
            try:
                runs[system] = run_minipaged(
                    path, backend, requests, prompts, engine_kwargs, progress
                )
            except torch.cuda.OutOfMemoryError as error:
                # The torch backend gathers each sequence's K/V densely, beyond what the
                # KV pool's sizing (profiled on a prefill) left free; the others still run.
                notes.append(
                    f"skipped {system}: out of GPU memory "
                    f"({str(error).splitlines()[0]}); try --gpu-memory-utilization 0.7"
                )
                tqdm.write(notes[-1])
            free_memory(device)  # here, not in the handler: its traceback holds the engine
    if "hf-continuous-batching" in systems:
        runs["hf-continuous-batching"] = _run_hf_continuous(
            path, requests, prompts, engine_kwargs, device, progress
        )
    hf = [s for s in systems if s in ("hf-generate", "hf-generate-batch")]
    if hf:
        runs.update(
            _run_hf_systems(
                path,
                hf,
                requests,
                prompts,
                engine_kwargs,
                device,
                hf_num_requests,
                hf_batch_num_requests,
                hf_batch_size,
                progress,
            )
        )
    return runs, notes


def _run_hf_continuous(path, requests, prompts, engine_kwargs, device, progress) -> SystemRun:
    from transformers import AutoConfig

    from minipaged.models.loader import resolve_dtype

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    dtype = resolve_dtype(engine_kwargs.get("dtype", "auto"), config)
    return run_hf_continuous(path, dtype, device, requests, prompts, progress)


def _run_hf_systems(
    path,
    systems,
    requests,
    prompts,
    engine_kwargs,
    device,
    hf_num_requests,
    hf_batch_num_requests,
    hf_batch_size,
    progress,
) -> dict[str, SystemRun]:
    from transformers import AutoConfig

    from minipaged.models.loader import resolve_dtype

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = load_hf_model(path, resolve_dtype(engine_kwargs.get("dtype", "auto"), config), device)
    pad_id = next(
        (i for i in (config.pad_token_id, config.eos_token_id, 0) if isinstance(i, int)), 0
    )
    runs = {}
    try:
        for system in systems:
            batch, count = (
                (1, hf_num_requests)
                if system == "hf-generate"
                else (hf_batch_size, hf_batch_num_requests)
            )
            count = len(requests) if count is None else min(count, len(requests))
            runs[system] = run_hf(
                model, system, requests[:count], prompts[:count], batch, pad_id, progress
            )
    finally:
        del model
        free_memory(device)
    return runs


# -- the engine's own overhead --------------------------------------------------------
class _ZeroModel:
    """Stands in for the model's forward: zero hidden states of the right shape, at no
    cost; ``compute_logits`` stays the real LM head (on zeros: uniform logits)."""

    def __init__(self, model, timer: _PhaseTimer | None = None) -> None:
        self.model, self.config, self.timer = model, model.config, timer
        self.dtype = model.model.embed_tokens.weight.dtype

    def __call__(self, input_ids, positions, kv_caches, attn):
        with self.timer.phase("model_stub") if self.timer else contextlib.nullcontext():
            return torch.zeros(
                input_ids.shape[0],
                self.config.hidden_size,
                dtype=self.dtype,
                device=input_ids.device,
            )

    def compute_logits(self, hidden):
        with self.timer.phase("logits") if self.timer else contextlib.nullcontext():
            return self.model.compute_logits(hidden)


class _PhaseTimer:
    """Seconds spent per named phase; nested phases are subtracted from their parent,
    and the GPU is synchronised at every boundary so work lands in its own phase."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self._stack = device, defaultdict(float), []

    @contextlib.contextmanager
    def phase(self, name: str):
        sync(self.device)
        start, self._stack = time.perf_counter(), [*self._stack, name]
        try:
            yield
        finally:
            sync(self.device)
            elapsed = time.perf_counter() - start
            self._stack.pop()
            self.seconds[name] += elapsed
            if self._stack:  # the parent's own time excludes this phase
                self.seconds[self._stack[-1]] -= elapsed

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed


def measure_engine_overhead(
    path,
    device: torch.device | str = "cpu",
    num_seqs: int = 256,
    prompt_len: int = 128,
    num_steps: int = 50,
    block_size: int = 16,
    seed: int = 0,
) -> dict:
    """Milliseconds per decode step of the engine at ``num_seqs`` running sequences with
    the model stubbed out (`_ZeroModel`): scheduling, block bookkeeping, metadata,
    sampling 256 cheap rows and the update phase.

    ``num_seqs`` requests of ``prompt_len`` random tokens are admitted and prefilled
    until every one decodes; then ``num_steps`` steps are timed bare (the headline
    number), and as many again with each phase timed, GPU synchronised between phases
    (the breakdown, which sums to its own, slightly larger, total).
    """
    from minipaged.config import EngineConfig
    from minipaged.engine import LLMEngine
    from minipaged.memory.block_table import blocks_for
    from minipaged.sampling_params import SamplingParams

    warmup, budget = 5, max(2048, num_seqs)  # budget: max_num_batched_tokens' default
    # Nobody may finish while timed: early prefills decode while later ones still run.
    max_tokens = -(-num_seqs * prompt_len // budget) + warmup + 2 * num_steps + 8
    per_seq = blocks_for(prompt_len + max_tokens, block_size)
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            device=str(torch.device(device).type),
            block_size=block_size,
            num_gpu_blocks=num_seqs * per_seq,
            swap_space=0,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=budget,
            attention_backend="torch",
            seed=seed,
        )
    )
    engine.runner.model = _ZeroModel(engine.runner.model)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(256) for _ in range(prompt_len)], params)
    try:
        while engine.scheduler.waiting or any(
            s.num_uncomputed_tokens > 1 for g in engine.requests.values() for s in g.seqs
        ):
            engine.step()
        for _ in range(warmup):
            engine.step()
        _check_all_running(engine, num_seqs)
        with one_cpu_thread(engine.device):
            _, bare = timed(lambda: [engine.step() for _ in range(num_steps)], engine.device)
            breakdown = _phase_breakdown(engine, num_steps)
        _check_all_running(engine, num_seqs)  # still: every timed step ran them all
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
    return {
        "ms_per_step": bare / num_steps * 1e3,
        "num_seqs": num_seqs,
        "prompt_len": prompt_len,
        "num_steps": num_steps,
        "breakdown_ms": breakdown,
        "bookkeeping_ms_per_step": sum(breakdown[f"{p}_ms"] for p in BOOKKEEPING),
    }


def _check_all_running(engine, num_seqs: int) -> None:
    running = engine.scheduler.num_running_seqs()
    if running != num_seqs:
        raise RuntimeError(f"{running} of {num_seqs} sequences are running")


def _phase_breakdown(engine, num_steps: int) -> dict[str, float]:
    """Time ``num_steps`` steps phase by phase: the engine's parts are wrapped on the
    instance (the sampler, a module-level function, is patched where it is called)."""
    import minipaged.parallel_sampling as sampling_module

    timer = _PhaseTimer(engine.device)
    engine.runner.model.timer = timer
    originals = {
        "scheduler.schedule": engine.scheduler.schedule,
        "cache_engine.execute": engine.cache_engine.execute,
        "runner.execute": engine.runner.execute,
        "sample": engine.sample,
        "output_processor.update_from_output": engine.output_processor.update_from_output,
    }
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.cache_engine.execute = timer.wrap("block_ops", engine.cache_engine.execute)
    engine.runner.execute = timer.wrap("prepare_inputs", engine.runner.execute)
    # The update: choosing tokens around the sampler's own work, then applying them.
    engine.sample = timer.wrap("update", engine.sample)
    engine.output_processor.update_from_output = timer.wrap(
        "update", engine.output_processor.update_from_output
    )
    try:
        with mock.patch.object(
            sampling_module, "sample", timer.wrap("sample", sampling_module.sample)
        ):
            for _ in range(num_steps):
                with timer.phase("other"):
                    engine.step()
    finally:
        for name in originals:  # back to the class's methods
            owner, _, attr = name.rpartition(".")
            delattr(engine if not owner else getattr(engine, owner), attr)
        engine.runner.model.timer = None
    return {f"{p}_ms": timer.seconds[p] / num_steps * 1e3 for p in PHASES}


# -- output ---------------------------------------------------------------------------
def format_table(rows: list[dict], overhead: dict | None = None) -> str:
    lines = [
        common.format_table(
            rows,
            [
                Column("system", "system"),
                Column("requests", "num_requests"),
                Column("output tok", "output_tokens"),
                Column("elapsed s", "elapsed_s", "{:.2f}"),
                Column("req/s", "requests_per_s", "{:.2f}"),
                Column("output tok/s", "output_tokens_per_s", "{:.1f}"),
            ],
        )
    ]
    lines += [
        f"{r['system']}: {sum(r['comm_ms_per_step'].values()):.2f} ms per step in "
        "communication ("
        + ", ".join(f"{k} {v:.2f}" for k, v in r["comm_ms_per_step"].items())
        + ")"
        for r in rows
        if r.get("comm_ms_per_step")
    ]
    if overhead:
        lines += ["", format_overhead(overhead)]
    return "\n".join(lines)


def format_overhead(overhead: dict) -> str:
    parts = "  ".join(
        f"{k.removesuffix('_ms')} {v:.2f}" for k, v in overhead["breakdown_ms"].items()
    )
    return (
        f"engine overhead at {overhead['num_seqs']} running sequences, model stubbed: "
        f"{overhead['ms_per_step']:.2f} ms/step, of which bookkeeping (schedule, block "
        f"ops, inputs, update) {overhead['bookkeeping_ms_per_step']:.2f} ms "
        f"(goal <= {OVERHEAD_GOAL_MS:g} ms)\n"
        f"  where it goes (ms/step, timed separately): {parts}"
    )


def plot_throughput(rows: list[dict], overhead: dict | None = None, device: str = ""):
    """Bars of output tokens/s per system; beside them, the engine's overhead per
    step split into its phases, bookkeeping first and the goal for it dashed.  A
    matplotlib ``Figure``, no pyplot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11 if overhead else 6.5, 4.2), layout="constrained")
    axes = fig.subplots(
        1, 2 if overhead else 1, squeeze=False, width_ratios=[3, 2] if overhead else None
    )[0]
    ax = axes[0]
    most = max(r["num_requests"] for r in rows)
    # A baseline that ran fewer requests says so under its bar.
    labels = [
        r["system"]
        + ("" if r["num_requests"] == most else f"\n(first {r['num_requests']} requests)")
        for r in rows
    ]
    bars = ax.bar(
        labels,
        [r["output_tokens_per_s"] for r in rows],
        color=["tab:blue" if r["system"].startswith("minipaged") else "tab:gray" for r in rows],
    )
    ax.bar_label(bars, fmt="%.0f", fontsize="small")
    ax.set_ylabel("output tokens / s")
    ax.set_title(
        f"offline throughput{f' on {device}' if device else ''}, {most} ShareGPT-like requests"
    )
    ax.tick_params(axis="x", labelrotation=20)
    if overhead:
        ax = axes[1]
        # The bookkeeping phases first, so that where they end faces the goal line; the
        # rest of the step (the stub, the LM head, the sampler) after them, in grey.
        left, rest = 0.0, [p for p in PHASES if p not in BOOKKEEPING]
        for i, phase in enumerate([*BOOKKEEPING, *rest]):
            ms = overhead["breakdown_ms"][f"{phase}_ms"]
            color = f"C{i}" if phase in BOOKKEEPING else str(0.55 + 0.15 * rest.index(phase))
            ax.barh([0], [ms], left=left, label=phase, color=color)
            left += ms
        ax.axvline(
            OVERHEAD_GOAL_MS,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"goal: bookkeeping <= {OVERHEAD_GOAL_MS:g} ms",
        )
        ax.set_yticks([])
        ax.set_xlabel("ms per decode step")
        ax.set_title(f"engine overhead, {overhead['num_seqs']} sequences, model stubbed")
        ax.legend(
            fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, frameon=False
        )
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, SYNTHETIC_MODEL_HELP)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default_preset(),
        help="cpu: the tiny checkpoint, short requests, seconds; gpu: a "
        "Llama-3.2-1B-shaped random model, 500 full-length requests "
        "(default: gpu if CUDA is available)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        metavar="SYSTEM",
        help=f"any of {', '.join(SYSTEMS)} (default: minipaged on every "
        "backend this device runs, and both HF baselines)",
    )
    for flag, help_ in [
        ("--num-requests", "requests of the workload"),
        ("--hf-num-requests", "hf-generate runs the first N of them"),
        ("--hf-batch-num-requests", "hf-generate-batch runs the first N of them"),
        ("--hf-batch-size", "requests per hf-generate-batch call"),
    ]:
        parser.add_argument(flag, type=int, metavar="N", help=f"{help_} (default: the preset's)")
    parser.add_argument(
        "--length-scale",
        type=float,
        metavar="X",
        help="multiply the ShareGPT lengths by X (default: the preset's)",
    )
    parser.add_argument(
        "--overhead-steps",
        type=int,
        default=50,
        metavar="N",
        help="decode steps timed for the engine overhead; 0 skips it (default: %(default)s)",
    )
    add_output_flags(parser, NAME)
    # Backends are systems here; the workload and sampling use --seed.
    add_engine_flags(parser, exclude=("attention_backend",))


def main(args) -> None:
    preset = PRESETS[args.preset]
    device = preset_device(args.preset, args.device)
    # A flag left out takes the preset's value.
    setting = {
        name: getattr(preset, name) if getattr(args, name) is None else getattr(args, name)
        for name in (
            "num_requests",
            "length_scale",
            "hf_num_requests",
            "hf_batch_num_requests",
            "hf_batch_size",
        )
    }
    check_setting(**setting)
    if args.overhead_steps < 0:
        raise ValueError(f"overhead_steps must be >= 0, got {args.overhead_steps}")
    model = bench_model(args)
    work = make_workload(
        model, setting["num_requests"], setting["length_scale"], args.max_model_len, args.seed
    )
    engine = {**engine_kwargs(args), "device": device.type}
    bench = bench_throughput(
        model,
        args.systems or available_systems(device),
        work.requests,
        work.prompts,
        engine,
        setting["hf_num_requests"],
        setting["hf_batch_num_requests"],
        setting["hf_batch_size"],
    )
    overhead = None
    if args.overhead_steps:
        overhead = measure_engine_overhead(
            preset_model("cpu"),
            device,
            num_steps=args.overhead_steps,
            block_size=args.block_size,
            seed=args.seed,
        )
    print(format_table(bench.rows, overhead))
    write(
        args,
        NAME,
        device,
        bench.rows,
        plot_throughput(bench.rows, overhead, device_name(device)),
        **model_record(args, model, device),
        dtype=str(model_dtype(work.config, args.dtype)),
        engine=engine,
        workload={
            "name": "sharegpt",
            "seed": args.seed,
            **setting,
            "max_model_len": work.max_model_len,
            "scale": work.scale,
            "prompt_lens": [r.prompt_len for r in work.requests],
            "output_lens": [r.output_len for r in work.requests],
        },
        engine_overhead_ms_per_step=overhead and overhead["ms_per_step"],
        engine_overhead=overhead,
        notes=bench.notes,
    )

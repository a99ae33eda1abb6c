"""A script every rank of test_launch.py's torchrun runs, as a user's would: build an
``LLM`` with ``distributed_executor_backend="external_launcher"`` and generate greedily.
Only rank 0 gets past ``LLM(...)``; it prints the completions and where each rank ran
as JSON, on the last line of stdout.  ``python launch_driver.py CHECKPOINT PROMPTS_JSON
MAX_TOKENS [SETTINGS_JSON]``."""

from __future__ import annotations

import json
import sys

from minipaged import LLM, SamplingParams


def main(path: str, prompts: list[list[int]], max_tokens: int, settings: dict) -> dict:
    llm = LLM(path, distributed_executor_backend="external_launcher", **settings)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    ranks = [vars(rank) for rank in llm.engine.workers.ranks]
    llm.shutdown()
    return {
        "completions": [[o.outputs[0].token_ids, o.outputs[0].finish_reason] for o in outputs],
        "workers": ranks,
    }


if __name__ == "__main__":
    path, prompts, max_tokens, *settings = sys.argv[1:]
    settings = json.loads(settings[0]) if settings else {}
    print(json.dumps(main(path, json.loads(prompts), int(max_tokens), settings)), flush=True)

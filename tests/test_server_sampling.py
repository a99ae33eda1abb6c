"""The server honours the penalties, min_tokens and stop_token_ids: one request through
the in-process app, with the fields as vLLM's and OpenAI's clients send them, against
``LLM.generate`` on the same checkpoint (itself checked against Hugging Face in
test_penalties.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the server extra; the GPU machine has none

import httpx

from engine_helpers import make_llm, random_prompt
from minipaged import SamplingParams
from server_helpers import ENGINE, MODEL, in_process, wait_idle

FIELDS = {
    "repetition_penalty": 1.4,
    "presence_penalty": 0.6,
    "frequency_penalty": 0.9,
    "min_tokens": 6,
}


def test_penalties_and_min_tokens_through_the_server_equal_llm_generate(tiny):  # noqa: F811
    path, _ = tiny("llama")
    prompt = random_prompt(9, seed=9)
    oracle = make_llm(path, **{k: v for k, v in ENGINE.items() if k != "device"})
    want = oracle.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=10, stop_token_ids=[7], **FIELDS),
        use_tqdm=False,
    )[0].outputs
    plain = oracle.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(n=2, seed=5, temperature=0.8, max_tokens=10, stop_token_ids=[7]),
        use_tqdm=False,
    )[0].outputs
    # The fields change the answer.
    assert [c.token_ids for c in want] != [c.token_ids for c in plain]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "n": 2,
        "seed": 5,
        "temperature": 0.8,
        "max_tokens": 10,
        "stop_token_ids": [7],
        "best_of": 2,
        **FIELDS,
    }
    for base_url, _ in in_process(path):
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        assert [(c["text"], c["finish_reason"]) for c in choices] == [
            (w.text, w.finish_reason) for w in want
        ]
        wait_idle(base_url)  # every block free again

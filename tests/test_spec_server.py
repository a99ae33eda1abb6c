"""``--speculative-config`` on the ``minipaged`` command: ``generate`` prints what
``LLM.generate`` without speculation prints (greedy: the same tokens), and a real
``minipaged serve`` process answers the same text while ``/metrics`` counts vLLM's
``spec_decode`` counters; a malformed flag is refused by argparse, naming it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")  # the server extra; the GPU machine has none

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cli_helpers import run_main  # noqa: E402
from engine_helpers import make_llm  # noqa: E402
from minipaged import SamplingParams  # noqa: E402
from server_helpers import ENGINE, FLAGS, MODEL, metrics, subprocess_server, wait_idle  # noqa: E402

PROMPTS = ["Hello, my name is", "abcabcabcabc"]


def spec_flag(path) -> str:
    return json.dumps({"model": str(path), "num_speculative_tokens": 3})


def greedy_texts(path, max_tokens):
    llm = make_llm(path, **{k: v for k, v in ENGINE.items() if k != "device"})
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_serve_speculates_and_counts(tiny):
    path, _ = tiny("llama")
    expected = greedy_texts(path, 12)
    for base_url in subprocess_server(
        path, MODEL, [*FLAGS, "--speculative-config", spec_flag(path)]
    ):
        answer = httpx.post(
            f"{base_url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPTS, "temperature": 0, "max_tokens": 12},
            timeout=60,
        ).json()
        assert [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])] == expected
        wait_idle(base_url)
        now = metrics(base_url)
        assert now["minipaged:spec_decode_num_drafts_total"] > 0
        accepted = now["minipaged:spec_decode_num_accepted_tokens_total"]
        assert accepted == now["minipaged:spec_decode_num_draft_tokens_total"] > 0  # self-draft
        text = httpx.get(f"{base_url}/metrics").text
        per_position = {
            s.labels["position"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == "minipaged:spec_decode_num_accepted_tokens_per_pos"
            for s in family.samples
            if s.name.endswith("_total")
        }
        assert set(per_position) == {"0", "1", "2"}
        assert sum(per_position.values()) == accepted


def test_generate_flag_and_its_refusals(tiny, capsys):
    path, _ = tiny("llama")
    argv = ["generate", "--model", str(path), "--device", "cpu", "--swap-space", "0.01"]
    greedy = ["--temperature", "0", "--max-tokens", "10"]
    assert run_main([*argv, "--speculative-config", spec_flag(path), *greedy, *PROMPTS]) == 0
    out = capsys.readouterr().out
    for text in greedy_texts(path, 10):
        assert repr(text) in out
    assert run_main([*argv, "--speculative-config", "{not json", *PROMPTS]) == 2
    assert "--speculative-config" in capsys.readouterr().err
    assert run_main([*argv, "--speculative-config", '{"method": "ngram"}', *PROMPTS]) != 0
    assert "num_speculative_tokens" in capsys.readouterr().err

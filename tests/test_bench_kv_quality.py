"""The quality part of ``minipaged bench kv-cache-dtype`` (`minipaged.bench.kv_quality`)
on the tiny checkpoint: ``auto``'s prompt logprobs and multiple-choice answers are
those of Hugging Face transformers on the same weights (the oracle: its
``log_softmax`` at every prompt position, and the choice whose tokens' logprobs sum
highest); each dtype's row compares it with ``auto``'s, ``auto`` agreeing with itself;
the table and the figure show those rows."""

from __future__ import annotations

import pytest
import torch

from minipaged.bench import kv_quality
from minipaged.llm import LLM
from minipaged.models.tiny import cached_checkpoint

DTYPES = ["auto", "fp8", "int8"]
QUESTIONS = kv_quality.mc_questions(count=4)


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("bench-sharing")


def hf_prompt_logprobs(path, ids: list[int]) -> list[float]:
    """transformers' logprob of each token after the first, given those before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_auto_scores_prompts_and_choices_as_transformers_does(path):
    llm = LLM(path, device="cpu", dtype="float32")
    run = kv_quality.run_one(llm, kv_quality.quality_prompts(2), QUESTIONS, max_tokens=2)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in kv_quality.quality_prompts(2)]
    choices = [kv_quality.choice_prompts(tokenizer, q) for q in QUESTIONS]
    expected = [hf_prompt_logprobs(path, ids) for ids in prompts]
    expected += [hf_prompt_logprobs(path, ids) for options in choices for ids, _ in options]
    assert len(run["prompt_logprobs"]) == len(expected)
    for got, want in zip(run["prompt_logprobs"], expected):
        assert got == pytest.approx(want, abs=1e-4)
    per_choice = iter(expected[len(prompts) :])
    for answer, options in zip(run["answers"], choices):
        totals = [sum(next(per_choice)[start - 1 :]) for _, start in options]
        assert answer == max(range(len(totals)), key=totals.__getitem__)
    # The choice's tokens are those past the context's: " Paris" after "...Answer:".
    ids, start = choices[0][0]
    assert tokenizer.decode(ids[start:]) == " " + QUESTIONS[0]["choices"][0]


def test_rows_table_and_figure(path):
    rows = kv_quality.measure_quality(path, DTYPES, 2, 3, QUESTIONS)
    auto, fp8, int8 = rows
    assert auto["identical"] == auto["tokens_before_first_difference"] == 1.0
    assert auto["prompt_mean_abs_delta_logprob"] == auto["mean_abs_delta_logprob"] == 0.0
    assert auto["mc_answers_changed"] == 0
    for row in rows:
        assert row["prompt_tokens"] == auto["prompt_tokens"] > 0
        assert row["mc_questions"] == len(QUESTIONS)
        assert 0 <= row["prompt_mean_abs_delta_logprob"] <= row["prompt_max_abs_delta_logprob"]
    assert fp8["prompt_max_abs_delta_logprob"] > 0 and int8["prompt_max_abs_delta_logprob"] > 0
    text = kv_quality.format_table(rows)
    assert "MC acc" in text and "answers changed" in text
    lp, greedy, mc = kv_quality.plot(rows).axes
    assert [p.get_height() for p in lp.patches] == pytest.approx(
        [r["prompt_mean_abs_delta_logprob"] for r in rows]
    )
    assert [p.get_height() for p in greedy.patches] == pytest.approx(
        [100 * r["tokens_before_first_difference"] for r in rows]
    )
    assert [p.get_height() for p in mc.patches] == pytest.approx([100 * r["mc_acc"] for r in rows])

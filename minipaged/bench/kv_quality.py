"""What a quantized KV cache costs in accuracy: the ``quality`` part of ``minipaged bench
kv-cache-dtype``, each ``kv_cache_dtype`` against ``auto`` (the model's dtype) on the
same weights, measured and written down, not asserted equal.

Three measurements, from the cheapest signal to the one a user sees:

- **prompt logprobs**: every prompt token's logprob given the tokens before it
  (``SamplingParams.prompt_logprobs``), one prefill that writes the cache and reads it
  back, so the context is the same on both sides; the mean and the largest |Δ logprob|
  over all prompt tokens of every prompt below;
- **greedy agreement**: greedy completions of plain-text prompts (`quality_prompts`),
  compared token by token with ``auto``'s: the share identical, the share of tokens
  before the first difference, and the mean |Δ logprob| of the chosen tokens up to
  there (past it the contexts differ);
- **multiple choice**: the 50 questions of the lm-eval test's local task
  (``tests/lm_eval_tasks/questions_mc.jsonl``), scored as lm-evaluation-harness scores
  ``output_type: multiple_choice``: each choice's loglikelihood is the sum of its
  tokens' logprobs after the context ``"Question: {question}\\nAnswer:"``, the
  highest wins (``acc``); and how many answers differ from ``auto``'s.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

from matplotlib.figure import Figure
from tqdm.auto import tqdm

from minipaged.bench import common
from minipaged.bench.common import Column
from minipaged.llm import LLM
from minipaged.sampling_params import SamplingParams

MC_QUESTIONS = Path(__file__).resolve().parents[2] / "tests/lm_eval_tasks/questions_mc.jsonl"
TOPICS = ("the moon", "bread", "rivers", "music", "volcanoes", "chess", "bees", "rain")
TEMPLATES = (
    "Explain {} to a child.",
    "Write a short poem about {}.",
    "List three facts about {}.",
    "What is the history of {}?",
    "Why do people care about {}?",
    "Describe {} in one paragraph.",
    "Give me a riddle about {}.",
    "What would happen without {}?",
)


def quality_prompts(count: int) -> list[str]:
    """``count`` plain-text prompts (no chat template), up to 64."""
    return [t.format(topic) for t, topic in itertools.product(TEMPLATES, TOPICS)][:count]


def mc_questions(path: Path = MC_QUESTIONS, count: int | None = None) -> list[dict]:
    """The multiple-choice task's questions: ``question``, ``choices``, ``answer``."""
    with open(path) as f:
        return [json.loads(line) for line in f][:count]


def choice_prompts(tokenizer, question: dict) -> list[tuple[list[int], int]]:
    """Per choice, the prompt's token ids and where the choice's tokens start: lm-eval
    encodes context + continuation whole and counts the tokens past the context's."""
    context = f"Question: {question['question']}\nAnswer:"
    start = len(tokenizer.encode(context))
    return [(tokenizer.encode(f"{context} {choice}"), start) for choice in question["choices"]]


def prompt_token_logprobs(output) -> list[float]:
    """The logprob of each prompt token after the first, from a request's output."""
    return [entry[t] for t, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])]


def run_one(llm: LLM, prompts: list[str], questions: list[dict], max_tokens: int) -> dict:
    """One engine's answers: greedy completions of ``prompts`` (with the chosen
    tokens' logprobs), every prompt's token logprobs, each question's chosen answer."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    completions = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    logprobs, answers = score_prompts_and_choices(llm, prompts, questions)
    return {"completions": completions, "prompt_logprobs": logprobs, "answers": answers}


def mc_answers(llm: LLM, questions: list[dict]) -> list[int]:
    """Each multiple-choice question's chosen answer, by lm-eval's rule (module
    docstring)."""
    return score_prompts_and_choices(llm, [], questions)[1]


def score_prompts_and_choices(llm: LLM, prompts, questions) -> tuple[list, list[int]]:
    """The token logprobs of every prompt and then of every choice's prompt, and each
    question's chosen answer, in one batch."""
    tokenizer = llm.get_tokenizer()
    choices = [choice_prompts(tokenizer, q) for q in questions]
    scored = [{"prompt_token_ids": ids} for ids, _ in itertools.chain(*choices)]
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([*prompts, *scored], score, use_tqdm=False)
    logprobs = [prompt_token_logprobs(o) for o in outputs]
    per_choice = iter(logprobs[len(prompts) :])
    answers = []
    for options in choices:
        # Entry i of prompt_token_logprobs scores token i + 1.
        totals = [sum(next(per_choice)[start - 1 :]) for _, start in options]
        answers.append(max(range(len(totals)), key=totals.__getitem__))
    return logprobs, answers


def greedy_agreement(ours, base) -> tuple[bool, float, list[float]]:
    """Whether two greedy completions are identical, the share of tokens before their
    first difference, and |Δ logprob| of each chosen token up to it."""
    same, deltas = 0, []
    while same < len(base.token_ids) and ours.token_ids[same] == base.token_ids[same]:
        token = base.token_ids[same]
        deltas.append(abs(ours.logprobs[same][token] - base.logprobs[same][token]))
        same += 1
    return same == len(base.token_ids), same / len(base.token_ids), deltas


def compare(name: str, run: dict, auto: dict, questions: list[dict]) -> dict:
    """One dtype's row: its answers against ``auto``'s (see the module's doc)."""
    agreement = [greedy_agreement(o, b) for o, b in zip(run["completions"], auto["completions"])]
    prompt_deltas = [
        abs(a - b)
        for ours, base in zip(run["prompt_logprobs"], auto["prompt_logprobs"])
        for a, b in zip(ours, base)
    ]
    correct = [a == q["answer"] for a, q in zip(run["answers"], questions)]
    return {
        "kv_cache_dtype": name,
        "identical": statistics.mean(same for same, _, _ in agreement),
        "tokens_before_first_difference": statistics.mean(share for _, share, _ in agreement),
        "mean_abs_delta_logprob": statistics.mean(itertools.chain(*(d for *_, d in agreement))),
        "prompt_tokens": len(prompt_deltas),
        "prompt_mean_abs_delta_logprob": statistics.mean(prompt_deltas),
        "prompt_max_abs_delta_logprob": max(prompt_deltas),
        "mc_questions": len(questions),
        "mc_acc": statistics.mean(correct),
        "mc_answers_changed": sum(a != b for a, b in zip(run["answers"], auto["answers"])),
    }


def measure_quality(
    model, dtypes, num_prompts: int, max_tokens: int, questions: list[dict], **llm_kwargs
) -> list[dict]:
    """A row per dtype (``auto`` first, against itself), each dtype's engine in turn."""
    prompts = quality_prompts(num_prompts)
    runs = {}
    for name in tqdm(dtypes, desc="quality runs"):
        llm = LLM(model, device="cpu", kv_cache_dtype=name, **llm_kwargs)
        runs[name] = run_one(llm, prompts, questions, max_tokens)
        llm.shutdown()
    return [compare(name, runs[name], runs["auto"], questions) for name in dtypes]


def format_table(rows: list[dict]) -> str:
    return common.format_table(
        rows,
        [
            Column("kv_cache_dtype", "kv_cache_dtype"),
            Column("prompt |Δ logprob| mean", "prompt_mean_abs_delta_logprob", "{:.4f}"),
            Column("max", "prompt_max_abs_delta_logprob", "{:.3f}"),
            Column("greedy identical", "identical", "{:.0%}"),
            Column("tokens before a difference", "tokens_before_first_difference", "{:.0%}"),
            Column("their |Δ logprob|", "mean_abs_delta_logprob", "{:.4f}"),
            Column("MC acc", "mc_acc", "{:.0%}"),
            Column("answers changed", "mc_answers_changed"),
        ],
    )


def plot(rows: list[dict]) -> Figure:
    """Three panels against ``auto``: prompt tokens' mean |Δ logprob|, the greedy
    tokens before a difference, the multiple-choice accuracy."""
    fig = Figure(figsize=(11, 3.4), layout="constrained")
    ax_lp, ax_greedy, ax_mc = fig.subplots(1, 3)
    names = [r["kv_cache_dtype"] for r in rows]
    bars = ax_lp.bar(names, [r["prompt_mean_abs_delta_logprob"] for r in rows], color="#4c72b0")
    ax_lp.bar_label(
        bars, [f"max {r['prompt_max_abs_delta_logprob']:.2f}" for r in rows], fontsize=8
    )
    ax_lp.set_ylabel("mean |Δ logprob| per prompt token")
    ax_lp.set_title(f"prompt logprobs ({rows[0]['prompt_tokens']} tokens)")
    bars = ax_greedy.bar(
        names, [100 * r["tokens_before_first_difference"] for r in rows], color="#55a868"
    )
    ax_greedy.bar_label(bars, [f"{r['identical']:.0%} identical" for r in rows], fontsize=8)
    ax_greedy.set_ylabel("% of greedy tokens before a difference")
    ax_greedy.set_title("greedy agreement with auto")
    bars = ax_mc.bar(names, [100 * r["mc_acc"] for r in rows], color="#dd8452")
    ax_mc.bar_label(bars, [f"{r['mc_answers_changed']} changed" for r in rows], fontsize=8)
    ax_mc.set_ylabel("% correct")
    ax_mc.set_title(f"multiple choice ({rows[0]['mc_questions']} questions)")
    return fig

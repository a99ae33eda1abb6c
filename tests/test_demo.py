"""``minipaged demo``: SmolLM2 answers in English, the streamed answer is the greedy one,
and the sharing numbers agree with each other and with counts made here from the
prompts alone; the paged-vs-contiguous report is still there."""

import contextlib
import io
import re

import pytest

from minipaged import LLM, SamplingParams, demo
from minipaged.cli import main
from minipaged.core.memory.block_table import blocks_for
from minipaged.models.tiny import cached_checkpoint

N, MAX_TOKENS, BLOCK = 2, 12, 16
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Tiny checkpoints go to a temporary cache, not the user's."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIPAGED_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def out(smollm2):
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(demo, "STREAMED_QUESTION", QUESTION)
        assert (
            main(
                [
                    "demo",
                    "--model",
                    str(smollm2),
                    "--n",
                    str(N),
                    "--max-tokens",
                    str(MAX_TOKENS),
                    "--num-requests",
                    "100",
                ]
            )
            == 0
        )
    return stdout.getvalue()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def prompt_ids(tokenizer) -> list[list[int]]:
    """The batch's prompts as the chat template makes them, tokenized here."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": demo.SYSTEM_PROMPT}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for q in demo.QUESTIONS
    ]


def table(out: str) -> dict[str, tuple[int, int, int]]:
    """The ``shared`` and ``separate`` rows: blocks used, shared, empty slots."""
    rows = {}
    for name in ("shared", "separate"):
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        rows[name] = tuple(map(int, line.split()[-3:]))
    return rows


def test_the_streamed_answer_is_real_english_and_the_greedy_one(out, smollm2):
    streamed = out.split("assistant: ", 1)[1].split("\n[", 1)[0]
    assert "Paris" in streamed
    llm = LLM(str(smollm2), num_gpu_blocks=64, swap_space=0)
    [greedy] = llm.generate(
        demo.chat_prompt(llm.get_tokenizer(), QUESTION),
        SamplingParams(temperature=0, max_tokens=2 * MAX_TOKENS),
        use_tqdm=False,
    )
    assert streamed == greedy.outputs[0].text


def test_every_question_gets_n_answers(out):
    for question in demo.QUESTIONS:
        assert f"user: {question}" in out
    assert len(re.findall(r"^  \[\d\] ", out, re.M)) == N * len(demo.QUESTIONS)


def test_sharing_uses_fewer_blocks_for_the_same_tokens(out):
    rows = table(out)
    (used, shared, _), (used_sep, shared_sep, _) = rows["shared"], rows["separate"]
    assert shared_sep == 0 and 0 < shared < used < used_sep
    assert "same tokens either way: yes" in out
    saved = re.search(r"sharing saves (\d+)% of the blocks", out)
    assert int(saved[1]) == round(100 * (1 - used / used_sep))


def test_separate_requests_need_a_block_table_each(out, tokenizer):
    """Counted from the prompts: after the first step every copy of every prompt holds
    its prompt's blocks; no copy ever holds more than prompt + max_tokens."""
    lens = [len(p) for p in prompt_ids(tokenizer)]
    used = table(out)["separate"][0]
    assert N * sum(blocks_for(p, BLOCK) for p in lens) <= used
    assert used <= N * sum(blocks_for(p + MAX_TOKENS, BLOCK) for p in lens)


def test_only_each_sequences_last_block_has_empty_slots(out):
    """§4.2: paging wastes at most a block's tail per sequence, shared or not."""
    for _, _, empty in table(out).values():
        assert 0 <= empty < N * len(demo.QUESTIONS) * BLOCK


def test_prefix_cache_hits_are_the_full_blocks_an_earlier_prompt_shares(out, tokenizer):
    prompts = prompt_ids(tokenizer)
    hits = 0
    for i, prompt in enumerate(prompts):
        common = max((_common_prefix(prompt, earlier) for earlier in prompts[:i]), default=0)
        hits += min(common, len(prompt) - 1) // BLOCK * BLOCK  # the last token is computed
    served = re.search(r"the prefix cache served (\d+) of (\d+) prompt tokens", out)
    assert (int(served[1]), int(served[2])) == (hits, sum(map(len, prompts)))


def _common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_demo_still_reports_paged_and_contiguous_waste(out):
    cells = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("|")
    ]
    rows = {row[0]: row for row in cells}
    token_share = {
        s: float(rows[s][1].rstrip("%"))
        for s in ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
    }
    assert token_share["paged"] > max(v for s, v in token_share.items() if s != "paged")


def test_the_checkpoint_is_written_once_to_the_cache(cache):
    path = cached_checkpoint("demo-llama")
    assert path.parent == cache and (path / "model.safetensors").is_file()
    assert cached_checkpoint("demo-llama") == path
    assert cached_checkpoint("demo-llama", num_hidden_layers=1) != path


def test_peak_usage_watch_leaves_the_engine_as_it_was(cache):
    llm = LLM(str(cached_checkpoint("demo-llama")), device="cpu", num_gpu_blocks=32, swap_space=0)
    with demo.PeakUsage.watch(llm.engine) as peak:
        llm.generate(
            ["abcdefgh" * 3], SamplingParams(n=2, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
    assert "step" not in vars(llm.engine)
    # 25 prompt tokens: one full block shared by both completions, a tail block each.
    assert peak.stats["num_used_gpu_blocks"] == 3
    assert peak.stats["num_shared_gpu_blocks"] == 1
    report = demo.memory_report(llm.engine, peak)
    assert "At the busiest step 3 blocks were in use" in report
    assert "now 32 of 32 blocks are free again" in report

"""``minipaged demo``: the engine part's numbers agree with each other and with counts
made here from the prompts alone; the paged-vs-contiguous report is still there."""

import contextlib
import io
import re

import pytest

from minipaged import demo
from minipaged.cli import main
from minipaged.memory.block_table import blocks_for

N, MAX_TOKENS, BLOCK = 3, 10, 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The demo's checkpoint goes to a temporary cache, not the user's."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIPAGED_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def out(cache):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["demo", "--n", str(N), "--max-tokens", str(MAX_TOKENS)]) == 0
    return stdout.getvalue()


def table(out: str) -> dict[str, tuple[int, int, int]]:
    """The ``shared`` and ``separate`` rows: blocks used, shared, empty slots."""
    rows = {}
    for name in ("shared", "separate"):
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        rows[name] = tuple(map(int, line.split()[-3:]))
    return rows


def prompt_lens() -> list[int]:
    # The tiny tokenizer: one token per UTF-8 byte, after a BOS.
    return [len((demo.SYSTEM_PROMPT + q).encode()) + 1 for q in demo.QUESTIONS]


def test_sharing_uses_fewer_blocks_for_the_same_tokens(out):
    rows = table(out)
    (used, shared, _), (used_sep, shared_sep, _) = rows["shared"], rows["separate"]
    assert shared_sep == 0 and 0 < shared < used < used_sep
    assert "same tokens either way: yes" in out
    saved = re.search(r"sharing saves (\d+)% of the blocks", out)
    assert int(saved[1]) == round(100 * (1 - used / used_sep))


def test_separate_requests_need_a_block_table_each(out):
    """Counted from the prompts: each of the N copies of a prompt holds its own blocks
    for the prompt and the tokens generated so far (the last one is sampled, then freed
    at once, the one before it may not have been written yet)."""
    used = table(out)["separate"][0]
    low = N * sum(blocks_for(p + MAX_TOKENS - 2, BLOCK) for p in prompt_lens())
    high = N * sum(blocks_for(p + MAX_TOKENS, BLOCK) for p in prompt_lens())
    assert low <= used <= high


def test_only_each_sequences_last_block_has_empty_slots(out):
    """§4.2: paging wastes at most a block's tail per sequence, shared or not."""
    for _, _, empty in table(out).values():
        assert 0 <= empty < N * len(demo.QUESTIONS) * BLOCK


def test_prefix_cache_hits_are_the_full_blocks_an_earlier_prompt_shares(out):
    prompts = [[256, *(demo.SYSTEM_PROMPT + q).encode()] for q in demo.QUESTIONS]
    hits = 0
    for i, prompt in enumerate(prompts):
        common = max((_common_prefix(prompt, earlier) for earlier in prompts[:i]), default=0)
        hits += min(common, len(prompt) - 1) // BLOCK * BLOCK  # the last token is computed
    served = re.search(r"the prefix cache served (\d+) of (\d+) prompt tokens", out)
    assert (int(served[1]), int(served[2])) == (hits, sum(map(len, prompts)))


def _common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_outputs_are_printed_with_a_gibberish_warning(out):
    assert "gibberish" in out
    for q in demo.QUESTIONS:
        assert f"prompt: ...{q!r}" in out
    assert len(re.findall(r"^  \[\d\] '", out, re.M)) + len(re.findall(r'^  \[\d\] "', out, re.M)) \
        == N * len(demo.QUESTIONS)


def test_demo_still_reports_paged_and_contiguous_waste(out):
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for system in ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"):
        assert system in rows
    token_share = {s: float(rows[s][1].rstrip("%")) for s in rows
                   if s.startswith(("paged", "contiguous"))}
    assert token_share["paged"] > max(v for s, v in token_share.items() if s != "paged")
    assert "copy-on-write" in out and "Prefix caching" in out


def test_the_checkpoint_is_written_once_to_the_cache(out, cache):
    (path,) = cache.iterdir()
    assert path.name.startswith("demo-llama-") and (path / "model.safetensors").is_file()
    assert demo.cached_checkpoint("demo-llama") == path
    assert demo.cached_checkpoint("demo-llama", num_hidden_layers=1) != path


def test_peak_usage_watch_leaves_the_engine_as_it_was(cache):
    from minipaged import LLM, SamplingParams

    llm = LLM(str(demo.cached_checkpoint("demo-llama")), device="cpu", num_gpu_blocks=32,
              swap_space=0)
    with demo.PeakUsage.watch(llm.engine) as peak:
        llm.generate(["abcdefgh" * 3], SamplingParams(n=2, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    assert "step" not in vars(llm.engine)
    # 25 prompt tokens: one full block shared by both completions, a tail block each.
    assert peak.stats["num_used_gpu_blocks"] == 3
    assert peak.stats["num_shared_gpu_blocks"] == 1
    report = demo.memory_report(llm.engine, peak)
    assert "At the busiest step 3 blocks were in use" in report
    assert "now 32 of 32 blocks are free again" in report

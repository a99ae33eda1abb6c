"""Penalties, min_tokens and stop tokens: the sampler and the engine against references.

Oracles, independent of the code under test:

- transformers' logits processors (``RepetitionPenaltyLogitsProcessor``,
  ``MinNewTokensLengthLogitsProcessor``), row by row;
- a plain Python loop for OpenAI's presence and frequency penalties (no HF processor);
- Hugging Face ``generate`` (``repetition_penalty``, ``min_new_tokens``) on the same
  checkpoint, and a cache-free greedy loop over HF's logits where ``generate`` has no
  such option.
"""

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from engine_helpers import EOS, assert_all_blocks_free, make_llm, random_prompt
from minipaged.sample.metadata import SamplingInputBatch
from minipaged.sample.sampler import apply_min_tokens, apply_penalties, final_logits, sample
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence

VOCAB = 64


def histories(rows, seed=0):
    """Random (token_ids, prompt_len) per row, with repeats and some empty outputs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        prompt_len = int(torch.randint(1, 12, (1,), generator=g))
        num_out = 0 if r % 4 == 0 else int(torch.randint(1, 20, (1,), generator=g))
        tokens = torch.randint(0, VOCAB // 2, (prompt_len + num_out,), generator=g).tolist()
        out.append((tokens, prompt_len))
    return out


def random_logits(rows, seed=0):
    # Both signs, as the repetition penalty treats them differently.
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def naive_presence_frequency(row, output, presence, frequency):
    row = row.clone()
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row


def hf_generate(oracle, prompt: list[int], **kwargs) -> list[int]:
    """The tokens HF ``generate`` adds to ``prompt``, greedily, with ``kwargs``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = oracle.hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    rows = histories(8)
    logits = random_logits(8)
    params = [SamplingParams(repetition_penalty=penalty)] * 8
    got = apply_penalties(logits, params, [t for t, _ in rows], [p for _, p in rows])
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (tokens, _) in enumerate(rows):
        want = hf(torch.tensor([tokens]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (-1.0, 2.0)])
def test_presence_and_frequency_count_the_output_only(presence, frequency):
    rows = histories(8, seed=1)
    logits = random_logits(8, seed=1)
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 8
    got = apply_penalties(logits, params, [t for t, _ in rows], [p for _, p in rows])
    for i, (tokens, prompt_len) in enumerate(rows):
        want = naive_presence_frequency(logits[i], tokens[prompt_len:], presence, frequency)
        torch.testing.assert_close(got[i], want)


def test_all_penalties_together_and_rows_without_any_untouched():
    """vLLM's order: repetition first, then frequency and presence; a row with no
    penalty in the same batch keeps its logits bit for bit."""
    rows = histories(6, seed=2)
    logits = random_logits(6, seed=2)
    on = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.4)
    params = [on if i % 2 else SamplingParams() for i in range(6)]
    got = apply_penalties(logits, params, [t for t, _ in rows], [p for _, p in rows])
    for i, (tokens, prompt_len) in enumerate(rows):
        if i % 2 == 0:
            assert torch.equal(got[i], logits[i])
            continue
        want = RepetitionPenaltyLogitsProcessor(1.2)(
            torch.tensor([tokens]), logits[i : i + 1].clone()
        )[0]
        want = naive_presence_frequency(want, tokens[prompt_len:], 0.3, 0.4)
        torch.testing.assert_close(got[i], want)


def test_greedy_takes_the_argmax_of_the_penalized_logits_and_reports_raw_logprobs():
    rows = histories(8, seed=3)
    logits = random_logits(8, seed=3)
    # logprobs=0: the sampled token's logprob alone (none are computed unless asked).
    params = [SamplingParams(temperature=0, repetition_penalty=3.0, logprobs=0)] * 8
    out = sample(logits, params, token_ids=[t for t, _ in rows], prompt_lens=[p for _, p in rows])
    hf = RepetitionPenaltyLogitsProcessor(3.0)
    want = [
        int(hf(torch.tensor([t]), logits[i : i + 1].clone()).argmax())
        for i, (t, _) in enumerate(rows)
    ]
    assert out.token_ids == want
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs), raw[range(8), want])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_tokens_like_transformers(ignore_eos):
    eos, stops = {5, 9}, [3, 60]
    rows = histories(8, seed=4)
    logits = random_logits(8, seed=4)
    params = [
        SamplingParams(min_tokens=5, max_tokens=20, stop_token_ids=stops, ignore_eos=ignore_eos)
    ] * 8
    got = apply_min_tokens(logits, params, [t for t, _ in rows], [p for _, p in rows], eos)
    masked = sorted(set(stops) | (set() if ignore_eos else eos))
    for i, (tokens, prompt_len) in enumerate(rows):
        hf = MinNewTokensLengthLogitsProcessor(prompt_len, 5, masked)
        torch.testing.assert_close(got[i], hf(torch.tensor([tokens]), logits[i : i + 1].clone())[0])
    assert any(len(t) - p >= 5 for t, p in rows) and any(len(t) - p < 5 for t, p in rows)


def test_penalties_without_the_token_history_are_an_error():
    with pytest.raises(ValueError, match="token_ids"):
        sample(random_logits(2), [SamplingParams(presence_penalty=1.0)] * 2)
    with pytest.raises(ValueError, match="token_ids"):
        sample(random_logits(2), [SamplingParams(min_tokens=1)] * 2)


# -- the engine, against Hugging Face on the same weights ---------------------------------
def hf_greedy(oracle, prompt, max_tokens, adjust=lambda logits, output: logits, stop_ids=(EOS,)):
    """Greedy decoding over HF's logits, a full forward per token: ``adjust`` changes
    the logits given the output so far; a token in ``stop_ids`` ends it (kept)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = oracle.hf(torch.tensor([tokens])).logits[0, -1].float()
        token = int(adjust(logits, tokens[len(prompt) :]).argmax())
        tokens.append(token)
        if token in stop_ids:
            break
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    path, oracle = tiny("llama")
    return make_llm(path), oracle


def test_repetition_penalty_greedy_equals_hf_generate(tiny_llm):
    llm, oracle = tiny_llm
    prompts = [random_prompt(n, seed=n) for n in (3, 9, 17)]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=24),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outputs):
        want = hf_generate(oracle, prompt, repetition_penalty=1.8, max_new_tokens=24)
        assert out.outputs[0].token_ids == want
    plain = llm.generate(
        {"prompt_token_ids": prompts[2]},
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )
    # The penalty changed something.
    assert plain[0].outputs[0].token_ids != outputs[2].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_presence_and_frequency_greedy_equal_a_naive_loop(tiny_llm):
    llm, oracle = tiny_llm
    prompt = random_prompt(11, seed=5)

    def adjust(logits, output):
        return naive_presence_frequency(logits, output, 1.5, 0.8)

    (out,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.8, max_tokens=20),
        use_tqdm=False,
    )
    assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 20, adjust)
    assert_all_blocks_free(llm)


def test_min_tokens_holds_eos_back_like_hf_min_new_tokens(tiny_llm):
    llm, oracle = tiny_llm
    prompt = oracle.eos_prompt(24)
    natural, _ = oracle.greedy(prompt, 24)
    minimum = len(natural) + 3  # EOS came earlier; now it may not
    (out,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, min_tokens=minimum, max_tokens=40),
        use_tqdm=False,
    )
    want = hf_generate(oracle, prompt, min_new_tokens=minimum, max_new_tokens=40)
    assert out.outputs[0].token_ids == want
    assert len(out.outputs[0].token_ids) > minimum
    assert_all_blocks_free(llm)


def test_stop_token_ids_wait_for_min_tokens(tiny_llm):
    llm, oracle = tiny_llm
    prompt = random_prompt(8, seed=6)
    free = oracle.greedy_ignoring_eos(prompt, 12)
    stop = free[1]  # greedy would stop on its second token
    masked = {stop, EOS}

    def adjust(logits, output):
        if len(output) < 4:
            logits = logits.clone()
            logits[list(masked)] = -torch.inf
        return logits

    want = hf_greedy(oracle, prompt, 30, adjust, stop_ids=masked)
    (out,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, min_tokens=4, max_tokens=30, stop_token_ids=[stop]),
        use_tqdm=False,
    )
    completion = out.outputs[0]
    assert completion.token_ids == want and len(want) > 4
    if want[-1] == stop:
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    (early,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]),
        use_tqdm=False,
    )
    assert early.outputs[0].token_ids == free[:2]  # without min_tokens it stops at once
    assert_all_blocks_free(llm)


def test_a_top_p_that_rounds_to_zero_gives_greedy_output(tiny_llm):
    """The request that once killed the server's engine thread: top_p=1e-300 is 0 in
    float32; the nucleus must still hold the most likely token."""
    llm, _ = tiny_llm
    prompt = {"prompt_token_ids": random_prompt(7, seed=7)}
    (greedy,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    (tiny_p,) = llm.generate(
        prompt, SamplingParams(top_p=1e-300, max_tokens=10, seed=1), use_tqdm=False
    )
    assert tiny_p.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_real_weights_min_tokens_and_repetition_penalty_equal_hf_generate(smollm2):
    """SmolLM2 answers a chat question and ends with <|im_end|>; with min_tokens it must
    keep going exactly as HF's ``min_new_tokens`` does, and with a repetition penalty
    follow HF's ``repetition_penalty``."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(smollm2, dtype="float32", max_model_len=256)  # HF runs in float32
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2+2?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2, local_files_only=True, dtype=torch.float32
    ).eval()
    ids = torch.tensor([prompt])
    (plain,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=30),
        use_tqdm=False,
    )
    # Its answer ends (EOS) in fewer than 20 tokens, so min_tokens=20 changes it.
    assert plain.outputs[0].finish_reason == "stop"
    assert len(plain.outputs[0].token_ids) < 20
    cases = [{"min_tokens": 20}, {"repetition_penalty": 1.3}]
    hf_names = [{"min_new_tokens": 20}, {"repetition_penalty": 1.3}]
    outs = llm.generate(
        [{"prompt_token_ids": prompt}] * 2,
        [SamplingParams(temperature=0, max_tokens=30, **c) for c in cases],
        use_tqdm=False,
    )
    for out, kwargs in zip(outs, hf_names):
        with torch.no_grad():
            want = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=30,
                **kwargs,
            )
        assert out.outputs[0].token_ids == want[0, len(prompt) :].tolist(), kwargs
    assert len(outs[0].outputs[0].token_ids) > 20
    assert_all_blocks_free(llm)


def test_counts_kept_across_steps_equal_the_oracles_on_the_whole_history():
    """The engine's decode steps keep each sequence's penalty counts in a
    `SamplingInputBatch`, updated with only the tokens gained since the last step; after
    several steps, a dropped row, a request id used again and a sequence that gains
    several tokens at once, the penalised logits are still the oracles' over the whole
    history."""
    rep, presence, frequency = 1.5, 0.4, 0.3
    params = [
        SamplingParams(repetition_penalty=rep, presence_penalty=presence),
        SamplingParams(),  # unpenalised, between penalised rows
        SamplingParams(frequency_penalty=frequency, repetition_penalty=rep),
    ]
    seqs = [
        Sequence(str(i), list(tokens), prompt_len)
        for i, (tokens, prompt_len) in enumerate(histories(3, seed=2))
    ]
    batch = SamplingInputBatch(VOCAB, "cpu", max_num_reqs=2)  # it must grow
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        if step == 3:  # "0" finishes; a new request takes its id (and its row)
            batch.remove(["0"])
            tokens, prompt_len = histories(1, seed=4)[0]
            seqs[0] = Sequence("0", tokens, prompt_len)
        logits = random_logits(3, seed=step)
        got = final_logits(logits, batch.metadata(batch.rows(seqs, params)))
        for i, (seq, p) in enumerate(zip(seqs, params)):
            want = logits[i : i + 1].clone()
            if p.repetition_penalty != 1:
                want = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([seq.token_ids]), want)
            want = naive_presence_frequency(
                want[0], seq.output_token_ids, p.presence_penalty, p.frequency_penalty
            )
            torch.testing.assert_close(got[i], want)
        for seq in seqs:  # a sampled token each, and two (accepted guesses) now and then
            seq.token_ids += torch.randint(0, VOCAB // 2, (1 + step % 2,), generator=g).tolist()

"""Shared set-up for the engine's acceptance tests (test_engine.py, test_beam_search.py).

The oracle is Hugging Face transformers on the same tiny seeded checkpoint: greedy
continuations from ``generate`` and per-step log-probabilities from its raw logits,
plus a cache-free greedy loop (a full forward per token) for the cases ``generate``
cannot express.  Nothing here runs minipaged's engine except `make_llm`.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from minipaged import LLM
from minipaged.models.tiny import EOS_ID

EOS = EOS_ID
# fp32 against HF, as in test_models.py: only the order of summation differs.  A logprob
# is a logit minus a logsumexp, each carrying that error, hence twice the logits' atol.
FP32 = dict(atol=2e-4, rtol=1e-5)


def random_prompt(length: int, seed: int) -> list[int]:
    """``length`` byte tokens (ids 0..255: every one decodes to text), seeded."""
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


class Oracle:
    """Hugging Face's model on one checkpoint, with its greedy continuations cached."""

    def __init__(self, path) -> None:
        self.path = path
        self.hf = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def _hf_greedy(self, prompt, max_tokens: int, **options):
        """HF ``generate(do_sample=False)`` on ``prompt``, with ``options`` of its own."""
        ids = torch.tensor([prompt])
        with torch.no_grad():
            return self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                **options,
            )

    @functools.cache  # noqa: B019 (one Oracle per checkpoint, kept for the whole session)
    def _generate(self, prompt: tuple[int, ...], max_tokens: int):
        out = self._hf_greedy(prompt, max_tokens, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt) :].tolist()  # HF stops at (and keeps) EOS
        logprobs = torch.stack([step[0].float() for step in out.logits]).log_softmax(-1)
        return tokens, logprobs

    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
        """HF ``generate(do_sample=False)``: the new tokens (up to and including EOS) and
        ``log_softmax`` of its raw logits at each step, ``[len(tokens), vocab]``."""
        return self._generate(tuple(prompt), max_tokens)

    def masked_greedy(self, prompt: list[int], max_tokens: int, allowed) -> list[int]:
        """HF ``generate(do_sample=False)`` with every token ``allowed`` rules out at
        -inf: ``allowed(token)`` gets the token generated last (None before the first)
        and returns a boolean mask over the vocabulary (a grammar matcher's, advanced by
        that token)."""

        class Mask(LogitsProcessor):
            def __call__(self, input_ids, scores):
                last = int(input_ids[0, -1]) if input_ids.shape[1] > len(prompt) else None
                return scores.masked_fill(~allowed(last), float("-inf"))

        out = self._hf_greedy(prompt, max_tokens, logits_processor=LogitsProcessorList([Mask()]))
        return out[0, len(prompt) :].tolist()

    def next_logprobs(self, tokens: list[int]) -> torch.Tensor:
        """``log_softmax`` of the next-token logits after ``tokens``: one full forward
        pass, no KV cache at all."""
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)

    def greedy_ignoring_eos(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy decoding that runs through EOS: argmax of a full forward per token."""
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(int(self.next_logprobs(tokens).argmax()))
        return tokens[len(prompt) :]

    def eos_prompt(self, max_tokens: int, min_before_eos: int = 2) -> list[int]:
        """A prompt whose greedy continuation ends with EOS after at least
        ``min_before_eos`` other tokens and within ``max_tokens``: found by asking HF."""
        for seed in range(1000, 1200):
            prompt = random_prompt(1 + seed % 29, seed)
            tokens, _ = self.greedy(prompt, max_tokens)
            if tokens[-1] == EOS and len(tokens) > min_before_eos:
                return prompt
        raise AssertionError("no prompt whose greedy continuation hits EOS; widen the search")


def make_llm(path, **kwargs) -> LLM:
    """An engine on the CPU with a small swap pool (a few MiB instead of 4 GiB)."""
    kwargs.setdefault("swap_space", 0.01)
    return LLM(path, device="cpu", **kwargs)


def assert_all_blocks_free(llm: LLM) -> None:
    """After a workload: no request left anywhere, no block held in either pool (a
    prefix-cached block may stay, evictable, which counts as free)."""
    stats = llm.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"], stats
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"], stats
    assert stats["num_used_gpu_blocks"] == 0, stats
    assert stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0, stats
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert not llm.engine.kv.tables  # no sequence keeps a block table


def assert_greedy_matches_hf(
    outputs, prompts: list[list[int]], oracle: Oracle, max_tokens: int, logprobs: int | None = None
) -> None:
    """Each output is HF's greedy continuation token for token (EOS included, where HF
    stopped) with the right finish reason; with ``logprobs`` = k, each step's dict holds
    the chosen token and HF's top k, with HF's values."""
    assert [o.prompt_token_ids for o in outputs] == prompts
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        expected, hf_logprobs = oracle.greedy(prompt, max_tokens)
        assert len(out.outputs) == 1 and out.finished
        completion = out.outputs[0]
        assert completion.token_ids == expected, f"prompt {i} (length {len(prompt)})"
        assert completion.finish_reason == ("stop" if expected[-1] == EOS else "length")
        if logprobs is None:
            continue
        assert len(completion.logprobs) == len(expected)
        for step, (token, ours) in enumerate(zip(expected, completion.logprobs)):
            hf_top = hf_logprobs[step].topk(logprobs).indices.tolist()
            assert set(ours) == {token, *hf_top}, f"prompt {i} step {step}"
            ids = list(ours)
            torch.testing.assert_close(
                torch.tensor([ours[t] for t in ids]),
                hf_logprobs[step][ids],
                **FP32,
                msg=lambda m, i=i, step=step: f"prompt {i} step {step}: {m}",
            )
        hf_cumulative = float(hf_logprobs[torch.arange(len(expected)), expected].sum())
        assert completion.cumulative_logprob == pytest.approx(hf_cumulative, abs=1e-3)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]``: row p is log_softmax of HF's logits at position p,
    which score prompt token p + 1."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def assert_prompt_logprobs_match_hf(output, hf, k: int, atol: float = FP32["atol"]) -> None:
    """vLLM's shape: None for the first token, then per token a dict holding it first and
    HF's top ``k`` there, each with HF's value."""
    prompt, entries = output.prompt_token_ids, output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    expected = hf_prompt_logprobs(hf, prompt)
    for p, (token, entry) in enumerate(zip(prompt[1:], entries[1:])):
        assert next(iter(entry)) == token, f"token {p + 1}: the prompt token comes first"
        assert set(entry) == {token, *expected[p].topk(k).indices.tolist()}, f"token {p + 1}"
        ids = list(entry)
        torch.testing.assert_close(
            torch.tensor([entry[t] for t in ids]), expected[p][ids], atol=atol, rtol=1e-5
        )

"""`LLM.beam_search` against a naive beam search on Hugging Face's model (paper §4.4).

The reference is vLLM's ``LLM.beam_search`` algorithm written the slow, obvious way:
every beam is a plain token list, and every step runs a full forward pass over each
beam's whole sequence (no KV cache, so no block sharing to get wrong).  The engine must
find the same beams, with the same cumulative logprobs, while its beams share blocks
copy-on-write, and even when it preempts them.
"""

import dataclasses

import pytest

from engine_helpers import EOS, as_inputs, assert_all_blocks_free, make_llm, random_prompt
from minipaged import BeamSearchParams
from minipaged.core.memory.block_table import blocks_for

MAX_TOKENS = 8


def beam_score(tokens, cum_logprob, length_penalty):
    """vLLM's ``get_beam_search_score``: a final EOS does not count towards the length."""
    length = len(tokens) - (tokens[-1] == EOS)
    return cum_logprob / length**length_penalty


def reference_beam_search(oracle, prompt, params):
    """vLLM's ``LLM.beam_search`` on one prompt: ``[(tokens, cum_logprob)]``, best first.

    Each step every live beam proposes its ``2 * beam_width`` most likely next tokens;
    a proposal ending in EOS is set aside as completed (unless ``ignore_eos``), the rest
    are ranked and the best ``beam_width`` live on.  At the end completed and live beams
    are ranked together by length-normalised score.  Ranking is vLLM's sort key
    throughout (`beam_score`), which for live beams of one length is the cumulative
    logprob's order.
    """
    width, penalty = params.beam_width, params.length_penalty
    live, completed = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        proposals = []
        for tokens, cum in live:
            top = oracle.next_logprobs(tokens).topk(2 * width)  # a full forward pass
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                beam = (tokens + [token], cum + logprob)
                (completed if token == EOS and not params.ignore_eos else proposals).append(beam)
        live = sorted(proposals, key=lambda b: beam_score(*b, penalty), reverse=True)[:width]
    return sorted(completed + live, key=lambda b: beam_score(*b, penalty), reverse=True)[:width]


def assert_beams_equal(llm, outputs, prompts, expected, ignore_eos=False):
    """Same beams in the same order as ``expected`` (the reference's, computed before
    the engine ran), cumulative logprobs within fp32 noise, and each beam's text its
    generated tokens decoded (a final EOS left out)."""
    assert len(outputs) == len(prompts) == len(expected)
    tokenizer = llm.get_tokenizer()
    for i, (prompt, out, best) in enumerate(zip(prompts, outputs, expected)):
        assert [s.tokens for s in out.sequences] == [t for t, _ in best], f"prompt {i}"
        for seq, (tokens, cum) in zip(out.sequences, best):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            generated = tokens[len(prompt) :]
            if generated[-1] == EOS and not ignore_eos:
                generated = generated[:-1]
            assert seq.text == tokenizer.decode(generated)


def search_and_compare(llm, oracle, prompts, params):
    """Run ``llm.beam_search`` on ``prompts`` and check it against the reference."""
    expected = [reference_beam_search(oracle, p, params) for p in prompts]
    outputs = llm.beam_search(as_inputs(prompts), params)
    assert_beams_equal(llm, outputs, prompts, expected, params.ignore_eos)
    return outputs


def prompts_where_the_penalty_matters(oracle, params, count=3):
    """``count`` prompts of different lengths; the first is one whose best beams under
    ``params.length_penalty`` differ from those under another penalty and include one
    that ended in EOS (shorter than the live ones, competing with them), so the test
    sees the length normalisation and not only the cumulative logprob."""
    contrast = dataclasses.replace(
        params, length_penalty=1.0 if params.length_penalty == 0 else 0.0
    )

    def beams(p, prm):
        return [t for t, _ in reference_beam_search(oracle, p, prm)]

    def decides(p):
        best = beams(p, params)
        return any(t[-1] == EOS for t in best) and best != beams(p, contrast)

    decisive = next(p for p in (random_prompt(1 + s % 12, seed=s) for s in range(60)) if decides(p))
    return [decisive] + [random_prompt(n, seed=200 + n) for n in (17, 30)][: count - 1]


@pytest.mark.parametrize(
    "arch, beam_width, length_penalty",
    [
        ("llama", 2, 1.0),
        ("llama", 4, 0.0),  # raw cumulative logprob: favours short, finished beams
        ("llama", 3, 2.0),  # favours long beams
        ("qwen3", 4, 1.0),
    ],
)
def test_beam_search_equals_naive_reference(tiny, arch, beam_width, length_penalty):
    """A batch of prompts searched together returns, per prompt, the reference's beams."""
    path, oracle = tiny(arch)
    params = BeamSearchParams(
        beam_width=beam_width, max_tokens=MAX_TOKENS, length_penalty=length_penalty
    )
    prompts = prompts_where_the_penalty_matters(oracle, params)
    llm = make_llm(path, block_size=8)
    outputs = search_and_compare(llm, oracle, prompts, params)
    assert all(len(o.sequences) == beam_width for o in outputs)
    assert any(s.tokens[-1] == EOS for s in outputs[0].sequences)  # a finished beam ranked
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_preemption_equals_reference(tiny, mode):
    """Beam groups preempted whole (all-or-nothing, §4.5) from a pool that fits only one
    worst-case request come back (recomputed, or swapped in) and find the same beams."""
    path, oracle = tiny("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    prompts = [random_prompt(n, seed=300 + n) for n in (6, 14, 21)]
    block_size = 4
    worst = max(params.beam_width * blocks_for(len(p) + MAX_TOKENS, block_size) for p in prompts)
    llm = make_llm(path, block_size=block_size, num_gpu_blocks=worst, preemption_mode=mode)
    search_and_compare(llm, oracle, prompts, params)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_out_blocks"] > 0) == (mode == "swap")
    assert_all_blocks_free(llm)


def test_beams_share_their_common_blocks(tiny):
    """Beams are forks (§4.4): the trace records forks, while decoding several beams
    hold the same physical blocks, and at no step do the beams hold as many blocks as
    ``beam_width`` separate sequences of the same length would."""
    path, oracle = tiny("llama")
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS)
    prompt = random_prompt(40, seed=40)  # 5 full blocks of 8 that every beam shares
    llm = make_llm(path, block_size=8, num_gpu_blocks=64, trace=True)
    expected = reference_beam_search(oracle, prompt, params)
    llm.engine.add_request("beams", prompt, params)
    outputs, shared, ratios = [], [], []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
        stats = llm.stats()
        group = llm.engine.requests.get("beams")
        beams = group.unfinished_seqs if group else []
        if len(beams) > 1:
            separate = sum(blocks_for(len(b.token_ids), 8) for b in beams)
            shared.append(stats["num_shared_gpu_blocks"])
            ratios.append(stats["num_used_gpu_blocks"] / separate)
    assert any(e.kind == "fork" for e in llm.engine.trace.events)
    assert shared and min(shared) >= 40 // 8  # the prompt's full blocks, at every step
    assert max(ratios) < 0.5
    assert_beams_equal(llm, outputs, [prompt], [expected])
    assert_all_blocks_free(llm)


def test_ignore_eos_keeps_eos_beams_alive(tiny):
    """With ignore_eos an EOS proposal is a live beam like any other and may be extended
    (length_penalty 0, so vLLM's EOS length rule plays no part in the ranking)."""
    path, oracle = tiny("llama")
    params = BeamSearchParams(beam_width=4, max_tokens=4, length_penalty=0.0, ignore_eos=True)
    prompt = next(
        p
        for p in (random_prompt(1 + s % 20, seed=s) for s in range(60))
        if any(EOS in t[len(p) :] for t, _ in reference_beam_search(oracle, p, params))
    )
    llm = make_llm(path, block_size=8)
    outputs = search_and_compare(llm, oracle, [prompt], params)
    assert all(len(s.tokens) == len(prompt) + 4 for s in outputs[0].sequences)
    assert_all_blocks_free(llm)


def test_ignore_eos_ranks_eos_ending_beams_as_vllm_does(tiny):
    """vLLM's sort key drops a final EOS from the length even under ignore_eos, so with
    a length penalty a beam ending in EOS ranks lower than its raw score suggests."""
    path, oracle = tiny("llama")
    llm = make_llm(path, block_size=8)
    for seed in range(8):
        prompt = random_prompt(1 + seed % 20, seed=seed)
        for width in (2, 4):
            params = BeamSearchParams(
                beam_width=width, max_tokens=2, length_penalty=1.0, ignore_eos=True
            )
            search_and_compare(llm, oracle, [prompt], params)

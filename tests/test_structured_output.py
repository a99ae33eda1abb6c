"""Structured outputs: completions held to a JSON schema, regex, choice or grammar.

Oracles: ``jsonschema`` validates every JSON completion against its schema, Python's
``re`` full-matches every regex completion, and Hugging Face ``generate`` on the same
tiny checkpoint, constrained by a fresh llguidance matcher through a
``LogitsProcessor`` (`engine_helpers.Oracle.masked_greedy`; the mask built here from
the tokenizer, none of minipaged's code), gives
the greedy tokens.  The tiny model's weights are random, so its completions are
garbage, but valid garbage: exactly what tests the mask.
"""

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")  # the oracle (the dev extra)
pytest.importorskip("llguidance")  # absent from a GPU's stock image

import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402

from engine_helpers import EOS, assert_all_blocks_free, make_llm, random_prompt  # noqa: E402
from minipaged import BeamSearchParams, SamplingParams, StructuredOutputsParams  # noqa: E402
from minipaged.core.memory.block_table import blocks_for  # noqa: E402

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "inner": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "inner"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "array",
        "items": {"enum": ["red", "green", 7, None]},
        "minItems": 1,
        "maxItems": 4,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "tag": {"type": "string", "maxLength": 4},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 160
PROMPTS = [random_prompt(3 + i, seed=i) for i in range(4)]


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def llm(model):
    return make_llm(model[0], block_size=8)


def structured(**spec) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec)


def constrained_hf_greedy(oracle, prompt: list[int], spec, max_tokens: int) -> list[int]:
    key = (oracle.path, tuple(prompt), spec.key(), max_tokens)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _constrained_hf_greedy(oracle, prompt, spec, max_tokens)
    return _HF_CACHE[key]


_HF_CACHE: dict = {}


def _constrained_hf_greedy(oracle, prompt: list[int], spec, max_tokens: int) -> list[int]:
    """HF greedy ``generate`` with every disallowed token's logit at -inf, the mask from
    a fresh llguidance matcher over the checkpoint's tokenizer (the oracle)."""
    vocab = oracle.hf.config.vocab_size
    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(oracle.tokenizer, n_vocab=vocab, eos_token=EOS),
        spec.llguidance_grammar(),
    )

    def allowed(last):
        if last is not None:
            assert matcher.consume_token(last)
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        return ((bits.unsqueeze(-1) >> torch.arange(8)) & 1).flatten()[:vocab].bool()

    return oracle.masked_greedy(prompt, max_tokens, allowed)


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_json_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    params = SamplingParams(
        temperature=1.0,
        seed=7,
        n=2,
        max_tokens=MAX_TOKENS,
        structured_outputs=structured(json=schema),
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            assert completion.token_ids[-1] == EOS
            jsonschema.validate(json.loads(completion.text), schema)
    assert_all_blocks_free(llm)


def test_regex_and_choice(llm):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    regex = r"[a-c]{2,4}-[0-9]{1,3}"
    choices = ["yes", "no", "perhaps"]
    for spec, check in [
        (structured(regex=regex), lambda t: re.fullmatch(regex, t) is not None),
        (structured(choice=choices), lambda t: t in choices),
    ]:
        params = SamplingParams(
            temperature=1.0, seed=3, n=3, max_tokens=MAX_TOKENS, structured_outputs=spec
        )
        for out in llm.generate(prompts, params, use_tqdm=False):
            for completion in out.outputs:
                assert completion.finish_reason == "stop" and check(completion.text), completion
    assert_all_blocks_free(llm)


def test_json_object(llm):
    """Any JSON object: unbounded, so a random model may run out of tokens inside one;
    those that end are objects, and every one starts as one."""
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        n=4,
        max_tokens=MAX_TOKENS,
        structured_outputs=structured(json_object=True),
    )
    completions = [
        c
        for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for c in out.outputs
    ]
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        assert isinstance(json.loads(c.text), dict)
    assert all(c.text.lstrip().startswith("{") for c in completions)


def test_grammar_in_lark_and_gbnf(llm):
    for grammar in ['start: "a" ("+" "a")*', 'root ::= "a" ("+" "a")*']:
        params = SamplingParams(
            temperature=1.0, seed=5, max_tokens=40, structured_outputs=structured(grammar=grammar)
        )
        for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop"
            assert re.fullmatch(r"a(\+a)*", completion.text), completion.text


def test_greedy_tokens_equal_hf_constrained_by_the_same_grammar(llm, model):
    _, oracle = model
    spec = structured(json=SCHEMAS["bounded_numbers"])
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == constrained_hf_greedy(oracle, prompt, spec, 48)


def test_tensor_parallel_keeps_the_grammar(model):
    """Two ranks' logits reach the sample phase whole, where the grammar masks them:
    greedy tokens are HF's under the same grammar."""
    path, oracle = model
    spec = structured(json=SCHEMAS["bounded_numbers"])
    llm = make_llm(path, block_size=8, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec)
        prompts = PROMPTS[:2]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            assert out.outputs[0].token_ids == constrained_hf_greedy(oracle, prompt, spec, 48)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_n_forks_each_get_their_own_matcher(llm):
    """n = 4 sampled completions fork from one prompt: each is held to the grammar on
    its own (a shared matcher would see the other forks' tokens and refuse)."""
    schema = SCHEMAS["optional_fields"]
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        n=4,
        max_tokens=MAX_TOKENS,
        structured_outputs=structured(json=schema),
    )
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1  # different completions, each valid
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_chunked_prefill_and_prefix_caching_keep_the_grammar(model, mode):
    """A pool that fits one request at a time, chunked prefill of 8 tokens a step and
    the prefix cache on (the prompts share a prefix): every greedy completion is still
    HF's under the same grammar."""
    path, oracle = model
    spec = structured(json=SCHEMAS["defs"])
    prefix = random_prompt(16, seed=99)
    prompts = [prefix + random_prompt(2 + i, seed=50 + i) for i in range(3)]
    max_tokens = 40
    largest = max(blocks_for(len(p) + max_tokens, 8) for p in prompts)
    llm = make_llm(
        path,
        block_size=8,
        num_gpu_blocks=largest + 1,
        preemption_mode=mode,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == constrained_hf_greedy(oracle, prompt, spec, max_tokens)
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_each_spec_compiles_once(llm):
    engine = llm.engine
    spec = structured(regex="[0-9]{3}")
    before = engine.structured_output.num_compiled
    for _ in range(2):
        params = SamplingParams(max_tokens=8, structured_outputs=structured(regex="[0-9]{3}"))
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert engine.structured_output.num_compiled == before + 1
    assert engine.structured_output.grammar_init(spec) is not engine.structured_output.grammar_init(
        spec
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "nosuchtype"}}}), "json"),
        (dict(json="{not json"), "json"),
        (dict(regex="a(b"), "regex"),
        (dict(choice=[]), "choice"),
        (dict(choice=["a", 1]), "choice"),
        (dict(grammar="start: undefined_rule"), "grammar"),
        (dict(json_object=False), "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(**kwargs)


def test_refused_combinations():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=structured(choice=["a"]))
    with pytest.raises(ValueError, match="unsupported fields"):
        SamplingParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})
    params = SamplingParams(structured_outputs={"choice": ["x", "y"]})  # a dict is accepted
    assert params.structured_outputs == structured(choice=["x", "y"])


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_grammar_and_the_greedy_tokens(model, proposer):
    """With speculation on, greedy structured tokens are still HF's under the same
    grammar (the masked argmax), sampled ones validate, and no block is left.  The
    n-gram proposer copies a valid record from the prompt (guesses the grammar allows,
    some of which the masked target keeps); the target as its own draft guesses its
    unmasked argmax (which the grammar mostly cuts).  Oracle: HF + llguidance."""
    path, oracle = model
    schema = SCHEMAS["nested"]
    spec = structured(json=schema)
    record = oracle.tokenizer.encode('{"name": "abc", "inner": {"ok": true}}')
    prompts = [record * 2 + random_prompt(2, seed=7), *PROMPTS[:2]]
    config = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if proposer == "ngram"
        else {"model": str(path), "num_speculative_tokens": 3}
    )
    llm = make_llm(path, block_size=8, speculative_config=config)
    max_tokens = 40
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == constrained_hf_greedy(oracle, prompt, spec, max_tokens)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if proposer == "ngram":
        assert stats["spec_decode_num_accepted_tokens"] > 0
    sampled = SamplingParams(
        temperature=1.0, seed=2, n=2, max_tokens=MAX_TOKENS, structured_outputs=spec
    )
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False):
        for completion in out.outputs:
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), schema)
    assert_all_blocks_free(llm)


def constrained_reference_beam_search(oracle, prompt, params, spec):
    """vLLM's beam search written the slow way (test_beam_search.py's reference), each
    beam with a fresh llguidance matcher of its own: its candidates are the top
    ``2 * beam_width`` of HF's logprobs masked by it and renormalised.  ``[(tokens,
    cum_logprob)]``, best first."""
    vocab = oracle.hf.config.vocab_size
    tokenizer = llguidance.hf.from_tokenizer(oracle.tokenizer, n_vocab=vocab, eos_token=EOS)

    def score(beam):
        tokens, cum = beam[0], beam[1]
        return cum / (len(tokens) - (tokens[-1] == EOS)) ** params.length_penalty

    width = params.beam_width
    live = [(list(prompt), 0.0, llguidance.LLMatcher(tokenizer, spec.llguidance_grammar()))]
    completed = []
    for _ in range(params.max_tokens):
        proposals = []
        for tokens, cum, matcher in live:
            bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
            allowed = ((bits.unsqueeze(-1) >> torch.arange(8)) & 1).flatten()[:vocab].bool()
            logprobs = oracle.next_logprobs(tokens).masked_fill(~allowed, float("-inf"))
            top = logprobs.log_softmax(-1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                if logprob == float("-inf"):
                    continue
                if token == EOS:
                    completed.append((tokens + [token], cum + logprob))
                    continue
                child = matcher.deep_copy()
                assert child.consume_token(token)
                proposals.append((tokens + [token], cum + logprob, child))
        live = sorted(proposals, key=score, reverse=True)[:width]
    beams = completed + [(tokens, cum) for tokens, cum, _ in live]
    return sorted(beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("kind", ["json", "choice"])
def test_beam_search_holds_every_beam_to_the_grammar(model, kind):
    """Beam search with a grammar: the engine's beams (forked, sharing blocks, each
    with its own matcher) are those of the reference above, and every finished beam's
    text is in the grammar (jsonschema; the choice list)."""
    path, oracle = model
    choices = ["red", "green", "blue", "cyan"]
    spec = structured(json=SCHEMAS["defs"]) if kind == "json" else structured(choice=choices)
    llm = make_llm(path, block_size=8)
    params = BeamSearchParams(beam_width=3, max_tokens=30, structured_outputs=spec)
    prompts = PROMPTS[:2]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    finished = 0
    for prompt, out in zip(prompts, outputs):
        expected = constrained_reference_beam_search(oracle, prompt, params, spec)
        assert [s.tokens for s in out.sequences] == [t for t, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            if seq.tokens[-1] == EOS:
                finished += 1
                if kind == "json":
                    jsonschema.validate(json.loads(seq.text), SCHEMAS["defs"])
                else:
                    assert seq.text in choices
    if kind == "choice":
        assert finished == 3 * len(prompts)
    assert_all_blocks_free(llm)


def test_beam_search_checks_its_structured_outputs():
    with pytest.raises(ValueError, match="structured_outputs"):
        BeamSearchParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        BeamSearchParams(structured_outputs={"regex": "a(b"})


def test_a_dead_end_finishes_the_request_saying_why(llm):
    """A matcher that refuses what was drawn (here: forced into an error state before
    the step) ends its sequence with ``abort`` and the reason, not ``stop``; the other
    requests of the step go on."""
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=structured(regex="ab+")
    )
    engine.add_request("dead", PROMPTS[0], params)
    engine.add_request("alive", PROMPTS[1], params)
    engine.step()  # the prompts run; their first tokens are "a"
    engine.requests["dead"].seqs[0].grammar.matcher.consume_token(ord("z"))  # into an error
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    dead, alive = finished["dead"].outputs[0], finished["alive"].outputs[0]
    assert dead.finish_reason == "abort" and "dead end" in dead.stop_reason
    assert alive.finish_reason == "stop" and re.fullmatch("ab+", alive.text)
    assert_all_blocks_free(llm)


def test_apply_grammar_bitmask_against_a_bit_by_bit_loop():
    """Rows ``rows`` masked by their bitmask rows, every other row untouched; the oracle
    reads each token's bit one at a time."""
    from minipaged.structured_output import apply_grammar_bitmask

    gen = torch.Generator().manual_seed(0)
    vocab, rows = 70, [0, 2, 3]  # 70: the last word is partly past the vocabulary
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int32)
    expected = logits.clone()
    for i, row in enumerate(rows):
        for token in range(vocab):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_grammar_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_ignore_eos_still_ends_a_complete_grammar(llm):
    """The grammar complete, only EOS is allowed: it ends the completion even with
    ``ignore_eos`` (which would otherwise only repeat it to ``max_tokens``)."""
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        structured_outputs=structured(choice=["on", "off"]),
    )
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text in ("on", "off") and completion.finish_reason == "stop"
    assert completion.token_ids[-1] == EOS and len(completion.token_ids) == 3

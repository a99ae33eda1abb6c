"""Structured outputs through the xgrammar backend (``structured_outputs_config=
{"backend": "xgrammar"}``).

Oracles: Hugging Face ``generate`` on the same tiny checkpoint, constrained by a fresh
xgrammar matcher (built here from the tokenizer, none of minipaged's code), gives the
greedy tokens; ``jsonschema`` validates JSON completions, Python's ``re`` regex ones.
"""

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")  # the oracle (the dev extra)
xgr = pytest.importorskip("xgrammar")  # absent from a GPU's stock image
pytest.importorskip("llguidance")  # StructuredOutputsParams checks a spec with it

from engine_helpers import EOS, assert_all_blocks_free, make_llm, random_prompt  # noqa: E402
from minipaged import BeamSearchParams, SamplingParams, StructuredOutputsParams  # noqa: E402
from minipaged.config import EngineConfig  # noqa: E402

XGRAMMAR = {"structured_outputs_config": {"backend": "xgrammar"}}
SCHEMA = {
    "type": "object",
    "properties": {
        # Not a string with maxLength: xgrammar 0.2.8 lets raw control characters into
        # one (its `[^"\\\r\n]` class), which a random model's byte tokens do write.
        "name": {"enum": ["ab", "cde"]},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 7]}, "maxItems": 3},
    },
    "required": ["name", "score"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
PROMPTS = [random_prompt(3 + i, seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def model(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def llm(model):
    return make_llm(model[0], block_size=8, **XGRAMMAR)


def xgrammar_hf_greedy(oracle, prompt: list[int], spec, max_tokens: int) -> list[int]:
    """HF greedy ``generate`` with every token a fresh xgrammar matcher over the
    checkpoint's tokenizer disallows at -inf."""
    vocab = oracle.hf.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(
        oracle.tokenizer, vocab_size=vocab, stop_token_ids=[EOS]
    )
    compiler = xgr.GrammarCompiler(info)
    if spec.json is not None:
        compiled = compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=True)
    else:
        compiled = compiler.compile_regex(spec.regex)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def allowed(last):
        if last is not None:
            assert matcher.accept_token(last)
        matcher.fill_next_token_bitmask(bitmask)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[:vocab].bool()

    return oracle.masked_greedy(prompt, max_tokens, allowed)


@pytest.mark.parametrize("spec", [dict(json=SCHEMA), dict(regex=REGEX)], ids=["json", "regex"])
def test_greedy_tokens_equal_hf_constrained_by_xgrammar(llm, model, spec):
    _, oracle = model
    spec = StructuredOutputsParams(**spec)
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == xgrammar_hf_greedy(oracle, prompt, spec, 48)
    assert_all_blocks_free(llm)


def test_bounded_numbers_stop_within_six_fraction_digits(llm):
    """n = 4 forks sampled: each its own matcher (`fork`); each completion ends, and its
    bounded number has at most 6 fraction digits (xgrammar's bound) and validates."""
    params = SamplingParams(
        temperature=1.0,
        seed=7,
        n=4,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            value = json.loads(completion.text)
            jsonschema.validate(value, SCHEMA)
            fraction = re.search(r'"score"\s*:\s*-?\d+(?:\.(\d+))?', completion.text)[1] or ""
            assert len(fraction) <= 6, completion.text
    assert_all_blocks_free(llm)


def test_choice_gbnf_and_beam_search(llm):
    """A choice (an EBNF alternation, quotes and backslashes escaped) and a GBNF grammar
    sampled; beam search (each beam's matcher forked) keeps every finished beam in the
    choice list."""
    choices = ['say "hi"', "a\\b", "é"]
    sampled = SamplingParams(
        temperature=1.0,
        seed=3,
        n=3,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for out in llm.generate(prompts, sampled, use_tqdm=False):
        assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)
    gbnf = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(grammar='root ::= "a" ("+" "a")*'),
    )
    for out in llm.generate(prompts, gbnf, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(r"a(\+a)*", out.outputs[0].text), out.outputs[0].text
    beams = BeamSearchParams(
        beam_width=3, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    for out in llm.beam_search(prompts[:1], beams):
        finished = [s for s in out.sequences if s.tokens[-1] == EOS]
        assert finished and all(s.text in choices for s in finished)
    assert_all_blocks_free(llm)


def test_speculative_decoding_rolls_the_matcher_back(model):
    """n-gram guesses copied from a valid record in the prompt are checked against the
    grammar and rolled back: greedy tokens are those of HF under xgrammar's mask."""
    path, oracle = model
    spec = StructuredOutputsParams(json=SCHEMA)
    record = oracle.tokenizer.encode('{"name": "cde", "score": 1.25}')
    prompts = [record * 2 + random_prompt(2, seed=7), PROMPTS[0]]
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = make_llm(path, block_size=8, speculative_config=config, **XGRAMMAR)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == xgrammar_hf_greedy(oracle, prompt, spec, 40)
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


def test_a_grammar_xgrammar_cannot_compile_is_refused_naming_the_field(llm):
    """A Lark grammar with llguidance's ``%llguidance`` directive compiles under
    guidance but not xgrammar: a ValueError naming the field, the engine unharmed."""
    spec = StructuredOutputsParams(grammar='%llguidance {}\nstart: "a"')
    params = SamplingParams(max_tokens=8, structured_outputs=spec)
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar .*xgrammar"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"backend": "outlines"}, "'backend' 'outlines' is not supported"),
        ({"backend": "lm-format-enforcer"}, "'backend' 'lm-format-enforcer' is not supported"),
        ({"backend": "xgrammer"}, "structured_outputs_config 'backend' must be one of"),
        ({"backend": "xgrammar", "disable_any_whitespace": True}, "disable_any_whitespace"),
        ("xgrammar", "structured_outputs_config must be a dict"),
    ],
)
def test_bad_structured_outputs_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", structured_outputs_config=config)


def test_auto_is_guidance_in_minipaged():
    config = EngineConfig(model="m")
    assert config.structured_outputs_config.backend == "auto"
    assert config.structured_outputs_config.resolved_backend == "guidance"


def test_serve_takes_the_flag_and_serves_with_xgrammar(model):
    """``minipaged serve --structured-outputs-config '{"backend": "xgrammar"}'`` builds
    an xgrammar engine; through the official client its JSON validates; vLLM's older
    per-request ``guided_decoding_backend`` naming another backend, and a grammar
    xgrammar cannot compile, are 400s naming the field."""
    pytest.importorskip("fastapi")  # the server extra
    openai = pytest.importorskip("openai")
    from minipaged.arg_utils import engine_kwargs
    from minipaged.cli import build_parser
    from server_helpers import MODEL, in_process_app, openai_client

    flag = ["--structured-outputs-config", '{"backend": "xgrammar"}']
    kwargs = engine_kwargs(build_parser().parse_args(["serve", "m", *flag]))
    assert kwargs["structured_outputs_config"] == {"backend": "xgrammar"}
    assert EngineConfig(model="m", **kwargs).structured_outputs_config.backend == "xgrammar"
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}}
    schema |= {"required": ["x"], "additionalProperties": False}
    request = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "A number."}],
        temperature=1.0,
        seed=4,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    for url, engine, _ in in_process_app(model[0], engine_kwargs=XGRAMMAR):
        assert engine.facts.config.structured_outputs_config.backend == "xgrammar"
        with openai_client(url) as client:
            response = client.chat.completions.create(
                **request, extra_body={"guided_decoding_backend": "xgrammar"}
            )
            assert response.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(response.choices[0].message.content), schema)
            with pytest.raises(openai.BadRequestError, match="guided_decoding_backend"):
                client.chat.completions.create(
                    **request, extra_body={"guided_decoding_backend": "guidance"}
                )
            # A grammar llguidance takes and xgrammar does not: a 400 naming the field.
            grammar = '%llguidance {}\nstart: "a"'
            with pytest.raises(openai.BadRequestError, match=r"structured_outputs\.grammar"):
                client.completions.create(
                    model=MODEL, prompt="a", max_tokens=4, extra_body={"guided_grammar": grammar}
                )


def test_a_dead_end_finishes_the_request_saying_why(llm):
    """A matcher that refused a token (here: fed one the grammar disallows before the
    step) is at a dead end for good: its sequence ends with ``abort`` and the reason;
    the other request of the step goes on."""
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="ab+")
    )
    engine.add_request("dead", PROMPTS[0], params)
    engine.add_request("alive", PROMPTS[1], params)
    engine.step()  # the prompts run; their first tokens are "a"
    assert not engine.requests["dead"].seqs[0].grammar.accept_token(ord("z"))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    dead, alive = finished["dead"].outputs[0], finished["alive"].outputs[0]
    assert dead.finish_reason == "abort" and f"token {ord('z')}" in dead.stop_reason
    assert alive.finish_reason == "stop" and re.fullmatch("ab+", alive.text)
    assert_all_blocks_free(llm)

"""SamplingParams and BeamSearchParams: vLLM's names, defaults and validation.

The oracle is vLLM's Python API and its rules:
every bad argument raises ValueError naming the argument and showing the bad value.
"""

import math

import pytest

from minipaged.sampling_params import BeamSearchParams, SamplingParams

INVALID_SAMPLING = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("n", None),
    ("temperature", -1.0),
    ("temperature", -1e-9),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "0.5"),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.0001),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", "7"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", None),
    ("max_tokens", 2.0),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop", b"x"),
    ("stop_token_ids", 5),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("output_kind", "delta"),
    ("output_kind", None),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", None),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", "1"),
    ("min_tokens", -1),
    ("min_tokens", 17),
    ("min_tokens", 1.0),
    ("min_tokens", None),
    ("best_of", 2),
    ("best_of", 0),
]

INVALID_BEAM = [
    ("beam_width", 0),
    ("beam_width", -1),
    ("beam_width", 2.0),
    ("beam_width", None),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("length_penalty", math.inf),
    ("length_penalty", math.nan),
    ("length_penalty", "1"),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize(
    "cls,name,value",
    [(SamplingParams, *c) for c in INVALID_SAMPLING]
    + [(BeamSearchParams, *c) for c in INVALID_BEAM],
)
def test_invalid_argument_raises_naming_it_and_its_value(cls, name, value):
    with pytest.raises(ValueError) as info:
        cls(**{name: value})
    message = str(info.value)
    assert message.startswith(name + " ") and repr(value) in message, message


def test_defaults_are_the_contract():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
        None,
        16,
    )
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ([], [], False, None)
    b = BeamSearchParams()
    assert (b.beam_width, b.max_tokens, b.length_penalty, b.ignore_eos) == (4, 16, 1.0, False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 1},
        {"n": 64},
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 1e-9},
        {"temperature": 5},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 1},
        {"top_k": 10**6},
        {"min_p": 0},
        {"min_p": 1},
        {"seed": 0},
        {"top_p": 1e-300},
        {"repetition_penalty": 1e-3},
        {"repetition_penalty": 10},
        {"presence_penalty": -2},
        {"presence_penalty": 2},
        {"frequency_penalty": -2},
        {"frequency_penalty": 2},
        {"min_tokens": 16},
        {"min_tokens": 0},
        {"best_of": 1},
        {"n": 3, "best_of": 3},
        {"max_tokens": 4, "min_tokens": 4},
        {"seed": 2**64 - 1},
        {"max_tokens": 1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"stop": ["a", "bc"]},
        {"stop": ("a",)},
        {"stop_token_ids": [0, 2]},
        {"stop_token_ids": ()},
        {"ignore_eos": True},
    ],
)
def test_valid_edge_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name in ("stop", "stop_token_ids"):
            assert getattr(p, name) == list(value)
        else:
            assert getattr(p, name) == value


@pytest.mark.parametrize(
    "kwargs",
    [
        {"beam_width": 1},
        {"max_tokens": 1},
        {"length_penalty": 0},
        {"length_penalty": -2.5},
        {"ignore_eos": True},
    ],
)
def test_valid_beam_search_params(kwargs):
    b = BeamSearchParams(**kwargs)
    assert all(getattr(b, k) == v for k, v in kwargs.items())


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3,)).stop_token_ids == [3]


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # below vLLM's _SAMPLING_EPS
    assert not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams().greedy

"""Structured outputs through the OpenAI-compatible server, with the official client.

OpenAI's ``response_format`` (``json_schema``, ``json_object``), vLLM's
``structured_outputs`` and its older ``guided_*`` fields; bad specs are a 400 naming
the field.  Oracles: ``jsonschema``, Python's ``re``, the choice list.
"""

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")  # the server extra
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from server_helpers import MODEL, in_process, openai_client  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 1, "maximum": 50},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}
SAMPLED = dict(temperature=1.0, seed=4, max_tokens=80)
MESSAGES = [{"role": "user", "content": "Name a city."}]


@pytest.fixture(scope="module")
def base_url(tiny):
    path, _ = tiny("llama")
    for url, _ in in_process(path):
        yield url


@pytest.fixture
def client(base_url):
    with openai_client(base_url) as client:
        yield client


def test_response_format_json_schema_in_chat(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
        },
        **SAMPLED,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        stream=True,
        temperature=0,
        max_tokens=60,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.lstrip().startswith("{")
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"regex": "[xyz]{3}-[0-9]{2}"}}, r"[xyz]{3}-[0-9]{2}"),
        ({"guided_regex": "(ab|cd)+!"}, r"(ab|cd)+!"),
        ({"guided_choice": ["alpha", "beta"]}, r"alpha|beta"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
        ({"guided_grammar": 'start: "k" ("," "k")*'}, r"k(,k)*"),
    ],
)
def test_vllm_fields_in_completions(client, extra, check):
    response = client.completions.create(
        model=MODEL, prompt="Answer:", n=2, extra_body=extra, **SAMPLED
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(check, choice.text), choice.text


def test_guided_json_in_completions(client):
    response = client.completions.create(
        model=MODEL, prompt="{", extra_body={"guided_json": SCHEMA}, **SAMPLED
    )
    jsonschema.validate(json.loads(response.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"json": {"type": "nosuchtype"}}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ],
)
def test_bad_specs_are_a_400_naming_the_field(base_url, body, param):
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 4, **body},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]

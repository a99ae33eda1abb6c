"""Tool calling in /v1/chat/completions, with the official openai client.

``tool_choice`` named or ``required`` holds the completion to the tools' parameter
schemas, so on the tiny random model every call's arguments validate (oracle:
``jsonschema``); ``auto`` needs vLLM's flags and reads Hermes ``<tool_call>`` blocks
(a unit test on hand-written text); the tools, an assistant's calls and the tool's
answer reach the chat template (oracle: the Hugging Face tokenizer rendering the same
messages).
"""

import json
import shutil

import pytest
from transformers import AutoTokenizer

pytest.importorskip("fastapi")  # the server extra
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from minipaged.server.tools import HermesToolParser  # noqa: E402
from server_helpers import MODEL, in_process_app, openai_client  # noqa: E402

# A Hermes-style template that renders tools, calls and tool answers (as Qwen2.5's does).
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools>{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
ENGINE = dict(max_model_len=1024)  # the tools' schemas are in the prompt, a byte a token
SAMPLED = dict(temperature=1.0, seed=3, max_tokens=120)
# "required" is an array of calls of any length: room for a few.
REQUIRED = {**SAMPLED, "max_tokens": 400}


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    """The tiny checkpoint, its chat template one that renders tools."""
    path, _ = tiny("llama")
    copy = tmp_path_factory.mktemp("tools") / "tiny"
    shutil.copytree(path, copy)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    return copy


@pytest.fixture(scope="module")
def base_url(checkpoint):
    app_kwargs = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")
    for url, _, _ in in_process_app(checkpoint, engine_kwargs=ENGINE, **app_kwargs):
        yield url


@pytest.fixture
def client(base_url):
    with openai_client(base_url) as client:
        yield client


def assert_valid_calls(tool_calls, names=SCHEMAS):
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_calls_that_function_with_valid_arguments(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        n=2,
        **SAMPLED,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls, names={"get_time"})


def test_required_tool_choice_makes_calls_whose_arguments_validate(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2, **REQUIRED
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message.tool_calls)


def test_required_tool_calls_stream_as_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True, **REQUIRED
    )
    calls, finish = {}, None
    for chunk in stream:
        (choice,) = chunk.choices
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": delta.id})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tools_and_a_conversation_with_calls_reach_the_chat_template(client, checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    arguments = json.dumps({"city": "Paris", "unit": "c"})
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    rendered = [
        *MESSAGES,
        {
            **messages[1],
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": json.loads(arguments)}}
            ],
        },
        messages[2],
    ]
    text = tokenizer.apply_chat_template(
        rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in text and "<tool_call>" in text and "21 C, sunny" in text
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert response.usage.prompt_tokens == expected
    assert response.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "nope"}}, {"type": "function"}, "sometimes"],
)
def test_bad_tool_choice_is_a_400_naming_it(client, tool_choice):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=2
        )
    assert error.value.body["param"] == "tool_choice"


def test_auto_without_the_flags_is_a_400(checkpoint):
    for url, _, _ in in_process_app(checkpoint, engine_kwargs=ENGINE):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=2
                )
            assert error.value.body["param"] == "tool_choice"
            assert "--enable-auto-tool-choice" in error.value.body["message"]
            # named choice needs no flags
            response = client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                **SAMPLED,
            )
            assert_valid_calls(response.choices[0].message.tool_calls, names={"get_weather"})


def test_auto_returns_text_when_the_model_writes_no_call(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", **SAMPLED
    )
    (choice,) = response.choices
    # The random model writes no <tool_call> block: its text comes back as content.
    assert "<tool_call>" not in response.choices[0].message.content
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


def test_hermes_parser_on_hand_written_text():
    text = (
        "Let me check both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        "</tool_call>\n"
        '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'
    )
    content, calls = HermesToolParser().extract_tool_calls(text)
    assert content == "Let me check both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "c"}
    assert json.loads(calls[1].arguments) == {"zone": 1}
    assert len({c.id for c in calls}) == 2

    # Not JSON: no call, the text kept as written; no block at all: just content.
    broken = "<tool_call>{name: get_time}</tool_call>"
    assert HermesToolParser().extract_tool_calls(broken) == (broken, [])
    assert HermesToolParser().extract_tool_calls("plain") == ("plain", [])


def test_hermes_parser_reads_smollm2s_list_of_calls():
    """SmolLM2-1.7B-Instruct's tool template asks for one block holding a JSON list of
    calls, ``[]`` when none fits; hand-written in that format."""
    text = (
        "<tool_call>[\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},\n'
        '{"name": "get_time", "arguments": {"zone": 2}}\n'
        "]</tool_call>"
    )
    content, calls = HermesToolParser().extract_tool_calls(text)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "c"}
    assert json.loads(calls[1].arguments) == {"zone": 2}
    assert HermesToolParser().extract_tool_calls("No tool fits.<tool_call>[]</tool_call>") == (
        "No tool fits.",
        [],
    )
    mixed = '<tool_call>[{"name": "get_time"}, 3]</tool_call>'  # not all calls: kept as text
    assert HermesToolParser().extract_tool_calls(mixed) == (mixed, [])


def test_the_serve_flags_are_checked_as_vllm_does():
    from minipaged.server.app import check_tool_flags

    with pytest.raises(ValueError, match="tool_call_parser"):
        check_tool_flags(True, None)
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes"):
        check_tool_flags(True, "mistral")
    check_tool_flags(True, "hermes")
    check_tool_flags(False, None)


def test_auto_stream_sends_the_same_text_as_the_answer(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", **SAMPLED)
    answer = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.message.content
    assert chunks[-1].choices[0].finish_reason == answer.finish_reason


def test_an_auto_stream_sends_text_until_a_call_then_the_call_whole():
    from types import SimpleNamespace

    from minipaged.server.tools import ChatTools

    pieces = [
        "Let me",
        " check.\n<tool",
        "_call>",
        '{"name": "get_time", ',
        '"arguments": {"zone": 1}}',
    ]
    pieces += ["</tool_call>"]
    tools, deltas = ChatTools("auto"), []
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        completion = SimpleNamespace(index=0, text=piece, finish_reason=finish)
        deltas.append(tools.message(completion, stream=True))
    streamed = "".join(d.get("content") or "" for d, _ in deltas)
    assert streamed == "Let me check.\n"
    assert deltas[0] == ({"content": "Let me"}, None)
    last, finish_reason = deltas[-1]
    assert finish_reason == "tool_calls"
    (call,) = last["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"zone": 1}

"""Tool calling in ``/v1/chat/completions`` (vLLM's ``entrypoints/openai/tool_parsers``
and its ``tool_choice`` handling in ``serving_chat.py``).

The tools reach the model through its chat template (``apply_chat_template(...,
tools=...)``), which tells it how to call one: Hermes-style templates (Qwen2.5, Hermes)
ask for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, SmolLM2-1.7B-Instruct's
for a JSON list of such calls in one ``<tool_call>`` block (SmolLM2-135M-Instruct's own
template renders no tools: with it only ``required`` and named choices make calls).
What the model writes back becomes ``tool_calls`` in one of two ways, as in vLLM:

- ``tool_choice="auto"`` (needs ``--enable-auto-tool-choice --tool-call-parser hermes``):
  the model writes freely; `HermesToolParser` finds the calls in its text.
- ``"required"`` or a named function: the completion is held by a grammar (a structured
  output) to a JSON schema built from the tools' parameter schemas (`required_schema`,
  or the named tool's own), so every call parses and its arguments validate.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from minipaged.server.limits import TOOL_CALL_PARSERS
from minipaged.server.protocol import FieldError

__all__ = ["TOOL_CALL_PARSERS", "ChatTools", "HermesToolParser", "ToolCall"]


@dataclass
class ToolCall:
    """One call: a function's name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class HermesToolParser:
    """Calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (vLLM's ``Hermes2ProToolParser``), or, SmolLM2's way (the tool-calling template of
    SmolLM2-1.7B-Instruct), as one block holding a JSON list of such calls:
    ``<tool_call>[{...}, {...}]</tool_call>`` (``[]``: no call).  Text outside the tags
    is the message's content; a block that is not JSON calls (each with a ``name``)
    stays in the content, as written."""

    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a complete completion."""
        calls, kept, parsed = [], [], False
        for match in self._block.finditer(text):
            block_calls = self._parse(match.group(1))
            if block_calls is None:
                kept.append(match.group(0))
            else:
                parsed = True  # (SmolLM2 writes ``[]`` when no tool fits)
                calls.extend(block_calls)
        if not parsed:
            return text, []
        content = self._block.sub("", text)
        content = (content + "".join(kept)).strip()
        return content or None, calls

    @staticmethod
    def _parse(block: str) -> list[ToolCall] | None:
        """The calls of one block: a call object, or a list of them."""
        try:
            value = json.loads(block.strip())
        except json.JSONDecodeError:
            return None
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in values):
            return None
        return [
            ToolCall(
                v["name"],
                json.dumps(v.get("arguments", v.get("parameters", {})), ensure_ascii=False),
            )
            for v in values
        ]


def check_tools(tools: list | None, tool_choice) -> None:
    """``FieldError`` naming ``tools`` or ``tool_choice`` for a malformed request."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice", "tool_choice needs tools")
        return
    if not isinstance(tools, list) or not tools:
        raise FieldError("tools", f"tools must be a non-empty list, got {tools!r}")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("parameters", {}), dict)
        ):
            raise FieldError(
                "tools",
                "each tool must be {'type': 'function', 'function': {'name': str, "
                f"'parameters': a JSON schema}}, got {tool!r}",
            )
    if tool_choice in (None, "none", "auto", "required"):
        return
    name = named_choice(tool_choice)
    if name not in {t["function"]["name"] for t in tools}:
        raise FieldError("tool_choice", f"tool_choice names {name!r}, which is not in tools")


def named_choice(tool_choice) -> str:
    """The function a named ``tool_choice`` names."""
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (
        isinstance(function, dict)
        and tool_choice.get("type") == "function"
        and isinstance(function.get("name"), str)
    ):
        raise FieldError(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}, "
            f"got {tool_choice!r}",
        )
    return function["name"]


def parameters(tool: dict) -> dict:
    """A tool's parameter schema (any object, if it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def required_schema(tools: list[dict]) -> dict:
    """``tool_choice="required"``: a non-empty array of calls, each the name of one
    tool and arguments valid against its parameters (vLLM's
    ``_get_json_schema_from_tool``)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool["function"]["name"]]},
                "parameters": parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def forced_schema(tools: list[dict], tool_choice) -> dict | None:
    """The JSON schema a ``required`` or named ``tool_choice`` holds the completion to
    (None: the completion is free)."""
    if tool_choice == "required":
        return required_schema(tools)
    if isinstance(tool_choice, dict):
        name = named_choice(tool_choice)
        return parameters(next(t for t in tools if t["function"]["name"] == name))
    return None


def forced_calls(text: str, tool_choice) -> list[ToolCall]:
    """The calls of a completion held to `forced_schema` (the grammar guarantees its
    shape, unless it was cut short by ``max_tokens``: then no calls, the text stays)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if tool_choice == "required":
        return [
            ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in value
        ]
    return [ToolCall(named_choice(tool_choice), json.dumps(value, ensure_ascii=False))]


class ChatTools:
    """One chat request's tool calls, read from its completions: the Hermes parser's
    for ``auto``, `forced_calls` for ``required`` or a named function.

    A stream's text goes out as it comes, up to where a ``<tool_call>`` block might
    begin (``auto``); what follows is held back until the completion ends (a call is
    parsed whole), then sent as one delta with its ``tool_calls``, or its text if it
    made none.  A forced choice's text is all call: held back whole."""

    def __init__(self, tool_choice) -> None:
        self.tool_choice = tool_choice
        self.parser = HermesToolParser()
        self.texts: dict[int, str] = {}  # a stream's text so far, per completion
        self.sent: dict[int, int] = {}  # how much of it went out as content

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.tool_choice == "auto":
            return self.parser.extract_tool_calls(text)
        calls = forced_calls(text, self.tool_choice)
        return (None if calls else text), calls

    def message(self, completion, stream: bool) -> tuple[dict, str | None]:
        """(message or delta, finish_reason) for ``completion``: "tool_calls" when it
        ended with calls, as OpenAI says."""
        index = completion.index
        text = self.texts.get(index, "") + completion.text
        sent = self.sent.get(index, 0)
        if stream and completion.finish_reason is None:
            self.texts[index] = text
            safe = sent if self.tool_choice != "auto" else max(sent, plain_prefix(text))
            self.sent[index] = safe
            return ({"content": text[sent:safe]} if safe > sent else {}), None
        content, calls = self.calls(text[sent:])
        if not calls:
            return {"content": content}, completion.finish_reason
        tool_calls = [call.as_dict() for call in calls]
        if stream:
            tool_calls = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        finish_reason = "tool_calls" if completion.finish_reason == "stop" else None
        return {"content": content, "tool_calls": tool_calls}, (
            finish_reason or completion.finish_reason
        )


def plain_prefix(text: str, tag: str = "<tool_call>") -> int:
    """How much of ``text`` is surely no part of a tool call: up to the first ``tag``,
    or short of a tail that could begin one."""
    if tag in text:
        return text.index(tag)
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)

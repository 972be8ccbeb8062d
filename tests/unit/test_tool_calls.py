"""Tool calling on the HTTP side: what ``tools``/``tool_choice`` ask for, and the parsers
that turn the model's text into OpenAI ``tool_calls``, fed whole or in pieces."""

from __future__ import annotations

import json

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.server.tools import (
    ArrayCallStream,
    JsonCallStream,
    NamedCallStream,
    TaggedCallStream,
    parse,
    parser_for_template,
    plan_tools,
)
from tokenmill.structured.grammar import check_structured_output

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
NAMED = {"type": "function", "function": {"name": "add"}}


def plan(tool_choice, tools=(WEATHER, ADD), parallel=None, supports_tools=True,
         parser="hermes"):
    return plan_tools(list(tools), tool_choice, parallel, supports_tools, parser)


def test_plans() -> None:
    assert plan(None, tools=()).mode == "none"
    assert plan(None).mode == "auto" and plan(None).tools == [WEATHER, ADD]
    none = plan("none")
    assert none.mode == "none" and none.tools is None and none.stream() is None
    named = plan(NAMED)
    assert named.function == "add" and json.loads(named.constraint.spec) == \
        ADD["function"]["parameters"]
    required = plan("required")
    schema = json.loads(required.constraint.spec)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == \
        ["get_weather", "add"]
    assert json.loads(plan("required", parallel=False).constraint.spec)["maxItems"] == 1
    for p in (named, required):
        check_structured_output(p.constraint)
    no_parameters = plan({"type": "function", "function": {"name": "f"}},
                         tools=[{"type": "function", "function": {"name": "f"}}])
    assert json.loads(no_parameters.constraint.spec) == {"type": "object"}


@pytest.mark.parametrize("kwargs,param", [
    ({"tool_choice": "auto", "supports_tools": False}, "tool_choice"),
    ({"tool_choice": "required", "tools": ()}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": (WEATHER, WEATHER)}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools"),
])
def test_bad_plans_name_the_field(kwargs, param) -> None:
    with pytest.raises(InvalidParameterError) as raised:
        plan(**kwargs)
    assert raised.value.param == param


def test_required_and_named_still_work_without_template_support() -> None:
    assert plan("required", supports_tools=False).mode == "required"
    assert plan(NAMED, supports_tools=False).mode == "named"


def test_parser_follows_the_template() -> None:
    assert parser_for_template("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert parser_for_template("<|python_tag|>{{ tools }} Environment: ipython") == \
        "llama3_json"
    assert parser_for_template(None) == "hermes"


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def streamed(stream_type, text: str, size: int, *args) -> tuple[str, list[dict]]:
    """The text fed ``size`` characters at a time; deltas merged as a client does."""
    stream = stream_type(*args)
    content = ""
    calls: list[dict] = []
    deltas = []
    for piece in pieces(text, size):
        c, d = stream.feed(piece)
        content += c
        deltas += d
    c, d = stream.finish()
    content += c
    deltas += d
    for delta in deltas:
        if delta["index"] == len(calls):
            assert delta["id"].startswith("call_") and delta["type"] == "function"
            calls.append({"name": delta["function"]["name"], "arguments": ""})
        else:
            assert "id" not in delta and "name" not in delta["function"]
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


def whole(stream_type, text: str, *args) -> tuple[str, list[dict]]:
    content, calls = parse(stream_type(*args), text)
    return content, [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in calls]


HERMES_CASES = [
    ("plain text, no calls <tool", "plain text, no calls <tool", []),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n',
     "Let me check.\n",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),  # unclosed
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"name": "add", "arguments": {}}</tool_call>\nand more text',
     "\nand more text", [("add", {})]),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_calls_whole_and_in_every_piece_size(text, content, calls) -> None:
    for size in (1, 2, 3, 7, len(text) or 1):
        got_content, got_calls = streamed(TaggedCallStream, text, size)
        assert got_content == content, size
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls, size
    assert whole(TaggedCallStream, text) == streamed(TaggedCallStream, text, len(text) or 1)


@pytest.mark.parametrize("text,content,calls", [
    ("Paris is sunny.", "Paris is sunny.", []),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),
    ('  {"name": "add", "parameters": {"a": 1}', '  {"name": "add", "parameters": {"a": 1}',
     []),  # cut short: the text is content
    ('{"not": "a call"}', '{"not": "a call"}', []),
])
def test_llama3_json_calls(text, content, calls) -> None:
    for size in (1, 4, len(text)):
        got_content, got_calls = streamed(JsonCallStream, text, size)
        assert got_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls


def test_required_array_streams_each_calls_raw_arguments() -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}"}},\n'
            ' {"name":"add","parameters":{"a":1,"b":{"nested":[1,2]}}}]')
    for size in (1, 2, 5, len(text)):
        content, calls = streamed(ArrayCallStream, text, size)
        assert content == ""
        assert calls == [{"name": "get_weather", "arguments": '{"city": "Pa\\"ris}"}'},
                         {"name": "add", "arguments": '{"a":1,"b":{"nested":[1,2]}}'}]
    # cut by max_tokens: the arguments so far
    cut = text.index("ris")
    content, calls = streamed(ArrayCallStream, text[:cut], 3)
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Pa\\"'}]


def test_named_call_is_the_whole_text() -> None:
    assert streamed(NamedCallStream, '{"a": 1, "b": 2}', 3, "add") == \
        ("", [{"name": "add", "arguments": '{"a": 1, "b": 2}'}])
    assert whole(NamedCallStream, "", "add") == ("", [{"name": "add", "arguments": ""}])

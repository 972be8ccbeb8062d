"""``/v1/messages`` and ``/v1/messages/count_tokens`` through the official ``anthropic``
client: system, stop sequences, sampling fields in the body, tools with tool_use and
tool_result, Anthropic's streaming events, exact usage, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

GREEDY = {"model": "tiny", "extra_body": {"temperature": 0}}
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def claude(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.base_url, api_key="unused", max_retries=0)


def prompt_tokens(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(server.base_url + "/tokenize", json=body, timeout=30).json()["count"]


def input_tokens(usage) -> int:
    """All the prompt's tokens: Anthropic counts those read from the cache apart."""
    return usage.input_tokens + usage.cache_read_input_tokens


def test_message_matches_chat_and_counts_exactly(tiny_server, claude, client) -> None:
    message = claude.messages.create(max_tokens=8, system="Be brief.", messages=USER, **GREEDY)
    chat = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert message.type == "message" and message.role == "assistant"
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    counted = claude.messages.count_tokens(model="tiny", system="Be brief.", messages=USER)
    assert input_tokens(message.usage) == counted.input_tokens == chat.usage.prompt_tokens
    assert counted.input_tokens == prompt_tokens(
        tiny_server, [{"role": "system", "content": "Be brief."}, *USER])
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length"
                                   else "end_turn")


def test_stream_has_anthropics_events_and_the_same_result(claude) -> None:
    full = claude.messages.create(max_tokens=10, messages=USER, **GREEDY)
    with claude.messages.stream(max_tokens=10, messages=USER, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "thinking", "input_json")]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None
    assert input_tokens(start.usage) == input_tokens(full.usage)
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.output_tokens == full.usage.output_tokens
    assert delta.delta.stop_reason == full.stop_reason
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == full.content[0].text


def test_stop_sequence_ends_the_message(claude) -> None:
    text = claude.messages.create(max_tokens=12, messages=USER, **GREEDY).content[0].text
    stop = text.strip()[-2:]  # text the greedy answer surely writes
    message = claude.messages.create(max_tokens=12, messages=USER, stop_sequences=[stop],
                                     **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text


def test_sampling_fields_in_the_body(claude) -> None:
    body = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    message = claude.messages.create(model="tiny", max_tokens=4, messages=USER, extra_body=body)
    assert message.usage.output_tokens <= 4
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(model="tiny", max_tokens=4, messages=USER,
                               extra_body={"top_p": 0})
    assert error.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "top_p must be in (0, 1]"}}


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                      "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_gives_tool_use(claude, stream) -> None:
    args = {"max_tokens": 40, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
            **GREEDY}
    if stream:
        with claude.messages.stream(**args) as events:
            partial = "".join(e.delta.partial_json for e in events
                              if e.type == "content_block_delta")
            message = events.get_final_message()
    else:
        message = claude.messages.create(**args)
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input["city"], str)
    assert message.stop_reason == "tool_use"
    if stream:
        assert json.loads(partial) == call.input


def test_tool_result_round_trip_counts_as_chat(tiny_server, claude) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    counted = claude.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER])
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    assert counted.input_tokens == prompt_tokens(tiny_server, chat, tools)
    message = claude.messages.create(max_tokens=3, messages=messages, tools=[WEATHER],
                                     tool_choice={"type": "auto"}, **GREEDY)
    assert input_tokens(message.usage) == counted.input_tokens


@pytest.mark.parametrize("body, status, kind", [
    ({"messages": USER}, 400, "invalid_request_error"),  # no max_tokens
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error"),
    ({"max_tokens": 0, "messages": USER}, 400, "invalid_request_error"),
    ({"max_tokens": 1000, "messages": USER}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "tool"}}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": USER, "model": "claude-nonexistent"}, 404,
     "not_found_error"),
])
def test_errors_have_anthropics_shape(tiny_server, body, status, kind) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/messages", json={"model": "tiny", **body},
                   timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == kind and error["error"]["message"]


def test_bad_json_and_wrong_method_have_anthropics_shape(tiny_server) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.get(tiny_server.base_url + "/v1/messages/count_tokens", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_server_keeps_serving_after_bad_input(tiny_server, claude) -> None:
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny", max_tokens=1000, messages=USER)  # > the context
    assert claude.messages.create(max_tokens=2, messages=USER, **GREEDY).usage.output_tokens
    tiny_server.wait_idle()

"""``/v1/responses`` through the official ``openai`` client: string and message input,
instructions, streaming with the official events, structured outputs, function tools,
exact usage, and 400s for bad or stateful input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

GREEDY = {"model": "tiny", "temperature": 0}


def prompt_tokens(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(server.base_url + "/tokenize", json=body, timeout=30).json()["count"]


def test_string_input_matches_chat_and_counts_exactly(tiny_server, client) -> None:
    response = client.responses.create(input="Hello there", max_output_tokens=8, **GREEDY)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, **GREEDY)
    assert response.object == "response" and response.model == "tiny"
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(
        tiny_server, [{"role": "user", "content": "Hello there"}])
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and usage.output_tokens == 8
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_instructions_and_message_list(tiny_server, client) -> None:
    items = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Count to three."}]}]
    response = client.responses.create(input=items, instructions="Be brief.",
                                       max_output_tokens=4, top_p=0.9, **GREEDY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Count to three."}]
    assert response.usage.input_tokens == prompt_tokens(tiny_server, messages)
    assert response.instructions == "Be brief." and response.top_p == 0.9


def test_stream_has_the_official_events_and_the_same_result(client) -> None:
    full = client.responses.create(input="Tell me a story", max_output_tokens=10, **GREEDY)
    with client.responses.stream(input="Tell me a story", max_output_tokens=10,
                                 **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.usage is None and events[0].response.status == "in_progress"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens == full.usage.input_tokens
    assert final.status == full.status


def test_text_format_json_schema_goes_through_the_grammar(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    response = client.responses.create(
        input="Answer in JSON", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}}, **GREEDY)
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text)["ok"], bool)
    assert response.text.format.type == "json_schema"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_tool_gives_a_function_call_item(client, stream) -> None:
    args = {"input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 40,
            "tool_choice": {"type": "function", "name": "get_weather"}, **GREEDY}
    if stream:
        with client.responses.stream(**args) as events:
            arguments = "".join(e.delta for e in events
                                if e.type == "response.function_call_arguments.delta")
            response = events.get_final_response()
    else:
        response = client.responses.create(**args)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    if stream:
        assert arguments == call.arguments


def test_function_call_round_trip_is_rendered_as_chat(tiny_server, client) -> None:
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = client.responses.create(input=items, tools=[WEATHER], tool_choice="auto",
                                       max_output_tokens=3, **GREEDY)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                    if k != "type"}}]
    assert response.usage.input_tokens == prompt_tokens(tiny_server, messages, chat_tools)


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "16"}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nonsense"}}}}, "text"),
    ({}, "input"),
])
def test_bad_input_is_a_400_with_openai_error(tiny_server, body, param) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/responses", json={"model": "tiny", **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_client_raises_and_server_keeps_serving(tiny_server, client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input="hi", previous_response_id="resp_1", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="hi", model="other")
    assert client.responses.create(input="hi", max_output_tokens=2, **GREEDY).usage
    tiny_server.wait_idle()

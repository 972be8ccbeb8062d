"""The pieces the Responses and Messages APIs share with chat: blocks assembled from chat
deltas, each API's request translated into a chat request, and the end of a stream the
engine fails midway."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.frontend.outputs import ChoiceDelta
from tokenmill.server.anthropic import MessagesServing, _Message
from tokenmill.server.anthropic_protocol import MessagesRequest
from tokenmill.server.blocks import BlockAssembler
from tokenmill.server.chat_shaped import Output
from tokenmill.server.responses import ResponsesServing, _Response
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving import EngineFailed
from tokenmill.server.usage import UsageCounter


def events(assembler: BlockAssembler, *deltas: dict) -> list[tuple[str, str, str]]:
    out = []
    for delta in deltas:
        out += [(e.type, e.block.kind, e.text) for e in assembler.feed(delta)]
    out += [(e.type, e.block.kind, e.text) for e in assembler.finish()]
    return out


def call(index: int, arguments: str, name: str | None = None) -> dict:
    function = {"arguments": arguments, **({"name": name} if name else {})}
    return {"index": index, **({"id": f"call_{index}", "type": "function"} if name else {}),
            "function": function}


def test_blocks_follow_reasoning_text_and_calls() -> None:
    assembler = BlockAssembler()
    got = events(assembler, {"reasoning_content": "hm"}, {"reasoning_content": "m"},
                 {"content": "\n\n"},  # whitespace before a call opens no text block
                 {"tool_calls": [call(0, '{"a"', "f")]}, {"tool_calls": [call(0, ": 1}")]},
                 {"tool_calls": [call(1, "{}", "g")]})
    assert got == [("start", "reasoning", ""), ("delta", "reasoning", "hm"),
                   ("delta", "reasoning", "m"), ("stop", "reasoning", ""),
                   ("start", "tool_call", ""), ("delta", "tool_call", '{"a"'),
                   ("delta", "tool_call", ": 1}"), ("stop", "tool_call", ""),
                   ("start", "tool_call", ""), ("delta", "tool_call", "{}"),
                   ("stop", "tool_call", "")]
    reasoning, first, second = assembler.blocks
    assert (reasoning.text, first.name, first.text, second.call_id) == (
        "hmm", "f", '{"a": 1}', "call_1")


def test_whitespace_inside_text_is_kept_and_an_empty_output_gets_a_text_block() -> None:
    assembler = BlockAssembler()
    events(assembler, {"content": "a"}, {"content": " "}, {"content": "b"})
    assert [b.text for b in assembler.blocks] == ["a b"]
    assembler = BlockAssembler()
    assert events(assembler, {"content": ""}) == [("start", "text", ""), ("stop", "text", "")]


def test_responses_input_becomes_chat_messages() -> None:
    body = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "max_output_tokens": 9, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_object"}}})
    chat = body.to_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert [c.id for c in chat.messages[2].tool_calls] == ["c1", "c2"]
    assert chat.max_completion_tokens == 9 and chat.tool_choice.function.name == "f"
    assert chat.tools[0].function.name == "f" and chat.response_format.type == "json_object"


def test_messages_request_becomes_chat_messages() -> None:
    body = MessagesRequest.model_validate({
        "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "top_k": 3, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "...", "signature": ""},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "And tomorrow?"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    chat = body.to_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2].tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert (chat.stop, chat.top_k, chat.max_tokens) == (["END"], 3, 5)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "reasoning"}]}, "input"),
])
def test_responses_refusals(body, param) -> None:
    with pytest.raises(InvalidParameterError) as error:
        ResponsesRequest.model_validate(body).to_chat()
    assert error.value.param == param


def test_tool_use_outside_an_assistant_turn_is_refused() -> None:
    body = MessagesRequest.model_validate({"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                      "input": {}}]}]})
    with pytest.raises(InvalidParameterError, match="assistant"):
        body.to_chat()


class FailingServing:
    """Serves one chat delta, then the engine fails the request."""

    @staticmethod
    async def chat_deltas(job, fmt):
        job.usage.record(ChoiceDelta(0, "Hel", (5, 6), None, 2), 0)
        yield ChoiceDelta(0, "Hel", (5, 6), None, 2), {
            "delta": {"content": "Hel"}, "finish_reason": None, "stop_reason": None}
        raise EngineFailed("device lost")


def started(serving_class):
    job = SimpleNamespace(response_id="chatcmpl-req1", usage=UsageCounter([[1, 2, 3]], 1))
    output = Output(job, SimpleNamespace(format=None))  # type: ignore[arg-type]
    return serving_class(FailingServing(), "tiny"), output  # type: ignore[arg-type]


def sse_payloads(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ")]


async def collected(events) -> str:
    return "".join([event async for event in events])


def test_a_failure_mid_stream_ends_a_responses_stream_with_response_failed() -> None:
    serving, output = started(ResponsesServing)
    request = ResponsesRequest.model_validate({"input": "hi", "stream": True})
    response = _Response(request, output, "tiny")
    events = sse_payloads(asyncio.run(collected(serving._events(response))))
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "device lost"}
    assert last["response"]["usage"]["output_tokens"] == 2
    assert last["response"]["usage"]["input_tokens"] == 3
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_failure_mid_stream_ends_a_messages_stream_with_an_error_event() -> None:
    serving, output = started(MessagesServing)
    events = sse_payloads(asyncio.run(collected(serving._events(_Message(output, "tiny")))))
    assert events[0]["type"] == "message_start"
    assert events[-1] == {"type": "error", "error": {"type": "api_error",
                                                     "message": "device lost"}}

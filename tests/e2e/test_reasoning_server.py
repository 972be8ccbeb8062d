"""``--reasoning-parser`` end to end, on a server that also has an API key: the reasoning
as ``reasoning_content`` in chat (whole and streamed), reasoning items in Responses and
``thinking`` blocks in Messages, with exact reasoning-token counts; ``x-api-key``.

The tiny random model never writes ``</think>``, so under ``deepseek_r1`` (reasoning from
the first token) its whole output is reasoning; the split itself is tests/unit's."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from openai import OpenAI
from server_process import ServerProcess

KEY = "reasoning-key-0123456789"
USER = [{"role": "user", "content": "Hello there"}]  # the tiny model answers it in text


@pytest.fixture(scope="module")
def server(tiny_model):
    server = ServerProcess(tiny_model, "--served-model-name", "tiny", "--max-model-len", "256",
                           "--reasoning-parser", "deepseek_r1", "--api-key", KEY)
    yield server
    server.stop()


@pytest.fixture
def openai_client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def test_chat_reasoning_content_whole_and_streamed(openai_client) -> None:
    args = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0}
    full = openai_client.chat.completions.create(**args)
    message = full.choices[0].message
    assert message.content is None and message.reasoning_content
    assert full.usage.completion_tokens == 12
    assert full.usage.completion_tokens_details.reasoning_tokens == 12
    chunks = list(openai_client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                        for c in chunks if c.choices)
    assert reasoning == message.reasoning_content
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12


def test_responses_reasoning_item(openai_client) -> None:
    response = openai_client.responses.create(model="tiny", input=USER, max_output_tokens=12,
                                              temperature=0)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning"]
    assert response.output[0].content[0].type == "reasoning_text"
    assert response.usage.output_tokens_details.reasoning_tokens == 12
    with openai_client.responses.stream(model="tiny", input=USER, max_output_tokens=12,
                                        temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output[0].content[0].text == response.output[0].content[0].text
    assert final.usage.output_tokens_details.reasoning_tokens == 12


def test_messages_thinking_block(claude) -> None:
    args = {"model": "tiny", "max_tokens": 12, "messages": USER,
            "extra_body": {"temperature": 0}}
    message = claude.messages.create(**args)
    [block] = message.content
    assert block.type == "thinking" and block.thinking
    assert message.usage.output_tokens_details.thinking_tokens == 12
    with claude.messages.stream(**args) as stream:
        thinking = "".join(e.delta.thinking for e in stream if e.type == "content_block_delta")
        final = stream.get_final_message()
    assert thinking == final.content[0].thinking == block.thinking


def test_x_api_key_is_honoured(server) -> None:
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as error:
        wrong.messages.create(model="tiny", max_tokens=2, messages=USER)
    assert error.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.base_url + "/v1/chat/completions", headers={"x-api-key": KEY},
                   json={"messages": USER, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    r = httpx.post(server.base_url + "/v1/responses", json={"input": "hi"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_structured_output_waits_for_the_end_of_the_reasoning(openai_client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    full = openai_client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    # the grammar lets the reasoning through: no </think>, no JSON yet
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens_details.reasoning_tokens == 12

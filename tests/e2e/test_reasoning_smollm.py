"""A real split of reasoning from answer, on SmolLM2 under ``--reasoning-parser
deepseek_r1``: asked to repeat a text with ``</think>`` in it, the model writes reasoning,
then an answer. Chat (whole and streamed), Responses and Messages agree on the split and
on the exact reasoning-token count, and a JSON schema applies from the end of the
reasoning."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from openai import OpenAI
from server_process import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user",
           "content": "Repeat exactly, with nothing else: Let me see.</think>Paris"}]
REASONING = "Let me see."


@pytest.fixture(scope="module")
def server():
    # the prompt was chosen for the greedy text of the file's weights in bfloat16: pinned,
    # so that a change of the default weight format does not change what the model writes
    server = ServerProcess(None, "--max-model-len", "2048", "--reasoning-parser", "deepseek_r1",
                           "--quantization", "none")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reasoning_tokens(server) -> int:
    """The tokens of the reasoning and its end marker, as the model writes them."""
    return httpx.post(server.base_url + "/tokenize", timeout=30, json={
        "prompt": REASONING + "</think>", "add_special_tokens": False}).json()["count"]


@pytest.fixture
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_splits_reasoning_from_content(client, reasoning_tokens) -> None:
    args = {"model": client.models.list().data[0].id, "messages": PROMPT, "max_tokens": 30,
            "temperature": 0}
    full = client.chat.completions.create(**args)
    message = full.choices[0].message
    assert message.reasoning_content == REASONING
    assert message.content and "</think>" not in message.content
    assert full.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens


def test_responses_and_messages_agree(server, client, reasoning_tokens) -> None:
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input=PROMPT, max_output_tokens=30,
                                       temperature=0)
    reasoning, answer = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert answer.type == "message"
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=30, messages=PROMPT,
                                     extra_body={"temperature": 0})
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING
    assert text.type == "text" and text.text == answer.content[0].text
    assert message.usage.output_tokens_details.thinking_tokens == reasoning_tokens


def test_json_schema_applies_from_the_end_of_the_reasoning(client, reasoning_tokens) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    full = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=PROMPT, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = full.choices[0].message
    assert message.reasoning_content == REASONING
    assert isinstance(json.loads(message.content)["city"], str)
    assert full.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
